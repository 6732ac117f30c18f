"""Models whose work happens inside an If (a streaming model choosing its path by the sample
rate): their outputs read as decisions, their error localised inside the branch, and what a
tensor kept float there takes with it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _onnx_testing import float_input
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.decisions import decision_rules
from qcal.accuracy.evaluate import compare_models

_OPSET = [helper.make_opsetid("", 17)]


def _branch(name: str, nodes: list[onnx.NodeProto], output: str,
            constants: dict[str, np.ndarray] | None = None) -> onnx.GraphProto:
    return helper.make_graph(
        nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in (constants or {}).items()])


def _if_model(then_branch: onnx.GraphProto, else_branch: onnx.GraphProto,
              x_shape: list[int | str]) -> onnx.ModelProto:
    """y = If(flag) over `x` of `x_shape` read from the outer scope, returned through an
    Identity (as torch.onnx writes a scripted model's output)."""
    nodes = [helper.make_node("If", ["flag"], ["chosen"], name="choose",
                              then_branch=then_branch, else_branch=else_branch),
             helper.make_node("Identity", ["chosen"], ["y"], name="out")]
    graph = helper.make_graph(
        nodes, "g", [float_input("x", x_shape),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=_OPSET, ir_version=8)


def _pooled_sigmoid(prefix: str, bias: float) -> onnx.GraphProto:
    """Sigmoid(x + bias) averaged over axis 1, as a voice-activity model scores a chunk; the
    Sigmoid's input is read from a nested If (a squeeze only when axis 0 is 1)."""
    squeeze = helper.make_node(
        "If", [f"{prefix}_one"], [f"{prefix}_s"], name=f"{prefix}_squeeze",
        then_branch=_branch(f"{prefix}_sq", [helper.make_node("Identity", [f"{prefix}_p"],
                                                              [f"{prefix}_sq_out"])],
                            f"{prefix}_sq_out"),
        else_branch=_branch(f"{prefix}_id", [helper.make_node("Identity", [f"{prefix}_p"],
                                                              [f"{prefix}_id_out"])],
                            f"{prefix}_id_out"))
    nodes = [helper.make_node("Add", ["x", f"{prefix}_b"], [f"{prefix}_t"]),
             helper.make_node("Sigmoid", [f"{prefix}_t"], [f"{prefix}_p"]),
             helper.make_node("Constant", [], [f"{prefix}_one"],
                              value=numpy_helper.from_array(np.array(True))),
             squeeze,
             helper.make_node("ReduceMean", [f"{prefix}_s"], [f"{prefix}_m"], axes=[1],
                              keepdims=0),
             helper.make_node("Unsqueeze", [f"{prefix}_m", f"{prefix}_axes"], [f"{prefix}_o"])]
    return _branch(prefix, nodes, f"{prefix}_o",
                   {f"{prefix}_b": np.array(bias, np.float32),
                    f"{prefix}_axes": np.array([1], np.int64)})


def test_a_sigmoid_every_branch_of_an_if_returns_is_read_as_yes_no_decisions() -> None:
    """The If's output holds decisions at 0.5 when each branch computes it from a Sigmoid
    (through a nested If, a mean and reshapes); the agreement counts them as an independent
    threshold does. A branch returning anything else makes it a value."""
    model = _if_model(_pooled_sigmoid("a", 0.0), _pooled_sigmoid("b", 0.0), ["N", 6])
    assert decision_rules(model)["y"].threshold
    shifted = _if_model(_pooled_sigmoid("a", 0.3), _pooled_sigmoid("b", 0.3), ["N", 6])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    feed = {"x": x, "flag": np.array(True)}

    def mean_sigmoid(bias: float) -> np.ndarray:
        return np.mean(1.0 / (1.0 + np.exp(-(x + bias))), axis=1)

    expected = float(np.mean((mean_sigmoid(0.0) > 0.5) == (mean_sigmoid(0.3) > 0.5)))
    assert 0.0 < expected < 1.0
    out = compare_models(model, shifted, [(feed, 64)]).outputs[0]
    assert out.top1_agreement == pytest.approx(expected)

    relu = _branch("r", [helper.make_node("Relu", ["x"], ["r_o"])], "r_o")
    assert "y" not in decision_rules(_if_model(_pooled_sigmoid("a", 0.0), relu, ["N", 6]))
