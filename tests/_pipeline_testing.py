"""Calibration runs on small models: their files and data, and a run that also returns what the
pipeline handed to sensitivity measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qcal import _accuracy_stage, pipeline
from qcal.config import CalibrationConfig
from qcal.pipeline import CalibrationResult


def calibrate_capturing_sensitivity(path: Path, config: CalibrationConfig) -> dict[str, Any]:
    """Calibrate `path` (the config must ask for sensitivity); returns the prepared `model`,
    `plan`, `acts` and `weights` that `measure_sensitivity` got, its `result`, and the
    calibration's own result as `calibration`."""
    captured: dict[str, Any] = {}
    original = _accuracy_stage.measure_sensitivity

    def capture(model, plan, acts, weights, batches, **kwargs):  # type: ignore[no-untyped-def]
        captured.update(model=model, plan=plan, acts=acts, weights=weights)
        captured["result"] = original(model, plan, acts, weights, batches, **kwargs)
        return captured["result"]

    _accuracy_stage.measure_sensitivity = capture
    try:
        captured["calibration"] = pipeline.calibrate(path, config)
    finally:
        _accuracy_stage.measure_sensitivity = original
    return captured


def save_with_data(
    folder: Path, stem: str, model: onnx.ModelProto, seed: int, *, calib: int = 32,
    evaluate: int = 0, features: int = 8,
) -> tuple[Path, np.ndarray | None]:
    """Write `model` as ``<stem>.onnx`` with ``<stem>.calib.npz`` (and ``<stem>.eval.npz`` when
    `evaluate` rows are asked for) of standard-normal rows for its input ``x``; returns the
    model's path and the evaluation rows."""
    path = folder / f"{stem}.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(seed)
    np.savez(folder / f"{stem}.calib.npz", x=rng.standard_normal((calib, features)).astype(np.float32))
    if not evaluate:
        return path, None
    data = rng.standard_normal((evaluate, features)).astype(np.float32)
    np.savez(folder / f"{stem}.eval.npz", x=data)
    return path, data


def calibrated_as_planned(model: onnx.ModelProto, folder: Path,
                          **arrays: np.ndarray) -> CalibrationResult:
    """`model` saved in `folder` as ``m.onnx`` and calibrated on `arrays` (one per input, saved
    as ``calib.npz``) as planned: no fallback."""
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "calib.npz", **arrays)
    return pipeline.calibrate(folder / "m.onnx",
                              CalibrationConfig(data=folder / "calib.npz", fallback=False))
