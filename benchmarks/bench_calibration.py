"""Calibration cost: qcal and onnxruntime's quantize_static against plain float inference.

For every model and calibration-set size, in one run and on the same data, each in its own
process: plain float inference over the calibration set (the floor any calibration has to pay),
qcal's calibration per method, and onnxruntime's ``quantize_static`` per comparable method.
Repeats are interleaved (every job of a repeat runs before any job of the next) and summarised
by their median; ratios are taken against the float run of the same repeat.

    python benchmarks/bench_calibration.py                      # all models, 32/64/128 samples
    python benchmarks/bench_calibration.py --quick              # a smoke run, under 3 minutes
    python benchmarks/bench_calibration.py --models ppocr_rec --samples 32,256 --methods minmax
    python benchmarks/bench_calibration.py --models generalisation --methods minmax  # see below

`--models generalisation` (or one of its names) adds the models bench_generalisation.py builds
into benchmarks/.cache/generalisation; each is calibrated on its own calib.npz (all of its
inputs, whatever `--samples` says) and evaluated on its eval.npz.

Results: a table on stdout, JSON in benchmarks/results/calibration-<time>.json (and -latest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    COMPARABLE,
    ORT_METHODS,
    QCAL_METHODS,
    ChildResult,
    compile_qcal_bytecode,
    default_max_rss_mib,
    machine_info,
    median,
    parse_with_quick,
    print_table,
    qcal_cli_cmd,
    qcal_cli_job,
    run_worker,
    split_args,
    work_dir,
    write_results,
)
from _ratios import render_ratios
from models import ALL_MODELS, BenchmarkSetupError, get_models

HISTOGRAM_METHODS = ("percentile", "entropy", "mse")
QCAL_TOOLS = {"auto": "qcal", "numpy": "qcal", "numba": "qcal[fast]"}

QUICK = {
    "models": "digits_cnn,transformer_block,ppocr_cls,ppocr_rec,ppocr_det",
    "samples": "8",
    "methods": "minmax,entropy",
    "ort_methods": "MinMax,Entropy",
    "repeats": 1,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", default=",".join(ALL_MODELS), help="comma-separated model names"
    )
    parser.add_argument("--samples", default="32,64,128", help="calibration-set sizes")
    parser.add_argument(
        "--methods", default=",".join(QCAL_METHODS), help="qcal methods ('' for none)"
    )
    parser.add_argument(
        "--ort-methods",
        default=",".join(ORT_METHODS),
        help="quantize_static methods ('' for none): " + ", ".join(ORT_METHODS),
    )
    parser.add_argument(
        "--kernels",
        default="numpy,numba" if importlib.util.find_spec("numba") else "numpy",
        help="kernels of the qcal histogram jobs, one job each: numpy (QCAL_KERNELS=numpy, the "
        "core path, shown as `qcal`) and numba (QCAL_KERNELS=auto with numba installed, as a "
        "user of the qcal[fast] extra runs, shown as `qcal[fast]`); min-max methods use no "
        "kernel and run once",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1, help="samples per run, all tools")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of the float reference (0: onnxruntime's default, as qcal)",
    )
    parser.add_argument(
        "--qcal-mode",
        choices=("library", "cli"),
        default="library",
        help="call qcal.pipeline.calibrate in a worker, or run `python -m qcal.cli`",
    )
    parser.add_argument(
        "--qcal-args", default="", help="extra `qcal calibrate` arguments (cli mode)"
    )
    parser.add_argument(
        "--qcal-config",
        default='{"fallback": false}',
        help="extra CalibrationConfig fields as JSON (library mode); the default leaves out the "
        "fallback search, which quantize_static has no counterpart of",
    )
    parser.add_argument(
        "--qcal-eval-samples",
        type=int,
        default=4,
        help="size of the evaluation set handed to qcal (its evaluate stage is "
        "timed apart and left out of the calibration time)",
    )
    parser.add_argument(
        "--ort-preprocess",
        action="store_true",
        help="run onnxruntime's quant_pre_process before quantize_static (timed in)",
    )
    parser.add_argument(
        "--keep-outputs", action="store_true", help="keep the quantized models (deleted by default)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    parser.add_argument(
        "--max-rss-mib",
        type=float,
        default=default_max_rss_mib(),
        help="kill a job whose RSS passes this (default 80%% of RAM)",
    )
    parser.add_argument("--no-install", action="store_true", help="never pip-install anything")
    return parse_with_quick(parser, argv, QUICK)  # type: ignore[no-any-return]


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class _GeneralisationModel:
    """A model of bench_generalisation.py seen as the jobs here see a BenchModel: its own
    calibration and evaluation files, every input fed."""

    def __init__(self, model: Any) -> None:
        self.name, self.path = model.name, model.path
        self.input_name = ",".join(model.inputs)
        self._folder = model.folder

    def calib_data(self, n: int) -> Path:
        return Path(self._folder) / "calib.npz"

    def eval_data(self, n: int) -> Path:
        return Path(self._folder) / "eval.npz"

    def samples(self) -> int:
        with np.load(self.calib_data(0), allow_pickle=False) as data:
            return int(data[self.input_name.split(",")[0]].shape[0])


def _load_models(names: list[str], install: bool) -> list[Any]:
    """BenchModels by name, and the generalisation models asked for ("generalisation": all
    that are built)."""
    from bench_generalisation import GEN_DIR, GEN_MODELS, find_gen_models

    wanted = [n for n in names if n in GEN_MODELS or n == "generalisation"]
    general = list(GEN_MODELS) if "generalisation" in wanted else wanted
    models: list[Any] = get_models([n for n in names if n not in wanted], install=install)
    found, _missing = find_gen_models(general, GEN_DIR)
    return models + [_GeneralisationModel(m) for m in found]


def build_jobs(model: Any, n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The jobs of one (model, sample count) cell: float reference, qcal and ort per method."""
    data = model.calib_data(n)
    base = {
        "model": str(model.path),
        "input": model.input_name,
        "data": str(data),
        "batch_size": args.batch_size,
        "samples_requested": n,
        "model_name": model.name,
    }
    jobs = [dict(base, kind="float", tool="float", method="-", threads=args.threads)]
    out = work_dir("calibration", model.name)
    eval_data = model.eval_data(args.qcal_eval_samples) if args.qcal_eval_samples > 0 else None
    for method in _names(args.methods):
        choices = _names(args.kernels) if method in HISTOGRAM_METHODS else ["auto"]
        for kernels in choices:
            stem = out / f"qcal-{method}-{kernels}-{n}"
            jobs.append(
                dict(
                    base,
                    kind="qcal",
                    tool=QCAL_TOOLS[kernels],
                    # numba runs as a user with the extra gets it: QCAL_KERNELS=auto
                    kernels="auto" if kernels == "numba" else kernels,
                    method=method,
                    output=str(stem) + ".qdq.onnx",
                    report=str(stem) + ".qcal.json",
                    eval_data=str(eval_data) if eval_data else None,
                    config=json.loads(args.qcal_config),
                )
            )
    for method in _names(args.ort_methods):
        jobs.append(
            dict(
                base,
                kind="ort",
                tool="ort",
                method=method,
                output=str(out / f"ort-{method}-{n}.onnx"),
                preprocess=args.ort_preprocess,
            )
        )
    return jobs


