"""A calibration run that also returns what the pipeline handed to sensitivity measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qcal import pipeline
from qcal.config import CalibrationConfig


def calibrate_capturing_sensitivity(path: Path, config: CalibrationConfig) -> dict[str, Any]:
    """Calibrate `path` (the config must ask for sensitivity); returns the prepared `model`,
    `plan`, `acts` and `weights` that `measure_sensitivity` got, its `result`, and the
    calibration's own result as `calibration`."""
    captured: dict[str, Any] = {}
    original = pipeline.measure_sensitivity

    def capture(model, plan, acts, weights, batches, **kwargs):  # type: ignore[no-untyped-def]
        captured.update(model=model, plan=plan, acts=acts, weights=weights)
        captured["result"] = original(model, plan, acts, weights, batches, **kwargs)
        return captured["result"]

    pipeline.measure_sensitivity = capture
    try:
        captured["calibration"] = pipeline.calibrate(path, config)
    finally:
        pipeline.measure_sensitivity = original
    return captured
