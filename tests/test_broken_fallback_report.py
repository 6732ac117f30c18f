"""A quantized model that computes infinities where the float one does not (a log-mel front
end: the log of a clipped filterbank product, whose smallest values the 8-bit grid rounds to
0) fails every gate, and its report, fallback steps included, is valid JSON that names the
broken output."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from _onnx_testing import build_model, float_input
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.numerics.errors import AccuracyGateError
from qcal.pipeline import calibrate
from qcal.report import report_schema


def _no_constants(name: str) -> float:
    raise AssertionError(f"{name} in the report")


def test_infinities_only_the_quantized_model_computes_are_reported_not_crashed_on(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["power", "filterbank"], ["mel"], name="filters"),
        helper.make_node("Clip", ["mel", "floor"], ["clipped"], name="clip"),
        helper.make_node("Log", ["clipped"], ["features"], name="log"),
    ]
    inits = {"filterbank": rng.uniform(0, 1, (256, 64)).astype(np.float32),
             "floor": np.array(1e-9, np.float32)}
    model = build_model(nodes, [float_input("power", ["N", 100, 256])], ["features"], inits)
    path = tmp_path / "frontend.onnx"
    path.write_bytes(model.SerializeToString())
    # a power spectrum: decades apart between loud and quiet frames
    power = (rng.exponential(1.0, (32, 100, 256))
             * 10.0 ** rng.uniform(-8, 2, (32, 100, 1))).astype(np.float32)
    np.savez(tmp_path / "calib.npz", power=power)

    with pytest.raises(AccuracyGateError, match="non-finite output values"):
        calibrate(path, CalibrationConfig(data=tmp_path / "calib.npz"),
                  output=tmp_path / "q.onnx", report_path=tmp_path / "q.json")
    report = json.loads((tmp_path / "q.json").read_text(), parse_constant=_no_constants)
    jsonschema.validate(report, report_schema())
    outputs = {o["name"]: o for o in report["evaluation"]["outputs"]}
    assert outputs["features"]["nonfinite_introduced"] > 0
    broken_steps = [s for s in report["fallback"]["steps"] if s.get("broken_outputs")]
    assert broken_steps and all(s["broken_outputs"] == ["features"] for s in broken_steps)
    assert all(s["worst_sqnr_db"] is None or np.isfinite(s["worst_sqnr_db"])
               for s in report["fallback"]["steps"])