def run_job(job: dict[str, Any], args: argparse.Namespace, tag: str) -> ChildResult:
    logs = work_dir("calibration", job["model_name"], "logs")
    if job["kind"] == "qcal" and args.qcal_mode == "cli":
        cmd = qcal_cli_cmd(
            Path(job["model"]),
            Path(job["data"]),
            Path(job["output"]),
            Path(job["report"]),
            method=job["method"],
            batch_size=job["batch_size"],
            eval_data=Path(job["eval_data"]) if job["eval_data"] else None,
            extra=split_args(args.qcal_args),
        )
        return run_worker(qcal_cli_job(cmd, Path(job["report"])), logs, tag, args)
    return run_worker(job, logs, tag, args)


def job_seconds(job: dict[str, Any], result: ChildResult) -> float | None:
    """The time compared with float inference: qcal without its evaluate stage, others whole."""
    if not result.ok:
        return None
    if job["kind"] == "qcal":
        return result.payload.get("calibration_seconds", result.payload.get("seconds"))
    return result.payload.get("seconds")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        models = _load_models(_names(args.models), install=not args.no_install)
    except BenchmarkSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    compile_qcal_bytecode()
    sizes = [int(s) for s in _names(args.samples)]
    cells = []
    for model in models:
        # a generalisation model has one calibration set, of its own size
        for n in [model.samples()] if isinstance(model, _GeneralisationModel) else sizes:
            print(f"[data] {model.name}: {n} calibration samples", flush=True)
            cells.append((model, n, build_jobs(model, n, args)))
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for model, n, jobs in cells:
            # rotate the order each repeat so no job always runs first (cold caches) or last
            order = jobs[0:1] + _rotate(jobs[1:], repeat)
            for job in order:
                tag = f"{job['tool']}-{job['method']}-{n}-r{repeat}".replace("[fast]", "-fast")
                result = run_job(job, args, tag)
                if not args.keep_outputs:  # only the cost is measured here; models can be large
                    for key in ("output",):
                        if job.get(key):
                            Path(job[key]).unlink(missing_ok=True)
                            Path(job[key]).with_suffix(".prep.onnx").unlink(missing_ok=True)
                seconds = job_seconds(job, result)
                status = "ok" if result.ok else f"failed: {result.error}"
                print(
                    f"[run {repeat + 1}/{args.repeats}] {model.name} n={n} {job['tool']} "
                    f"{job['method']}: {_fmt(seconds)} s, peak {result.peak_rss_mib:.0f} MiB, "
                    f"{status}",
                    flush=True,
                )
                runs.append(
                    {
                        "repeat": repeat,
                        "model": model.name,
                        "samples": n,
                        "tool": job["tool"],
                        "method": job["method"],
                        "seconds": seconds,
                        "job": job,
                        **result.to_json(),
                    }
                )
    summary = summarize(runs)
    per_sample = marginal_costs(summary)
    render(summary, per_sample, args)
    path = write_results(
        "calibration",
        {
            "machine": machine_info(),
            "args": vars(args),
            "summary": summary,
            "per_sample": per_sample,
            "runs": runs,
        },
    )
    print(f"\nJSON: {path}")
    return 0


