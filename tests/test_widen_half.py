"""The widen-half preparation pass: a float16/bfloat16 model computed in float32 inside, with the
same inputs and outputs as before, checked against the original model run in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.passes import WidenHalf
from qcal.graph.passes.widen_half import half_precision_types


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def _half_model() -> onnx.ModelProto:
    """float16 input and weights, an int64 input cast to float16, a float16 Constant and
    ConstantOfShape, an If whose branches compute in float16, a float32 output cast from
    float16, and a float16 input passed straight through to an output."""
    rng = np.random.default_rng(3)
    then_out = helper.make_tensor_value_info("then_y", TensorProto.FLOAT16, None)
    else_out = helper.make_tensor_value_info("else_y", TensorProto.FLOAT16, None)
    half = helper.make_tensor("half", TensorProto.FLOAT16, [], [0.5])
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["m", "half"], ["then_y"], name="then_mul")],
        "then", [], [then_out], [half])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["m"], ["else_y"], name="else_neg")], "else", [], [else_out])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"),
        helper.make_node("Cast", ["ids"], ["ids_half"], name="ids_cast", to=TensorProto.FLOAT16),
        helper.make_node("Add", ["t", "ids_half"], ["a"], name="add_ids"),
        helper.make_node("Constant", [], ["c"], name="const",
                         value=helper.make_tensor("cv", TensorProto.FLOAT16, [4], [1, 2, 3, 4])),
        helper.make_node("Shape", ["a"], ["shape"], name="shape"),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], name="ones",
                         value=helper.make_tensor("ov", TensorProto.FLOAT16, [1], [1.0])),
        helper.make_node("Mul", ["a", "c"], ["ac"], name="mul_c"),
        helper.make_node("Add", ["ac", "ones"], ["m"], name="add_ones"),
        helper.make_node("ReduceSum", ["m"], ["s"], name="sum", keepdims=0),
        helper.make_node("Cast", ["s"], ["flag"], name="flag", to=TensorProto.BOOL),
        helper.make_node("If", ["flag"], ["y"], name="branch",
                         then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Cast", ["y"], ["y32"], name="to_float", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4]),
         helper.make_tensor_value_info("y32", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float16), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_model_keeps_its_interface_and_its_results() -> None:
    model = _half_model()
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    result = WidenHalf()(widened)
    assert result.modified and result.detail.startswith("float16 computed in float32")
    onnx.checker.check_model(widened, full_check=True)
    interface = [(v.name, v.type.tensor_type.elem_type)
                 for v in (*widened.graph.input, *widened.graph.output)]
    assert interface == [(v.name, v.type.tensor_type.elem_type)
                         for v in (*model.graph.input, *model.graph.output)]
    # Nothing inside is half precision any more: only the edges' Casts mention float16.
    inside = onnx.ModelProto()
    inside.CopyFrom(widened)
    del inside.graph.input[:], inside.graph.output[:]
    edges = [n for n in inside.graph.node if n.name in ("x_to_float32", "y_to_float16")]
    for node in edges:
        inside.graph.node.remove(node)
    assert len(edges) == 2 and half_precision_types(inside.graph) == []
    rng = np.random.default_rng(4)
    for sign in (1, -1):  # both branches
        feeds = {"x": (sign * np.abs(rng.standard_normal((2, 3)))).astype(np.float16),
                 "ids": rng.integers(0, 3, (2, 4))}
        expected = _run(model, feeds)
        got = _run(widened, feeds)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32),
                                       rtol=2e-2, atol=2e-2)


def test_bfloat16_weights_widen_and_float32_models_are_left_alone() -> None:
    w = numpy_helper.from_array(np.array([[1.5, -2.0], [0.25, 4.0]], np.float32), "W")
    bf = helper.make_tensor("W", TensorProto.BFLOAT16, [2, 2], [1.5, -2.0, 0.25, 4.0])
    for weight, changed in ((bf, True), (w, False)):
        nodes = [helper.make_node("Cast", ["x"], ["xb"], name="c", to=weight.data_type),
                 helper.make_node("MatMul", ["xb", "W"], ["yb"], name="mm"),
                 helper.make_node("Cast", ["yb"], ["y"], name="back", to=TensorProto.FLOAT)]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        before = model.SerializeToString()
        result = WidenHalf()(model)
        assert result.modified is changed
        if not changed:
            assert model.SerializeToString() == before
            continue
        assert result.detail.startswith("bfloat16")
        assert model.graph.initializer[0].data_type == TensorProto.FLOAT
        (y,) = _run(model, {"x": np.array([[1.0, 2.0]], np.float32)})
        np.testing.assert_array_equal(y, [[2.0, 6.0]])  # 1.5 + 0.5, -2 + 8: exact in bfloat16


def _converted_block() -> onnx.ModelProto:
    """As onnxconverter-common writes a float32 model converted to float16 with its interface
    kept and an Add left in float32: the Conv's weight and bias are float16 initializers cast to
    float32 (a mixed model), the Add's inputs cast up from float16 and its output back down."""
    rng = np.random.default_rng(7)
    half = {"W": rng.standard_normal((4, 3, 3, 3)) / 4, "B": rng.standard_normal(4) / 4,
            "W2": rng.standard_normal((4, 4, 1, 1)) / 2}
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], name="in16", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["W"], ["W32"], name="w32", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["B"], ["B32"], name="b32", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x16"], ["x32"], name="x32", to=TensorProto.FLOAT),
        helper.make_node("Conv", ["x32", "W32", "B32"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["c"], ["c16"], name="c16", to=TensorProto.FLOAT16),
        helper.make_node("Conv", ["c16", "W2"], ["d16"], name="conv2"),
        helper.make_node("Cast", ["c16"], ["c_add"], name="c_up", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["d16"], ["d_add"], name="d_up", to=TensorProto.FLOAT),
        helper.make_node("Add", ["c_add", "d_add"], ["s"], name="add"),
        helper.make_node("Cast", ["s"], ["y"], name="out32", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "converted", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(v.astype(np.float16), k) for k, v in half.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_casts_between_float_types_go() -> None:
    # Widened, each is a float32 -> float32 Cast: one between a Conv's output and an Add keeps
    # onnxruntime from running the Add in integers, one on a bias leaves no constant to quantize.
    model = _converted_block()
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    result = WidenHalf()(widened)
    assert result.detail.endswith("; 7 Casts between them dropped"), result.detail
    onnx.checker.check_model(widened, full_check=True)
    # the one writing the graph output stays: its name is the interface's
    assert [n.name for n in widened.graph.node if n.op_type == "Cast"] == ["out32"]
    conv = next(n for n in widened.graph.node if n.name == "conv")
    assert list(conv.input) == ["x", "W", "B"]
    add = next(n for n in widened.graph.node if n.name == "add")
    assert list(add.input) == ["c", "d16"]
    x = np.random.default_rng(8).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (expected,), (got,) = _run(model, {"x": x}), _run(widened, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)  # float16 rounding gone
