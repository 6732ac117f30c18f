"""Every figure of a run compares the quantized model with the float model qcal prepared from
the user's: a preparation that changed what the model computes (as onnx's converter did to a
linear Upsample) fails the built-in prepared-model gate (exit 7) instead of passing unseen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import helper

from qcal import pipeline
from qcal.cli import main


def test_a_preparation_that_changes_what_the_model_computes_fails_a_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(33)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["features"], name="conv2")]
    inits = {"w1": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2,
             "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
             "w2": rng.standard_normal((8, 16, 1, 1)).astype(np.float32) * 0.2,
             "b2": rng.standard_normal(8).astype(np.float32) * 0.1}
    model = build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["features"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 8, 12, 12)).astype(np.float32))
    args = ["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "calib.npz"),
            "-o", str(tmp_path / "q.onnx"), "--report", str(tmp_path / "q.json"),
            "--allow-slower", "--force"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output  # prepared as it computes: no gate
    real = pipeline.prepare_model

    def altered(*args: Any, **kwargs: Any) -> Any:  # a preparation gone wrong: 1.5x the output
        prepared, steps = real(*args, **kwargs)
        for tensor in prepared.graph.initializer:
            if tensor.name in ("w2", "b2"):
                tensor.CopyFrom(onnx.numpy_helper.from_array(
                    onnx.numpy_helper.to_array(tensor) * np.float32(1.5), tensor.name))
        return prepared, steps

    monkeypatch.setattr(pipeline, "prepare_model", altered)
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 7, result.output
    report = json.loads((tmp_path / "q.json").read_text())
    gate = next(g for g in report["gates"] if g["option"] == "prepared-model")
    # the error is half the user's output: 20 log10(2) dB
    assert not gate["passed"] and gate["value"] == pytest.approx(20 * np.log10(2), abs=0.01)