def _rotate(items: list[Any], k: int) -> list[Any]:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, samples, tool, method): median time, median paired ratio, peak RSS."""
    reference: dict[tuple[str, int, int], float] = {}
    for run in runs:
        if run["tool"] == "float" and run["seconds"] is not None:
            reference[(run["model"], run["samples"], run["repeat"])] = run["seconds"]
    groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run["model"], run["samples"], run["tool"], run["method"])].append(run)
    rows = []
    for (model, n, tool, method), group in groups.items():
        ok = [r for r in group if r["ok"]]
        times = [r["seconds"] for r in ok if r["seconds"] is not None]
        ratios = [
            r["seconds"] / reference[(model, n, r["repeat"])]
            for r in ok
            if r["seconds"] is not None and (model, n, r["repeat"]) in reference
        ]
        peaks = [r["peak_rss_mib"] for r in ok]
        baselines = [
            r["payload"].get("baseline_rss_mib")
            for r in ok
            if r["payload"].get("baseline_rss_mib") is not None
        ]
        errors = sorted({r["error"] for r in group if not r["ok"] and r["error"]})
        rows.append(
            {
                "model": model,
                "samples": n,
                "tool": tool,
                "method": method,
                "runs": len(group),
                "ok_runs": len(ok),
                "seconds_median": median(times),
                "seconds_all": times,
                "ratio_to_float_median": median(ratios),
                "peak_rss_mib_max": max(peaks) if peaks else None,
                "baseline_rss_mib": median(baselines),
                "peak_minus_baseline_mib": (max(peaks) - median(baselines))
                if peaks and baselines
                else None,
                "comparable_ort_method": COMPARABLE.get(method) if tool != "ort" else None,
                "errors": errors,
            }
        )
    return rows


def render(
    summary: list[dict[str, Any]], per_sample: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        tool_rank = {"float": 0, "qcal": 1, "qcal[fast]": 2, "ort": 3}[row["tool"]]
        method_rank = _method_rank(row)
        return (row["model"], row["samples"], method_rank, tool_rank)

    rows = []
    for row in sorted(summary, key=key):
        status = "ok" if not row["errors"] else f"failed: {row['errors'][0]}"[:70]
        if row["errors"] and row["ok_runs"]:
            status = f"{row['ok_runs']}/{row['runs']} ok; " + status
        rows.append(
            [
                row["model"],
                row["samples"],
                f"{row['tool']} {row['method']}".strip(" -"),
                row["seconds_median"],
                _ratio(row["ratio_to_float_median"]),
                row["peak_rss_mib_max"],
                row["peak_minus_baseline_mib"],
                status,
            ]
        )
    print_table(
        f"Calibration wall time vs plain float inference (median of {args.repeats}, "
        f"batch {args.batch_size}); peak RSS per process",
        ["model", "N", "job", "time s", "x float", "peak MiB", "peak-base MiB", "status"],
        rows,
    )
    render_ratios(summary)
    _render_growth(summary)
    _render_marginal(per_sample)


def marginal_costs(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, job): time per extra sample between the smallest and the largest set, and
    its ratio to float inference's; the intercept is the job's fixed cost (loading, session
    creation, graph rewriting), which the per-sample figure leaves out."""
    sizes = sorted({r["samples"] for r in summary})
    if len(sizes) < 2:
        return []
    small, large = sizes[0], sizes[-1]
    times: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    for row in summary:
        if row["seconds_median"] is not None:
            times[(row["model"], row["tool"], row["method"])][row["samples"]] = row[
                "seconds_median"
            ]
    rows = []
    for (model, tool, method), by_n in sorted(times.items()):
        floor = times.get((model, "float", "-"), {})
        if small not in by_n or large not in by_n or small not in floor or large not in floor:
            continue
        per_sample = (by_n[large] - by_n[small]) / (large - small)
        float_per_sample = (floor[large] - floor[small]) / (large - small)
        rows.append(
            {
                "model": model,
                "tool": tool,
                "method": method,
                "samples": [small, large],
                "seconds_per_sample": per_sample,
                "fixed_seconds": by_n[small] - per_sample * small,
                "ratio_to_float_per_sample": per_sample / float_per_sample
                if float_per_sample > 0
                else None,
            }
        )
    return rows


