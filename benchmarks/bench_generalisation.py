"""Benchmark of generalisation: qcal and onnxruntime's quantize_static on models qcal was not tuned on.

Models: the generalisation models (PyTorch TorchScript and dynamo exports, Keras and JAX through
tf2onnx, PaddlePaddle through paddle2onnx, pretrained models from other projects' wheels; built by ``benchmarks/generalisation/build_*.py`` into
``benchmarks/.cache/generalisation/<name>/``) and the three PP-OCR models of ``models.py``.

Variants, each from the same calibration data:

- ``qcal default``: ``qcal calibrate MODEL --data CALIB`` (as a subprocess; its exit code is kept);
- ``qcal --no-fallback``: the same with ``--no-fallback``, only when ``qcal calibrate --help``
  lists that flag (otherwise skipped, with a note under the table);
- ``ort``: onnxruntime ``quantize_static`` as ``_common.ort_job`` sets it (QDQ, per-channel,
  QUInt8 activations, QInt8 weights, MinMax, every op type it knows).

Per variant: the model's task metric against the float model on the same evaluation samples
(generalisation models: ``top1`` / ``frames`` argmax agreement or mean ``cosine`` of output 0,
``decisions`` at p > 0.5, a detector's ``box_f1``, a CTC recognizer's ``strings``;
PP-OCR: box F1, string agreement, direction agreement as ``eval_ppocr.py`` computes them), the
batch-1 latency ratio to the float model at 1 and 2 threads (``bench_latency.time_sessions``:
each session in a process of its own, the median of rounds taking turns), the share of Conv/MatMul/Gemm MACs quantized (qcal: its report;
onnxruntime: counted in the graph as ``eval_ppocr.compute_coverage`` does), qcal's exit code and
the wall time of the calibration process.

    python benchmarks/bench_generalisation.py
    python benchmarks/bench_generalisation.py --quick --markdown
    python benchmarks/bench_generalisation.py --quick --readme README.md
    python benchmarks/bench_generalisation.py --models torch_vit,keras_lstm,ppocr_cls
    python benchmarks/bench_generalisation.py --quick --variant "mse=--method mse --no-fallback"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import bench_latency
import numpy as np
from _common import (
    QCAL_CLI,
    RUN_ID,
    OutputAgreement,
    compile_qcal_bytecode,
    default_max_rss_mib,
    git_commit,
    machine_info,
    ort_job,
    parse_with_quick,
    print_table,
    qcal_cli_cmd,
    run_child,
    run_worker,
    variant_sessions,
    work_dir,
    write_results,
)
from _gen_table import format_metric, format_sqnr, latency_ratio, summary_markdown, write_readme
from detector_boxes import box_f1
from eval_ppocr import compute_coverage, ctc_indices, evaluate
from models import BENCH_DIR, CACHE_DIR, BenchmarkSetupError, get_models

SCRIPT = "generalisation"
GEN_DIR = CACHE_DIR / "generalisation"
# The models the builders in benchmarks/generalisation/ write (other folders with a task.json
# found there are benchmarked too).
GEN_MODELS = (
    "torch_cnn_bn",
    "torch_dwsep",
    "torch_vit",
    "torch_encoder",
    "torch_gru_stream",
    "keras_cnn",
    "keras_lstm",
    "jax_mixer",
    "paddle_cnn",
    "paddle_lstm",
    "torch_vad",
    "torch_prelu",
    "torch_minilm",
    "pretrained_layout",
    "pretrained_textdet",
    "pretrained_filetype",
    "pretrained_vad",
    "pretrained_captcha_ocr",
    "pretrained_captcha_det",
)
PPOCR_MODELS = ("ppocr_det", "ppocr_rec", "ppocr_cls")
# name prefix -> (build script, its virtual environment under .cache/, its requirements file)
BUILDERS = {
    "torch_": ("build_torch.py", "venv-export", "requirements-export.txt"),
    "keras_": ("build_keras.py", "venv-tf", "requirements-tf.txt"),
    "jax_": ("build_jax.py", "venv-tf", "requirements-tf.txt"),
    "paddle_": ("build_paddle.py", "venv-paddle", "requirements-paddle.txt"),
    "pretrained_": ("build_pretrained.py", None, None),  # this interpreter: pillow, onnxruntime
}
PPOCR_INFO = {  # family, exporter (the rapidocr_onnxruntime 1.4.4 files)
    "ppocr_det": "PP-OCRv4 det (DBNet) / paddle2onnx",
    "ppocr_rec": "PP-OCRv4 rec (SVTR-LCNet, CTC) / paddle2onnx",
    "ppocr_cls": "PP-OCR mobile v2.0 cls / paddle2onnx",
}
METRIC_NAMES = {"top1": "top-1 agreement", "frames": "frame agreement", "cosine": "mean cosine",
                "decisions": "frame decisions (p > 0.5)", "score_f1": "score F1 (p > 0.5)",
                "box_f1": "box F1 (IoU 0.5)", "strings": "string agreement (CTC)"}

# `qcal calibrate` arguments per qcal variant (model, --data, -o, --report, --force, -q are
# added); a variant whose flags `qcal calibrate --help` does not list is skipped.
QCAL_VARIANTS: dict[str, list[str]] = {
    "qcal default": [],
    "qcal --no-fallback": ["--no-fallback"],
}
ORT = "ort quantize_static"
ORT_METHOD = "MinMax"
ORT_WORKER = "--ort-worker"  # hidden mode: this script as the quantize_static child process

QUICK = {
    "eval_samples": 50,
    "ppocr_calib_samples": 4,
    "ppocr_eval_samples": 8,
    "repeats": 10,
    "warmup": 2,
}


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class GenModel:
    """A generalisation model folder: model.onnx, calib.npz, eval.npz and task.json."""

    name: str
    folder: Path
    task: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.folder / "model.onnx"

    @property
    def inputs(self) -> list[str]:
        return list(self.task["inputs"])

    @property
    def input_name(self) -> str:  # what ort_job and time_sessions read
        return self.inputs[0]

    @property
    def metric(self) -> str:
        return str(self.task["metric"])

    def calib_data(self) -> Path:
        return self.folder / "calib.npz"

    def eval_data(self, n: int = 0) -> Path:
        return self.folder / "eval.npz"

    def feeds(self, n: int) -> Iterator[dict[str, np.ndarray]]:
        """The first `n` evaluation samples as feeds of every input (batch 1, graph order)."""
        yield from islice(sample_feeds(self.eval_data(), self.task, 1), n)

    def label(self) -> str:
        exporter = str(self.task.get("exporter", "?"))
        if "exporter_kind" in self.task:
            exporter = f"torch.onnx ({self.task['exporter_kind']})"
        elif "jax2tf" in exporter:
            exporter = "jax2tf + tf2onnx"
        elif "from_keras" in exporter:
            exporter = "tf2onnx (Keras)"
        elif "paddle2onnx" in exporter:
            exporter = "paddle2onnx"
        return f"{self.task.get('family', '?')} / {exporter}"


def sample_feeds(path: Path, task: dict[str, Any], batch_size: int,
                 ) -> Iterator[dict[str, np.ndarray]]:
    """The samples of a stacked .npz as feeds of every input, as qcal reads them: an array of
    the input's rank gives rows [i, i + batch_size), one of rank + 1 (an input whose batch is
    not its first axis, a scalar) gives x[i], one sample per feed."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    ranks = {k: len(task["input_shapes"][k]) for k in arrays}
    stacked = {k for k, v in arrays.items() if v.ndim == ranks[k] + 1}
    step = 1 if stacked else batch_size
    rows = len(next(iter(arrays.values())))
    for i in range(0, rows, step):
        yield {k: np.asarray(v[i]) if k in stacked else v[i : i + step]
               for k, v in arrays.items()}


