"""One measured job in its own process: ``python _worker.py JOB_JSON RESULT_JSON``.

Jobs:
- ``float``: plain float inference over a data set (session creation + every batch);
- ``ort``: onnxruntime ``quantize_static`` with a CalibrationDataReader over the same data;
- ``qcal``: ``qcal.pipeline.calibrate`` through the library;
- ``qcal-cli``: ``qcal calibrate ARGV`` through the click command, in this process;
- ``latency``: one model's batch-1 runs on one feed, timed with onnxruntime's default session
  options but the thread count (its idle threads spin, as in a deployment), the only session
  of its process.

Imports happen before the clock starts, and the resident memory after them is reported as the
baseline, so each job's time and memory are its own work. The result JSON always has ``ok``;
a failure carries a one-line ``error``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from models import iter_batches


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def run_float(job: dict[str, Any]) -> dict[str, Any]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(job.get("threads", 0))
    started = time.perf_counter()
    session = ort.InferenceSession(job["model"], options, providers=["CPUExecutionProvider"])
    created = time.perf_counter()
    samples = 0
    for feed in iter_batches(Path(job["data"]), job["input"], int(job["batch_size"])):
        session.run(None, feed)
        samples += next(iter(feed.values())).shape[0]
    done = time.perf_counter()
    return {
        "seconds": done - started,
        "session_seconds": created - started,
        "inference_seconds": done - created,
        "samples": samples,
    }


def run_ort(job: dict[str, Any]) -> dict[str, Any]:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.count = 0
            self.rewind()

        def get_next(self) -> dict[str, np.ndarray] | None:
            feed = next(self._batches, None)
            if feed is not None:
                self.count += next(iter(feed.values())).shape[0]
            return feed

        def rewind(self) -> None:
            self._batches = iter_batches(Path(job["data"]), job["input"], int(job["batch_size"]))

    method, _, variant = job["method"].partition("-")
    extra: dict[str, Any] = dict(job.get("extra_options", {}))
    if variant == "MovingAverage":
        extra["CalibMovingAverage"] = True
    model = job["model"]
    started = time.perf_counter()
    prep_seconds = 0.0
    if job.get("preprocess"):
        from onnxruntime.quantization.shape_inference import quant_pre_process

        prepped = str(Path(job["output"]).with_suffix(".prep.onnx"))
        quant_pre_process(model, prepped)
        model = prepped
        prep_seconds = time.perf_counter() - started
    reader = Reader()
    quantize_static(
        model,
        job["output"],
        reader,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=getattr(CalibrationMethod, method),
        op_types_to_quantize=job.get("op_types") or None,
        extra_options=extra,
    )
    done = time.perf_counter()
    return {
        "seconds": done - started,
        "preprocess_seconds": prep_seconds,
        "samples": reader.count,
        "extra_options": extra,
    }


# Stages of a qcal run that check the result rather than make it (quantize_static does none of
# this): left out of the calibration time, kept in the JSON.
ACCURACY_STAGES = ("evaluate", "sensitivity", "localise", "fallback", "latency")


def run_qcal(job: dict[str, Any]) -> dict[str, Any]:
    from qcal.config import CalibrationConfig
    from qcal.pipeline import calibrate

    kwargs: dict[str, Any] = dict(job.get("config", {}))
    kwargs.update(method=job["method"], data=Path(job["data"]), batch_size=int(job["batch_size"]))
    if job.get("eval_data"):
        kwargs["eval_data"] = Path(job["eval_data"])
    config = CalibrationConfig(**kwargs)
    started = time.perf_counter()
    result = calibrate(
        Path(job["model"]),
        config,
        output=Path(job["output"]),
        report_path=Path(job["report"]),
        force=True,
        enforce_gates=False,  # the cost is measured here, not the verdict
    )
    done = time.perf_counter()
    timings = dict(result.report.get("timings_seconds", {}))
    accuracy = sum(float(timings.get(stage, 0.0)) for stage in ACCURACY_STAGES)
    return {
        "seconds": done - started,
        "timings_seconds": timings,
        "calibration_seconds": done - started - accuracy,
        "coverage": result.report.get("coverage"),
    }


def run_qcal_cli(job: dict[str, Any]) -> dict[str, Any]:
    """`qcal calibrate ...` through its click entry point, in this process (so VmHWM is its own)."""
    from qcal.cli import main as qcal_main

    captured = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stderr(captured):
            qcal_main.main(args=job["argv"], prog_name="qcal", standalone_mode=False)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    done = time.perf_counter()
    sys.stderr.write(captured.getvalue())
    if code:
        lines = [ln.strip() for ln in captured.getvalue().splitlines() if ln.strip()]
        raise RuntimeError(f"exit code {code}: {lines[-1] if lines else 'no message'}")
    try:
        timings = json.loads(Path(job["report"]).read_text()).get("timings_seconds", {})
    except (OSError, ValueError):
        timings = {}
    calib = done - started - sum(float(timings.get(stage, 0.0)) for stage in ACCURACY_STAGES)
    return {"seconds": done - started, "timings_seconds": timings, "calibration_seconds": calib}


def run_latency(job: dict[str, Any]) -> dict[str, Any]:
    """Median seconds of `runs` timed runs at least, and more until `seconds` have passed, after
    `warmup` untimed ones."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(job["threads"])
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(job["model"], options, providers=["CPUExecutionProvider"])
    with np.load(job["feed"]) as stored:
        feed = {name: stored[name] for name in stored.files}
    for _ in range(int(job["warmup"])):
        session.run(None, feed)
    times: list[float] = []
    deadline = time.perf_counter() + float(job["seconds"])
    while len(times) < int(job["runs"]) or time.perf_counter() < deadline:
        begin = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - begin)
    return {"median_seconds": float(np.median(times)), "runs": len(times)}


JOBS = {"float": run_float, "ort": run_ort, "qcal": run_qcal, "qcal-cli": run_qcal_cli,
        "latency": run_latency}


def main() -> int:
    job = json.loads(sys.argv[1])
    result_path = Path(sys.argv[2])
    if job.get("kernels"):  # read by qcal at its first histogram batch
        os.environ["QCAL_KERNELS"] = job["kernels"]
    if job["kind"] in ("qcal", "qcal-cli"):
        try:  # import before the clock, like onnxruntime; a failure here is reported as such
            import qcal.cli
            import qcal.pipeline  # noqa: F401
        except BaseException as err:  # noqa: BLE001 - any failure of qcal becomes a table entry
            result_path.write_text(json.dumps({"ok": False, "error": _one_line(err)}))
            return 1
    baseline = _status_mib("VmRSS")
    try:
        payload = JOBS[job["kind"]](job)
        payload["ok"] = True
        code = 0
    except BaseException as err:  # noqa: BLE001 - reported to the parent, never hidden
        payload = {"ok": False, "error": _one_line(err), "traceback": traceback.format_exc()}
        code = 1
    payload["baseline_rss_mib"] = baseline
    payload["vmhwm_mib"] = _status_mib("VmHWM")
    result_path.write_text(json.dumps(payload))
    return code


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300]


if __name__ == "__main__":
    sys.exit(main())
