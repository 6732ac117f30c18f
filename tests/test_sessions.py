"""How many onnxruntime sessions a run builds: the quantized model is checked and first evaluated
in one session, and the result is the same as with a session of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qcal import pipeline
from qcal.accuracy import evaluate, runnable
from qcal.config import CalibrationConfig

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def _calibrate_counting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> tuple[dict[str, Any], list[str]]:
    built: list[str] = []

    def counting(module: Any) -> None:
        original = module.create_session

        def create(model: Any, **kwargs: Any) -> Any:
            built.append(f"{module.__name__.rsplit('.', 1)[-1]}:{kwargs.get('what')}")
            return original(model, **kwargs)

        monkeypatch.setattr(module, "create_session", create)

    counting(runnable)
    counting(evaluate)
    config = CalibrationConfig(fallback=False)
    result = pipeline.calibrate(
        SAMPLES / "digits_cnn.onnx", config, output=tmp_path / f"{name}.qdq.onnx",
        report_path=tmp_path / f"{name}.qcal.json",
    )
    report = dict(result.report)
    report.pop("timings_seconds")
    report["output_model"] = {k: v for k, v in report["output_model"].items() if k != "path"}
    return report, built


def test_the_checked_session_serves_the_first_evaluation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    report, built = _calibrate_counting(monkeypatch, tmp_path, "shared")
    assert built == ["runnable:quantized model", "evaluate:float model"]
    # Without the hand-over, the evaluation builds the quantized model's session again and
    # computes the same figures.
    monkeypatch.undo()
    original = runnable.Runnable
    monkeypatch.setattr(
        runnable, "Runnable",
        lambda model, plan, repaired, session=None: original(model, plan, repaired),
    )
    again, built_again = _calibrate_counting(monkeypatch, tmp_path, "own")
    assert built_again == [
        "runnable:quantized model", "evaluate:float model", "evaluate:quantized model"
    ]
    assert again == report


def test_sessions_do_not_spin_except_those_timed_for_latency(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import onnxruntime as ort

    from qcal.calibration import runtime

    spinning: dict[str, list[bool]] = {}
    original = ort.InferenceSession

    def recording(model: Any, sess_options: Any = None, **kwargs: Any) -> Any:
        session = original(model, sess_options=sess_options, **kwargs)
        try:
            entry = sess_options.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # not set: onnxruntime's default, spinning
            entry = None
        threads = sess_options.intra_op_num_threads
        spinning.setdefault("one thread" if threads == 1 else "default", []).append(entry != "0")
        return session

    monkeypatch.setattr(runtime.ort, "InferenceSession", recording)
    pipeline.calibrate(
        SAMPLES / "digits_cnn.onnx", CalibrationConfig(fallback=False),
        output=tmp_path / "q.onnx", report_path=tmp_path / "q.json",
    )
    # calibration, the runnable check and the evaluation: idle threads sleep, leaving the
    # cores to qcal's work between runs; the latency pair spins as a deployment would
    assert spinning["default"] and not any(spinning["default"])
    assert spinning["one thread"] == [True, True]