def find_gen_models(names: Sequence[str], folder: Path) -> tuple[list[GenModel], list[str]]:
    """The named models that are built, and a note (with the build command) for each missing."""
    found, missing = [], []
    for name in names:
        task_file = folder / name / "task.json"
        if task_file.is_file() and (folder / name / "model.onnx").is_file():
            found.append(GenModel(name, folder / name, json.loads(task_file.read_text())))
            continue
        missing.append(
            f"{name}: not built ({folder / name} has no task.json); {build_command(name)}"
        )
        print(f"[skip] {missing[-1]}", file=sys.stderr, flush=True)
    return found, missing


def build_command(name: str) -> str:
    prefix = next((p for p in BUILDERS if name.startswith(p)), None)
    if prefix is None:
        return "no builder in benchmarks/generalisation/ makes it"
    script, venv, requirements = BUILDERS[prefix]
    if venv is None:
        return f"build it with: python benchmarks/generalisation/{script} --models {name}"
    rel_venv = (CACHE_DIR / venv).relative_to(BENCH_DIR.parent)
    steps = []
    if not (CACHE_DIR / venv / "bin" / "python").exists():
        steps += [
            f"python -m venv {rel_venv}",
            f"{rel_venv}/bin/pip install -r benchmarks/generalisation/{requirements}",
        ]
    steps.append(f"{rel_venv}/bin/python benchmarks/generalisation/{script} --models {name}")
    return "build it with: " + " && ".join(steps)


