"""Latency of quantized models: the float model, qcal's QDQ output and quantize_static's output.

Both quantized models are made in this run from the same calibration set (qcal: default preset,
--method minmax; onnxruntime: QDQ, per-channel, QUInt8 activations, QInt8 weights, MinMax).
Each model is then timed at batch 1 with 1 and 2 intra-op threads, each session alone in a
process of its own with onnxruntime's defaults (its idle threads spin, as a deployment's do),
warmed up, its runs summarised by their median; the processes of one thread count take turns in
a new random order each round, and a session's figure is the median of its rounds. Also reported: what onnxruntime's CPU provider makes of
each graph (integer kernels, leftover QuantizeLinear/DequantizeLinear, float Conv/MatMul/Gemm
in the ORT_ENABLE_ALL optimized graph) and output agreement with the float model on the
evaluation set.

    python benchmarks/bench_latency.py
    python benchmarks/bench_latency.py --quick
    python benchmarks/bench_latency.py --models ppocr_det --repeats 100 --threads 1,2,4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    OutputAgreement,
    default_max_rss_mib,
    machine_info,
    optimized_op_counts,
    ort_job,
    parse_with_quick,
    print_table,
    qcal_cli_cmd,
    qcal_cli_job,
    run_worker,
    split_args,
    summarize_optimized,
    variant_sessions,
    work_dir,
    write_results,
)
from models import ALL_MODELS, BenchmarkSetupError, BenchModel, get_models, iter_samples

QUICK = {"calib_samples": 8, "eval_samples": 8, "repeats": 10, "warmup": 2}
ARGMAX_TASKS = ("classify", "cls", "rec")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=32,
        help="samples for output agreement (the first one is the latency input)",
    )
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per session")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="time more rounds until this long (small models), at most 20x --repeats")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per session first")
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--qcal-method", default="minmax")
    parser.add_argument("--qcal-mode", choices=("library", "cli"), default="library")
    parser.add_argument(
        "--qcal-args", default="", help="extra `qcal calibrate` arguments (cli mode)"
    )
    parser.add_argument("--qcal-config", default="{}", help="extra CalibrationConfig fields, JSON")
    parser.add_argument("--ort-method", default="MinMax")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--max-rss-mib", type=float, default=default_max_rss_mib())
    parser.add_argument("--no-install", action="store_true")
    return parse_with_quick(parser, argv, QUICK)  # type: ignore[no-any-return]


def make_variants(model: BenchModel, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """float, qcal and ort model files; a failed quantization is kept with its message."""
    calib = model.calib_data(args.calib_samples)
    out = work_dir("latency", model.name)
    logs = work_dir("latency", model.name, "logs")
    variants: dict[str, dict[str, Any]] = {"float": {"path": model.path, "ok": True}}
    output, report = out / "qcal.qdq.onnx", out / "qcal.qcal.json"
    eval_data = model.eval_data(args.eval_samples)
    if args.qcal_mode == "cli":
        cmd = qcal_cli_cmd(
            model.path,
            calib,
            output,
            report,
            method=args.qcal_method,
            batch_size=1,
            eval_data=eval_data,
            extra=split_args(args.qcal_args),
        )
        result = run_worker(qcal_cli_job(cmd, report), logs, "qcal", args)
    else:
        job = {
            "kind": "qcal",
            "method": args.qcal_method,
            "model": str(model.path),
            "data": str(calib),
            "batch_size": 1,
            "output": str(output),
            "report": str(report),
            "eval_data": str(eval_data),
            "config": json.loads(args.qcal_config),
        }
        result = run_worker(job, logs, "qcal", args)
    variants["qcal"] = {
        "path": output,
        "ok": result.ok,
        "error": result.error,
        "calibration": result.to_json(),
    }
    job = ort_job(model, args.ort_method, calib, out / "ort.onnx")
    result = run_worker(job, logs, "ort", args)
    variants["ort"] = {
        "path": Path(job["output"]),
        "ok": result.ok,
        "error": result.error,
        "calibration": result.to_json(),
    }
    for name, variant in variants.items():
        if variant["ok"]:
            counts = optimized_op_counts(variant["path"], out / f"{name}.optimized.onnx")
            variant["optimized_graph"] = summarize_optimized(counts)
            variant["optimized_op_counts"] = counts
        print(
            f"[variant] {model.name} {name}: "
            f"{'ok' if variant['ok'] else 'failed: ' + str(variant['error'])}",
            flush=True,
        )
    return variants


LATENCY_ROUNDS = 3  # processes per session, taking turns with the other sessions'


def time_sessions(
    feed: dict[str, np.ndarray], variants: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Median single-run latency on `feed` (batch 1, every input) per (variant, threads): each
    session alone in a process of its own (a ``_worker.py`` latency job), LATENCY_ROUNDS rounds.

    Sessions of one process interleaved run slower by what the others do between their runs:
    with onnxruntime's default spinning, the idle pools of the other two-thread sessions take
    the cores (PP-OCRv6 tiny det's quantized model timed 1.00x its float one at 2 threads so,
    1.29-1.31x in processes of their own); with spinning off, every parallel operator pays
    for waking the pool, more so in a quantized graph of more nodes (1.23x), where a deployment
    keeps the default."""
    thread_counts = [int(t) for t in args.threads.split(",")]
    keys = [(name, threads) for threads in thread_counts
            for name, variant in variants.items() if variant["ok"]]
    medians: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    runs: dict[tuple[str, int], int] = dict.fromkeys(keys, 0)
    order = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="qcal-bench-latency-") as folder:
        logs, feed_file = Path(folder), Path(folder) / "feed.npz"
        np.savez(feed_file, **feed)
        for threads in thread_counts:
            mine = [key for key in keys if key[1] == threads]
            for round_ in range(LATENCY_ROUNDS):
                for index in order.permutation(len(mine)):
                    name, _ = mine[index]
                    job = {"kind": "latency", "model": str(variants[name]["path"]),
                           "feed": str(feed_file), "threads": threads, "warmup": args.warmup,
                           "runs": args.repeats, "seconds": args.min_seconds / LATENCY_ROUNDS}
                    done = run_worker(job, logs, f"{name}-{threads}-{round_}".replace(" ", "_"),
                                      args)
                    if not done.ok:
                        raise RuntimeError(f"timing {name} at {threads} thread(s): {done.error}")
                    medians[mine[index]].append(done.payload["median_seconds"])
                    runs[mine[index]] += int(done.payload["runs"])
    return {
        f"{name}@{threads}": {
            "median_ms": 1e3 * float(np.median(medians[(name, threads)])),
            "round_medians_ms": [1e3 * m for m in medians[(name, threads)]],
            "runs": runs[(name, threads)],
            "input_shape": list(next(iter(feed.values())).shape),
        }
        for name, threads in keys
    }


