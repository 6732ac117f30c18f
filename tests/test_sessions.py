"""How many onnxruntime sessions a run builds: the quantized model is checked and first evaluated
in one session, and the result is the same as with a session of its own."""

from __future__ import annotations

import shutil
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


def test_the_calibration_pass_hands_its_float_outputs_to_the_evaluation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Evaluated on the calibration data, the float model's outputs are those the calibration
    pass computed: the evaluation's float session never runs, and the figures are those of a
    run that computes them itself."""
    original = evaluate.create_session

    class Idle:  # the float session: its outputs' description only
        def __init__(self, session: Any) -> None:
            self.session = session

        def get_outputs(self) -> Any:
            return self.session.get_outputs()

        def run(self, *_: Any) -> Any:
            raise AssertionError("the float model ran again in the evaluation")

    def create(model: Any, **kwargs: Any) -> Any:
        session = original(model, **kwargs)
        return Idle(session) if kwargs.get("what") == "float model" else session

    monkeypatch.setattr(evaluate, "create_session", create)
    # the model without the evaluation file next to it: evaluated on its calibration data
    for name in ("digits_cnn.onnx", "digits_cnn.calib.npz"):
        shutil.copy(SAMPLES / name, tmp_path / name)
    config = CalibrationConfig(fallback=False)
    handed = pipeline.calibrate(tmp_path / "digits_cnn.onnx", config,
                                output=tmp_path / "handed.onnx").report
    assert handed["evaluation"]["data"] == "calibration"
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "_output_sink", lambda model, reference: None)
    computed = pipeline.calibrate(tmp_path / "digits_cnn.onnx", config,
                                  output=tmp_path / "computed.onnx").report
    assert (tmp_path / "handed.onnx").read_bytes() == (tmp_path / "computed.onnx").read_bytes()
    assert handed["evaluation"] == computed["evaluation"]


def test_evaluation_and_latency_sessions_sleep_while_the_calibration_session_spins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from qcal.accuracy import latency
    from qcal.calibration import collect

    spinning: dict[str, list[bool]] = {}

    def recording(module: Any) -> None:
        original = module.create_session

        def create(model: Any, **kwargs: Any) -> Any:
            session = original(model, **kwargs)
            options = session.get_session_options()
            try:
                entry = options.get_session_config_entry("session.intra_op.allow_spinning")
            except RuntimeError:  # not set: onnxruntime's default, spinning
                entry = None
            spinning.setdefault(str(kwargs.get("what")), []).append(entry != "0")
            return session

        monkeypatch.setattr(module, "create_session", create)

    for module in (collect, runnable, evaluate, latency):
        recording(module)
    pipeline.calibrate(
        SAMPLES / "digits_cnn.onnx", CalibrationConfig(method="minmax", fallback=False),
        output=tmp_path / "q.onnx", report_path=tmp_path / "q.json",
    )
    # The evaluation alternates two sessions (the checked one and the float one): idle, each
    # sleeps and leaves the cores to the other and to the metrics. So do the two the latency
    # check alternates (spinning, at 2 threads one model timed 0.75x or 1.3x itself).
    # checked and evaluated; timed at 1 and at 2 threads
    assert spinning["quantized model"] == [False, False, False]
    assert spinning["float model"] == [False, False, False]  # evaluated; timed at 1 and 2
    assert spinning["calibration model"] == [True]  # in-graph extremes: little work between runs