# ----------------------------------------------------------------------------- quantizing


def qcal_flags_available(flags: Sequence[str]) -> tuple[bool, str]:
    """Whether `qcal calibrate --help` lists every flag in `flags` (and the help, for the JSON)."""
    proc = subprocess.run(
        [*QCAL_CLI, "calibrate", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    listed = all(
        re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout)
        for f in flags
        if f[:2] == "--"
    )
    return proc.returncode == 0 and listed, proc.stdout


def run_qcal(
    model: Any, calib: Path, out: Path, logs: Path, name: str, extra: list[str], args: Any
) -> dict[str, Any]:
    """`qcal calibrate` as a subprocess; keeps its exit code, wall time and report sections."""
    stem = name.replace(" ", "_").replace("-", "")
    output, report = out / f"{stem}.qdq.onnx", out / f"{stem}.qcal.json"
    cmd = qcal_cli_cmd(
        model.path, calib, output, report, method=None, batch_size=1, eval_data=None, extra=extra
    )
    result = run_child(
        cmd, log_stem=logs / stem, timeout_s=args.timeout, max_rss_mib=args.max_rss_mib
    )
    variant: dict[str, Any] = {
        "path": output,
        # usable when it wrote a model, whatever the exit code (a failed gate still writes it)
        "ok": output.is_file(),
        "exit_code": result.returncode,
        "error": result.error,
        "calib_seconds": result.wall_seconds,
        "peak_rss_mib": result.peak_rss_mib,
        "command": cmd[1:],
        "log": logs / f"{stem}.err",
    }
    if report.is_file():
        data = json.loads(report.read_text())
        variant["qcal_report"] = {
            k: v
            for k, v in data.items()
            if k in ("config", "coverage", "evaluation", "timings_seconds", "gates", "warnings")
            or "fallback" in k
        }
    return variant


def run_ort(
    model: Any, calib: Path, out: Path, logs: Path, args: Any, *, name: str = "ort",
    method: str = ORT_METHOD, op_types: Sequence[str] = (),
) -> dict[str, Any]:
    """quantize_static in a `_worker.py` process (``ort_job``); generalisation models, which may
    have several inputs, go through this script's ``--ort-worker`` mode instead. `method` is a
    CalibrationMethod name, `op_types` its op_types_to_quantize (empty: its default)."""
    job = ort_job(model, method, calib, out / f"{name}.qdq.onnx")
    if op_types:
        job["op_types"] = list(op_types)
    if isinstance(model, GenModel):
        result_file = logs / f"{name}.result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), ORT_WORKER, json.dumps(job)]
        result = run_child(
            [*cmd, str(result_file)],
            log_stem=logs / name,
            timeout_s=args.timeout,
            max_rss_mib=args.max_rss_mib,
            result_file=result_file,
        )
    else:
        result = run_worker(job, logs, name, args)
    return {
        "path": Path(job["output"]),
        "ok": result.ok and Path(job["output"]).is_file(),
        "exit_code": None,
        "error": result.error,
        "calib_seconds": result.wall_seconds,
        "peak_rss_mib": result.peak_rss_mib,
        "quantize_static_seconds": result.payload.get("seconds"),
        "log": logs / f"{name}.err",
    }


def _ort_worker(argv: list[str]) -> int:
    """``_worker.py``'s ort job with a reader that feeds every input of a stacked .npz."""
    import _worker

    def all_inputs(path: Path, _input: str, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        task = json.loads((path.parent / "task.json").read_text())
        return sample_feeds(path, task, batch_size)

    _worker.iter_batches = all_inputs  # run_ort's reader looks the name up at each rewind
    sys.argv = [_worker.__file__, *argv]
    return _worker.main()


def ort_variants(args: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """--ort-variant NAME=METHOD[:OP,OP...] -> {"ort NAME": (METHOD, ops)}."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for spec in args.ort_variant or ():
        name, _, rest = spec.partition("=")
        method, _, ops = rest.partition(":")
        out[f"ort {name}"] = (method or ORT_METHOD, tuple(o for o in ops.split(",") if o))
    return out


def make_variants(
    model: Any, calib: Path, qcal_variants: dict[str, list[str]], args: Any
) -> dict[str, dict[str, Any]]:
    out = work_dir(SCRIPT, model.name)
    logs = work_dir(SCRIPT, model.name, "logs")
    variants: dict[str, dict[str, Any]] = {"float": {"path": model.path, "ok": True}}
    for name, extra in qcal_variants.items():
        variants[name] = run_qcal(model, calib, out, logs, name, extra, args)
    variants[ORT] = run_ort(model, calib, out, logs, args)
    for name, (method, op_types) in ort_variants(args).items():
        variants[name] = run_ort(model, calib, out, logs, args, name=name.replace(" ", "_"),
                                 method=method, op_types=op_types)
    for name, v in variants.items():
        if name != "float":
            code = "" if v["exit_code"] is None else f"exit {v['exit_code']}, "
            state = "ok" if v["ok"] and not v["error"] else f"{v['error']}"
            print(
                f"[quantize] {model.name} {name}: {code}{v['calib_seconds']:.1f} s, {state}",
                flush=True,
            )
    return variants


def check_runs(variants: dict[str, dict[str, Any]], feed: dict[str, np.ndarray]) -> None:
    """Mark a model onnxruntime cannot load or run on `feed` as failed, with its message."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    for name, v in variants.items():
        if not v["ok"] or name == "float":
            continue
        try:
            ort.InferenceSession(str(v["path"]), options, providers=["CPUExecutionProvider"]).run(
                None, feed
            )
        except Exception as err:  # noqa: BLE001 - onnxruntime's words go into the table
            v["ok"] = False
            v["error"] = "onnxruntime cannot run it: " + " ".join(str(err).split())[:300]
            print(f"[run] {name}: {v['error']}", flush=True)


# ----------------------------------------------------------------------------- measuring


def gen_metrics(
    model: GenModel, variants: dict[str, dict[str, Any]], n: int
) -> dict[str, dict[str, Any]]:
    """Task metric against the float model on the first `n` evaluation samples: of output 0,
    or of the score maps a detector lists as `score_outputs` (SQNR and agreement of output 0);
    a detector with a `box_decoder` is judged by its boxes (`detector_boxes`), read from every
    output."""
    sessions = variant_sessions(variants)
    out0 = model.task["outputs"][0]
    decoder = model.task.get("box_decoder")
    read = list(model.task["outputs"] if decoder else
                model.task.get("score_outputs") or [out0])
    scores = [read.index(o) for o in model.task.get("score_outputs") or [out0]]
    refs, outs, hws = [], {name: [] for name in sessions if name != "float"}, []
    for feed in model.feeds(n):
        refs.append(sessions["float"].run(read, feed))
        hws.append(feed[model.input_name].shape[2:])
        for name, chunks in outs.items():
            chunks.append(sessions[name].run(read, feed))
    ref = np.concatenate([r[0] for r in refs], axis=0)
    labels_file = model.folder / "eval.labels.npy"
    labels = np.load(labels_file)[: len(ref)] if labels_file.is_file() else None
    results: dict[str, dict[str, Any]] = {}
    for name, chunks in outs.items():
        quant = np.concatenate([c[0] for c in chunks], axis=0)
        agreement = OutputAgreement(argmax=model.metric != "cosine")
        agreement.update(ref, quant)
        f = ref.reshape(len(ref), -1).astype(np.float64)
        q = quant.reshape(len(quant), -1).astype(np.float64)
        cosine = (f * q).sum(1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1) + 1e-30)
        row: dict[str, Any] = {
            "measure": METRIC_NAMES.get(model.metric, model.metric),
            "metric": model.metric,
            "samples": len(ref),
            "output": out0,
            "argmax_agreement": float((ref.argmax(-1) == quant.argmax(-1)).mean()),
            "cosine": float(cosine.mean()),
            "outputs": agreement.result(),
        }
        if model.metric == "decisions":  # sigmoid probabilities: the yes/no at 0.5
            row["decision_agreement"] = float(((ref > 0.5) == (quant > 0.5)).mean())
        if model.metric in ("score_f1", "box_f1"):  # (anchor, class) scores above 0.5
            row["score_f1"] = _score_f1([[r[i] for i in scores] for r in refs],
                                        [[c[i] for i in scores] for c in chunks])
        if decoder:
            row["box_f1"], row["float_boxes_per_sample"] = box_f1(decoder, refs, chunks, hws)
        if model.metric == "strings":  # a CTC recognizer's logits [T, N, classes]
            row["string_agreement"] = float(np.mean([
                ctc_indices(r[0].swapaxes(0, 1)) == ctc_indices(c[0].swapaxes(0, 1))
                for r, c in zip(refs, chunks)]))
        key = {"cosine": "cosine", "decisions": "decision_agreement", "score_f1": "score_f1",
               "box_f1": "box_f1", "strings": "string_agreement"}.get(model.metric,
                                                                      "argmax_agreement")
        row["task_vs_float"] = row[key]
        if labels is not None and model.metric == "top1":
            row["accuracy_float"] = float((ref.argmax(-1) == labels).mean())
            row["accuracy_quantized"] = float((quant.argmax(-1) == labels).mean())
        results[name] = row
    return results


def _score_f1(refs: list[list[np.ndarray]], quants: list[list[np.ndarray]]) -> float:
    """F1 of the quantized model's scores above 0.5 against the float model's."""
    hits = misses = extra = 0
    for ref_maps, quant_maps in zip(refs, quants):
        for r, q in zip(ref_maps, quant_maps):
            hits += int(((r > 0.5) & (q > 0.5)).sum())
            misses += int(((r > 0.5) & (q <= 0.5)).sum())
            extra += int(((r <= 0.5) & (q > 0.5)).sum())
    return 2 * hits / max(2 * hits + misses + extra, 1)


def coverage_of(name: str, variant: dict[str, Any], feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """qcal: the report's coverage; onnxruntime: DQ-fed Conv/MatMul/Gemm MACs in the graph."""
    if not variant["ok"]:
        return {}
    try:
        graph = compute_coverage(variant["path"], feed)
    except Exception as err:  # noqa: BLE001 - a count that fails is a "-", not a stop
        graph = {"mac_fraction": None, "error": f"{type(err).__name__}: {err}"[:300]}
    if name.startswith("ort"):
        return {"fraction": graph["mac_fraction"], "basis": "graph MACs", "graph": graph}
    report = (variant.get("qcal_report") or {}).get("coverage") or {}
    return {
        "fraction": report.get("macs_quantized_fraction"),
        "basis": report.get("basis"),
        "report": report,
        "graph": graph,
    }


def bench_model(model: Any, qcal_variants: dict[str, list[str]], args: Any) -> dict[str, Any]:
    started = time.perf_counter()
    if isinstance(model, GenModel):
        calib = model.calib_data()
        variants = make_variants(model, calib, qcal_variants, args)
        quantized = time.perf_counter()
        first = next(model.feeds(1))
        check_runs(variants, first)
        metrics = gen_metrics(model, variants, args.eval_samples)
    else:
        calib = model.calib_data(args.ppocr_calib_samples)
        eval_path = model.eval_data(args.ppocr_eval_samples)
        variants = make_variants(model, calib, qcal_variants, args)
        quantized = time.perf_counter()
        first = next(iter(bench_latency.iter_samples(eval_path, model.input_name)))
        check_runs(variants, first)
        truths = model.truth("eval", args.ppocr_eval_samples)
        metrics = evaluate(model, variants, eval_path, truths)
        metrics.pop("float", None)
    evaluated = time.perf_counter()
    coverage = {
        name: coverage_of(name, v, first) for name, v in variants.items() if name != "float"
    }
    counted = time.perf_counter()
    lat = bench_latency.time_sessions(first, variants, args)  # every input, batch 1
    done = time.perf_counter()
    print(
        f"[time] {model.name}: data and quantizing {quantized - started:.0f} s, task metric "
        f"{evaluated - quantized:.0f} s, MACs {counted - evaluated:.0f} s, latency "
        f"{done - counted:.0f} s",
        flush=True,
    )
    return {
        "kind": "generalisation" if isinstance(model, GenModel) else "ppocr",
        "label": model.label() if isinstance(model, GenModel) else PPOCR_INFO[model.name],
        "task": model.task if isinstance(model, GenModel) else {"task": model.task},
        "calibration_data": calib,
        "variants": variants,
        "metrics": metrics,
        "coverage": coverage,
        "latency": lat,
    }


# ----------------------------------------------------------------------------- output


def table_rows(name: str, result: dict[str, Any], threads: list[str]) -> list[list[Any]]:
    rows = []
    for variant_name, v in result["variants"].items():
        if variant_name == "float":
            continue
        metric = result["metrics"].get(variant_name, {})
        cov = result["coverage"].get(variant_name, {})
        ratios = [None if (r := latency_ratio(result, variant_name, t)) is None else f"{r:.2f}x"
                  for t in threads]
        status = "ok"
        if not v["ok"]:
            status = f"failed: {v['error']}"[:80]
        elif v.get("error"):
            status = f"model written; {v['error']}"[:80]
        rows.append(
            [
                name,
                result["label"],
                variant_name,
                metric.get("measure") or _measure_name(result),
                format_metric(metric),
                format_sqnr(metric),
                *ratios,
                _format_coverage(cov),
                "-" if v["exit_code"] is None else v["exit_code"],
                f"{v['calib_seconds']:.1f}",
                status,
            ]
        )
    return rows


def _measure_name(result: dict[str, Any]) -> str:
    task = result["task"]
    if "metric" in task:
        return METRIC_NAMES.get(task["metric"], task["metric"])
    return {"det": "box F1", "rec": "string agreement", "cls": "direction agreement"}.get(
        task.get("task"), "?"
    )


def _format_coverage(cov: dict[str, Any]) -> str | None:
    fraction = cov.get("fraction")
    if fraction is None:
        return None
    suffix = " (nodes)" if cov.get("basis") == "nodes" else ""
    return f"{100 * fraction:.1f} %{suffix}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated: generalisation models (folders of --models-dir) and/or "
        "ppocr_det, ppocr_rec, ppocr_cls [default: all of them]",
    )
    parser.add_argument("--models-dir", type=Path, default=GEN_DIR)
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=200,
        help="evaluation samples of the generalisation models (the first N of eval.npz)",
    )
    parser.add_argument("--ppocr-calib-samples", type=int, default=32)
    parser.add_argument("--ppocr-eval-samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per session")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="time more rounds until this long (small models), at most 20x --repeats")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per session first")
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--readme", type=Path, default=None, metavar="README",
                        help="write the summary table (one row per model) into README between "
                        "its generalisation-table markers")
    parser.add_argument("--from-json", type=Path, default=None, metavar="RESULTS",
                        help="run nothing: print (and with --readme write) the summary table "
                        "of a run's results JSON")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--max-rss-mib", type=float, default=default_max_rss_mib())
    parser.add_argument("--no-install", action="store_true")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="an extra qcal variant: its name and `qcal calibrate` flags, e.g. "
        "'mse=--method mse --no-fallback' (repeatable)",
    )
    parser.add_argument(
        "--ort-variant", action="append", default=[], metavar="NAME=METHOD[:OPS]",
        help="an extra quantize_static run: a CalibrationMethod and optionally the op types "
        "to quantize, e.g. 'entropy=Entropy' or 'cmg=MinMax:Conv,MatMul,Gemm' (repeatable)",
    )
    return parse_with_quick(parser, argv, QUICK)  # type: ignore[no-any-return]


