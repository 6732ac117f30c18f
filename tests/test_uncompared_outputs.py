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

from qcal._verdict import agreement_cell
from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.output_metrics import floor_sqnr_applies
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


def _lengths_model(shift: float) -> onnx.ModelProto:
    """y: the values of x above 0.5 (after adding `shift`), as many as there are: an output of
    values whose length depends on them, as a speech model's waveform does on its durations."""
    nodes = [helper.make_node("Add", ["x", "shift"], ["moved"], name="add"),
             helper.make_node("Greater", ["moved", "half"], ["above"], name="gt"),
             helper.make_node("Compress", ["moved", "above"], ["y"], name="keep", axis=1)]
    inits = [numpy_helper.from_array(np.array(shift, np.float32), "shift"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    graph = helper.make_graph(nodes, "g", [float_input("x", [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_values_whose_length_changes_are_decisions_of_shape_said_as_such() -> None:
    """A sample whose output comes out longer or shorter disagrees as a whole; an output of
    values has no other decisions, so its agreement is the share of samples of the float
    model's shape, said so (it read "37.50 % of the decisions agree" on a VITS waveform), and
    its SQNR over the others is held to the floor too."""
    rng = np.random.default_rng(2)
    samples = rng.uniform(0.0, 1.0, (8, 1, 64)).astype(np.float32)
    samples[np.abs(samples - 0.5) < 0.02] = 0.9  # none near 0.5 ...
    samples[[3, 5], 0, 0] = 0.498                # ... but in two samples, which get longer
    batches = [({"x": s}, 1) for s in samples]
    (y,) = compare_models(_lengths_model(0.0), _lengths_model(0.005), batches).outputs
    assert y.decisions == "shape" and y.decision_count == len(samples)
    assert y.top1_agreement == pytest.approx(6 / 8)
    assert y.sqnr_db is not None and floor_sqnr_applies(y.top1_agreement, y.decisions,
                                                        y.variation_sqnr_db)
    assert agreement_cell({"top1_agreement": y.top1_agreement, "decisions": y.decisions}
                          ).endswith("% of shapes")