def agreement(
    model: BenchModel, variants: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Output agreement of each quantized variant with the float model on the evaluation set."""
    sessions = variant_sessions(variants)
    stats = {
        name: OutputAgreement(argmax=model.task in ARGMAX_TASKS)
        for name in sessions
        if name != "float"
    }
    for feed in iter_samples(model.eval_data(args.eval_samples), model.input_name):
        ref = sessions["float"].run(None, feed)[0]
        for name, stat in stats.items():
            stat.update(ref, sessions[name].run(None, feed)[0])
    return {name: stat.result() for name, stat in stats.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        models = get_models(
            [m.strip() for m in args.models.split(",")], install=not args.no_install
        )
    except BenchmarkSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    rows = []
    for model in models:
        variants = make_variants(model, args)
        feed = next(iter_samples(model.eval_data(args.eval_samples), model.input_name))
        latency = time_sessions(feed, variants, args)
        agree = agreement(model, variants, args)
        results[model.name] = {"variants": variants, "latency": latency, "agreement": agree}
        for name, variant in variants.items():
            if not variant["ok"]:
                rows.append([model.name, name, *([None] * 9), f"failed: {variant['error']}"[:60]])
                continue
            graph = variant["optimized_graph"]
            metrics = agree.get(name, {})
            for threads in args.threads.split(","):
                lat = latency[f"{name}@{threads}"]
                ref = latency.get(f"float@{threads}")
                rows.append(
                    [
                        model.name,
                        name,
                        threads,
                        lat["median_ms"],
                        f"{lat['median_ms'] / ref['median_ms']:.2f}x" if ref else None,
                        graph["integer_nodes"],
                        graph["quantize_linear"],
                        graph["dequantize_linear"],
                        graph["float_compute_nodes"],
                        metrics.get("sqnr_db"),
                        _top1(metrics),
                        "ok",
                    ]
                )
    print_table(
        f"Latency at batch 1 (each session in a process of its own: median of "
        f"{LATENCY_ROUNDS} processes taking turns, each the median of at least {args.repeats} "
        f"runs and of {args.min_seconds / LATENCY_ROUNDS:g} s of runs) and onnxruntime's "
        "optimized graph (ORT_ENABLE_ALL)",
        [
            "model",
            "variant",
            "threads",
            "median ms",
            "x float",
            "int nodes",
            "Q",
            "DQ",
            "float conv/mm",
            "SQNR dB",
            "top-1 agr",
            "status",
        ],
        rows,
    )
    path = write_results(
        "latency", {"machine": machine_info(), "args": vars(args), "models": results}
    )
    print(f"\nJSON: {path}")
    return 0


def _top1(metrics: dict[str, Any]) -> str | None:
    value = metrics.get("top1_agreement")
    return None if value is None else f"{100 * value:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