def summary(run: dict[str, Any], readme: Path | None) -> None:
    """Print the summary table of a run and, with `readme`, write it there."""
    table = summary_markdown(run)
    print("\nSummary, one row per model\n\n" + table)
    if readme is not None:
        write_readme(readme, table)
        print(f"written into {readme}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        run = json.loads(args.from_json.read_text())
        run.setdefault("run", args.from_json.stem.removeprefix(f"{SCRIPT}-"))  # older files
        summary(run, args.readme)
        return 0
    if args.markdown:
        os.environ["QCAL_BENCH_MARKDOWN"] = "1"
    if args.models is None:
        others = {p.parent.name for p in args.models_dir.glob("*/task.json")} - set(GEN_MODELS)
        names = [*GEN_MODELS, *sorted(others), *PPOCR_MODELS]
    else:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
    notes: list[str] = []
    gen_names = [n for n in names if n not in PPOCR_MODELS]
    gen_models, missing = find_gen_models(gen_names, args.models_dir)
    notes += missing
    ppocr: list[Any] = []
    ppocr_names = [n for n in names if n in PPOCR_MODELS]
    if ppocr_names:
        try:
            ppocr = get_models(ppocr_names, install=not args.no_install)
        except BenchmarkSetupError as err:
            notes.append(f"PP-OCR models skipped: {err}")
            print(f"[skip] {notes[-1]}", file=sys.stderr, flush=True)

    qcal_variants: dict[str, list[str]] = {}
    help_text = ""
    extra_variants = {}
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--variant {spec!r}: expected NAME=FLAGS")
        extra_variants[f"qcal {name.strip()}"] = flags.split()
    for name, extra in {**QCAL_VARIANTS, **extra_variants}.items():
        if not extra:
            qcal_variants[name] = extra
            continue
        available, help_text = qcal_flags_available(extra)
        if available:
            qcal_variants[name] = extra
        else:
            notes.append(
                f"`{name}` not run: `qcal calibrate --help` does not list "
                f"`{' '.join(f for f in extra if f.startswith('--'))}` in this qcal "
                f"({machine_info().get('qcal')})."
            )

    compile_qcal_bytecode()
    results: dict[str, Any] = {}
    rows: list[list[Any]] = []
    threads = [t.strip() for t in args.threads.split(",")]
    for model in [*gen_models, *ppocr]:
        print(f"[model] {model.name}", flush=True)
        results[model.name] = bench_model(model, qcal_variants, args)
        rows += table_rows(model.name, results[model.name], threads)

    notes.append(
        f"Task metric vs the float model on the first {args.eval_samples} evaluation samples "
        f"(generalisation models; at most what eval.npz holds) or {args.ppocr_eval_samples} "
        f"(PP-OCR, which calibrate on {args.ppocr_calib_samples} samples; the generalisation "
        "models on all of calib.npz); SQNR dB: of that output against the float model's on "
        "the same samples (generalisation models). Latency: batch 1, each session alone in "
        f"a process of its own (onnxruntime's defaults), the median of at least {args.repeats} "
        f"runs and of {args.min_seconds / bench_latency.LATENCY_ROUNDS:g} s of runs, the "
        f"median of {bench_latency.LATENCY_ROUNDS} such processes taking turns, as a ratio to "
        "the float model at the same thread count. Calib s: wall time of the calibration "
        "process (interpreter start and imports included; qcal runs without --eval-data)."
    )
    print_table(
        "Generalisation: qcal and onnxruntime quantize_static, float vs quantized",
        [
            "model",
            "family / exporter",
            "variant",
            "metric",
            "vs float",
            "SQNR dB",
            *[f"latency x float ({t} thr)" for t in threads],
            "MACs quantized",
            "qcal exit",
            "calib s",
            "status",
        ],
        rows,
    )
    print()
    for note in notes:
        print(f"- {note}")
    run = {
        "run": RUN_ID,
        "commit": git_commit(),
        "machine": machine_info(),
        "args": vars(args),
        "qcal_variants": qcal_variants,
        "qcal_variants_skipped": sorted(set(QCAL_VARIANTS) - set(qcal_variants)),
        "qcal_calibrate_help": help_text or None,
        "ort_method": ORT_METHOD,
        "notes": notes,
        "models": results,
    }
    path = write_results(SCRIPT, run)
    print(f"\nJSON: {path}")
    summary(run, args.readme)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == ORT_WORKER:
        sys.exit(_ort_worker(sys.argv[2:]))
    sys.exit(main())