def _render_marginal(per_sample: list[dict[str, Any]]) -> None:
    """The rows of :func:`marginal_costs` as a table."""
    if not per_sample:
        return
    small, large = per_sample[0]["samples"]
    rows = [
        [
            row["model"],
            f"{row['tool']} {row['method']}".strip(" -"),
            f"{row['seconds_per_sample'] * 1e3:.1f}",
            _ratio(row["ratio_to_float_per_sample"]),
            f"{row['fixed_seconds']:.2f}",
        ]
        for row in per_sample
    ]
    print_table(
        f"Cost per extra sample, from {small} to {large} samples (fixed cost apart)",
        ["model", "job", "ms/sample", "x float", "fixed s"],
        rows,
    )


def _method_rank(row: dict[str, Any]) -> int:
    order = [
        "-",
        "minmax",
        "MinMax",
        "moving-average",
        "MinMax-MovingAverage",
        "percentile",
        "Percentile",
        "entropy",
        "Entropy",
        "mse",
    ]
    return order.index(row["method"]) if row["method"] in order else len(order)


def _ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _render_growth(summary: list[dict[str, Any]]) -> None:
    """Peak RSS against the calibration-set size: the flatness target of the histogram work."""
    sizes = sorted({r["samples"] for r in summary})
    if len(sizes) < 2:
        return
    table: dict[tuple[str, str], dict[int, float | None]] = defaultdict(dict)
    for row in summary:
        table[(row["model"], f"{row['tool']} {row['method']}".strip(" -"))][row["samples"]] = row[
            "peak_rss_mib_max"
        ]
    rows = []
    for (model, job), by_n in sorted(table.items()):
        first, last = by_n.get(sizes[0]), by_n.get(sizes[-1])
        growth = (last / first) if first and last else None
        rows.append(
            [
                model,
                job,
                *[by_n.get(n) for n in sizes],
                None if growth is None else f"{growth:.2f}x",
            ]
        )
    print_table(
        "Peak RSS (MiB) by calibration-set size",
        ["model", "job", *map(str, sizes), f"{sizes[-1]}/{sizes[0]}"],
        rows,
    )


if __name__ == "__main__":
    sys.exit(main())
