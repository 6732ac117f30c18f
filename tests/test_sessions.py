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
