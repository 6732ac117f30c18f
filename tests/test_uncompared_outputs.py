"""Outputs the evaluation cannot compare (sequences, maps, strings) are named, never dropped
without a word, and a model with no numeric output gets no accuracy verdict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import float_input
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.cli import main


def _model(with_tensor_output: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        helper.make_node("SplitToSequence", ["y"], ["parts"], name="split", axis=1),
    ]
    outputs = [helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None)]
    if with_tensor_output:
        outputs.insert(0, helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]))
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w1", (16, 64)), ("w2", (64, 4)))]
    graph = helper.make_graph(nodes, "g", [float_input("x", ["N", 16])], outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("with_tensor_output", [True, False])
def test_a_sequence_output_is_named_as_not_compared(
    tmp_path: Path, with_tensor_output: bool
) -> None:
    model_path = tmp_path / "m.onnx"
    onnx.save(_model(with_tensor_output), model_path)
    data = np.random.default_rng(6).standard_normal((32, 16)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=data)
    # --no-fallback: a random MLP's 4 scores are near one another, and the floor's checks find
    # it short of 99 % agreement (98.5 % of 5000 other samples); compared here is what is named
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(model_path), "--data", str(tmp_path / "calib.npz"), "-o",
        str(tmp_path / "q.onnx"), "--report", str(tmp_path / "q.json"), "--allow-slower",
        "--no-fallback"], catch_exceptions=False)
    report = json.loads((tmp_path / "q.json").read_text())
    assert [o["name"] for o in report["evaluation"]["outputs"]] == (
        ["y"] if with_tensor_output else [])
    assert any("'parts' is a sequence" in w and "not compared" in w
               for w in report["warnings"]), report["warnings"]
    if with_tensor_output:  # measured and said
        assert result.exit_code == 0, result.output
        assert "of the decisions agree with the float model" in result.output
    else:  # nothing measured: no "within the floor" said of it
        assert result.exit_code == 0, result.output
        assert "quality: not measured" in result.output
        assert "within the accuracy floor" not in result.output
