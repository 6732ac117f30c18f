"""Where Q/DQ goes: parameters never, and under placement "auto" only where integer kernels pay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import TensorProto, helper

from qcal.graph.model import SelectionRules, plan_quantization, prepare_model
from qcal.graph.parameters import parameter_slots


@pytest.mark.parametrize(
    ("op", "inputs", "expected"),
    [
        ("Resize", ["x", "roi", "scales", "sizes"], {1, 2, 3}),
        ("Reshape", ["x", "shape"], {1}),
        ("Pad", ["x", "pads", "value"], {1}),
        ("Slice", ["x", "starts", "ends", "axes", "steps"], {1, 2, 3, 4}),
        ("TopK", ["x", "k"], {1}),
        ("Conv", ["x", "w", "b"], set()),
        ("Concat", ["a", "b", "c"], set()),
        # The first input is the operator's data whatever type it writes.
        ("Cast", ["x"], set()),
        ("ArgMax", ["x"], set()),
        ("Greater", ["x", "threshold"], {1}),
        ("Where", ["c", "x", "y"], set()),
    ],
)
def test_parameter_slots_come_from_the_schemas(op: str, inputs: list[str], expected: set[int]) -> None:
    node = helper.make_node(op, inputs, ["out"])
    assert parameter_slots(node, 17) == expected


def test_attention_values_are_values_its_mask_a_parameter() -> None:
    """Opset 23's Attention types V (and past values) with a constraint of their own, T2,
    allowing the same float types as its output's T1: V is what it averages, not a parameter
    (a torch export's V projection ran in float); its mask is one."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask", "past_k", "past_v"], ["out"])
    assert parameter_slots(node, 23) == {3}


def _plan(model: onnx.ModelProto, placement: str) -> tuple[onnx.ModelProto, dict[str, bool], set[str]]:
    prepared, _ = prepare_model(model)
    plan = plan_quantization(prepared, SelectionRules(placement=placement))
    decisions = {d.node: d.quantized for d in plan.nodes}
    return prepared, decisions, {a.tensor for a in plan.activations}


def _resize_with_computed_scales() -> onnx.ModelProto:
    """Position-embedding interpolation as exporters write it: the scales are computed in
    float from the input's shape (Cast, Div, Concat) on their way to a cubic Resize."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Slice", ["shape", "two", "four"], ["hw"], name="hw"),
        helper.make_node("Cast", ["hw"], ["hw_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Div", ["hw_f", "grid"], ["ratio"], name="ratio"),
        helper.make_node("Concat", ["ones", "ratio"], ["scales"], name="scales", axis=0),
        helper.make_node("Resize", ["pos", "", "scales"], ["pos_big"], name="resize",
                         mode="cubic"),
        helper.make_node("Add", ["x", "pos_big"], ["y"], name="add"),
    ]
    inits = {
        "two": np.array([2], np.int64), "four": np.array([4], np.int64),
        "grid": np.array([4.0, 4.0], np.float32), "ones": np.array([1.0, 1.0], np.float32),
        "pos": np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32),
    }
    return build_model(nodes, [float_input("x", [1, 3, 8, 8])], ["y"], inits)


def test_tensors_computed_only_for_parameters_are_never_quantized() -> None:
    model = _resize_with_computed_scales()
    _, decisions, activations = _plan(model, "all")
    assert not {"hw_f", "ratio", "scales"} & activations
    assert decisions["ratio"] is False and decisions["scales"] is False
    assert decisions["add"] is True  # the values themselves are still quantized


def test_placement_all_quantizes_a_cubic_resize_model_that_still_runs(tmp_path: object) -> None:
    from qcal.config import CalibrationConfig
    from qcal.pipeline import calibrate

    model = _resize_with_computed_scales()
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    from pathlib import Path

    folder = Path(str(tmp_path))
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "d.npz", x=np.stack([x] * 4))
    result = calibrate(folder / "m.onnx", CalibrationConfig(data=folder / "d.npz",
                                                             placement="all"))
    onnx.checker.check_model(result.model)
    (quantized,) = run(result.model, {"x": x})
    (expected,) = run(model, {"x": x})
    assert np.abs(quantized - expected).max() < 0.1 * np.abs(expected).max()


@pytest.mark.parametrize("tail", ["Cast", "ArgMax"])
def test_a_model_ending_in_another_type_is_still_quantized(tail: str) -> None:
    """Conv -> Relu -> Conv -> Relu, then a Cast (to float16, as a mixed-precision export
    writes) or an ArgMax (a segmentation head) as the only output: the convolutions are
    quantized, not "computed only for a parameter" of the last node."""
    rng = np.random.default_rng(5)
    last = (helper.make_node("Cast", ["r2"], ["y"], name="tail", to=TensorProto.FLOAT16)
            if tail == "Cast" else helper.make_node("ArgMax", ["r2"], ["y"], name="tail", axis=1))
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        last,
    ]
    inits = {"w1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32),
             "w2": rng.standard_normal((8, 8, 3, 3)).astype(np.float32)}
    output = helper.make_tensor_value_info(
        "y", TensorProto.FLOAT16 if tail == "Cast" else TensorProto.INT64, None)
    model = build_model(nodes, [float_input("x", [1, 8, 8, 8])], [output], inits)
    _, decisions, activations = _plan(model, "auto")
    assert decisions["conv1"] is True and decisions["conv2"] is True
    assert {"x", "r1"} <= activations


def _cnn_with_head() -> onnx.ModelProto:
    """Conv -> Relu -> AveragePool -> Conv, a residual Add of the two conv outputs, a Tanh gate
    (no integer kernel), Flatten and a Gemm head."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("AveragePool", ["r1"], ["p1"], name="pool", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["res"], name="residual"),
        helper.make_node("Tanh", ["res"], ["gate"], name="tanh"),
        helper.make_node("Mul", ["res", "gate"], ["silu"], name="silu"),
        helper.make_node("Flatten", ["silu"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], name="head", transB=1),
    ]
    inits = {
        "w1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32),
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 8, 3, 3)).astype(np.float32),
        "b2": rng.standard_normal(8).astype(np.float32),
        "wf": rng.standard_normal((5, 8 * 6 * 6)).astype(np.float32),
        "bf": rng.standard_normal(5).astype(np.float32),
    }
    return build_model(nodes, [float_input("x", [1, 8, 6, 6])], ["logits"], inits)


def test_auto_leaves_maxpool_float_and_quantizes_depthwise_convolutions() -> None:
    """onnxruntime's uint8 MaxPool is slower than the float one: between two anchors it stays
    float. A depthwise Conv is an anchor like any other."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["c1"], ["p1"], name="pool", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["p1", "wd"], ["d1"], name="depthwise", group=8,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d1", "w2"], ["c2"], name="pointwise"),
    ]
    inits = {"w1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32),
             "wd": rng.standard_normal((8, 1, 3, 3)).astype(np.float32),
             "w2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", [1, 8, 6, 6])], ["c2"], inits)
    _, decisions, _ = _plan(model, "auto")
    assert decisions == {"conv1": True, "pool": False, "depthwise": True, "pointwise": True}
    _, everything, _ = _plan(model, "all")
    assert all(everything.values())


def test_auto_places_qdq_on_anchors_and_what_lies_between_them() -> None:
    _, decisions, activations = _plan(_cnn_with_head(), "auto")
    assert decisions == {
        "conv1": True, "relu1": True, "pool": True, "conv2": True,  # anchors and between
        "residual": False, "tanh": False, "silu": False,  # lead to no anchor through cheap ops
        "flatten": False, "head": True,
    }
    assert "logits" not in activations  # Gemm's integer kernel has a float output
    assert "silu" not in activations and "flat" in activations  # the head's input
    assert "c2" in activations  # Conv writes integers (QLinearConv)
    _, everything, all_activations = _plan(_cnn_with_head(), "all")
    assert all(v for k, v in everything.items() if k != "tanh") and "logits" in all_activations


def test_a_gate_with_an_integer_kernel_between_anchors_is_quantized() -> None:
    """SiLU as x * sigmoid(x) between a Conv and the head runs on integers (Sigmoid and Mul
    have integer kernels, and a sigmoid shrinks an input error)."""
    model = _cnn_with_head()
    for node in model.graph.node:
        if node.op_type == "Tanh":
            node.op_type, node.name = "Sigmoid", "sigmoid"
    _, decisions, activations = _plan(model, "auto")
    assert decisions["sigmoid"] and decisions["silu"] and decisions["residual"]
    assert {"res", "gate", "silu", "flat"} <= activations


def test_products_of_two_activations_stay_float_under_auto() -> None:
    """Attention's scores and context multiply two activations: onnxruntime would quantize both
    at every run and multiply uint8 by uint8, slower than its float kernel. Under "auto" they
    stay float, and so do the tensors only they read; "all" quantizes them as before."""
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt", perm=[1, 0]),
        helper.make_node("MatMul", ["q", "xt"], ["scores"], name="qk"),
        helper.make_node("Softmax", ["scores"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "x"], ["y"], name="pv"),
    ]
    inits = {"wq": np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", [3, 4])], ["y"], inits)
    prepared, _ = prepare_model(model)
    plan = plan_quantization(prepared, SelectionRules(placement="auto"))
    decisions = {d.node: d for d in plan.nodes}
    assert decisions["q_proj"].quantized
    for product in ("qk", "pv"):
        assert not decisions[product].quantized
        assert "two activations" in decisions[product].reason
    assert not decisions["softmax"].quantized and not decisions["xt"].quantized
    assert {a.tensor for a in plan.activations} == {"x"}  # the projection's input alone
    _, everything, activations = _plan(model, "all")
    assert everything["qk"] and everything["pv"] and {"q", "xt", "p", "x"} <= activations


def test_what_computes_from_constants_alone_stays_float_and_out_of_the_macs() -> None:
    """A projection of a constant table (DeBERTa's relative positions, Swin-v2's position-bias
    MLP), which onnxruntime computes once when it loads the float model: with Q/DQ it ran at
    every run (1.21x float), and its MACs counted as quantized work."""
    from qcal.accuracy.macs import compute_macs

    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("MatMul", ["table", "wp"], ["pos"], name="pos_proj"),
        helper.make_node("Relu", ["pos"], ["pos_r"], name="pos_relu"),
        helper.make_node("Transpose", ["pos_r"], ["pos_t"], name="pos_t", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["q", "pos_t"], ["y"], name="scores"),
    ]
    inits = {name: rng.standard_normal(shape).astype(np.float32)
             for name, shape in (("table", (5, 4)), ("wp", (4, 4)), ("wq", (4, 4)))}
    prepared, _ = prepare_model(build_model(nodes, [float_input("x", [3, 4])], ["y"], inits))
    decisions = {d.node: d for d in plan_quantization(prepared, SelectionRules()).nodes}
    assert decisions["q_proj"].quantized
    for name in ("pos_proj", "pos_relu", "pos_t"):
        assert not decisions[name].quantized
        assert "constants alone" in decisions[name].reason, decisions[name].reason
    assert set(compute_macs(prepared, None)) == {"q_proj", "scores"}


def test_a_node_onnxruntime_cannot_run_quantized_is_kept_float(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the parameter analysis, Q/DQ would reach the cubic Resize's scales and
    onnxruntime refuses to run the model: qcal keeps the node it names float and says why."""
    from pathlib import Path

    import qcal.graph.plan._planner as planner
    from qcal.config import CalibrationConfig
    from qcal.pipeline import calibrate

    monkeypatch.setattr(planner, "parameter_tensors", lambda *args: {})
    model = _resize_with_computed_scales()
    folder = Path(str(tmp_path))
    onnx.save(model, folder / "m.onnx")
    x = np.random.default_rng(4).standard_normal((4, 1, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "d.npz", x=x[:, 0])
    result = calibrate(folder / "m.onnx", CalibrationConfig(data=folder / "d.npz",
                                                             placement="all"))
    reasons = {n["name"]: n["reason"] for n in result.report["nodes"]}
    assert "onnxruntime cannot run it quantized" in reasons["resize"]
    assert "Cubic" in reasons["resize"]
    (quantized,) = run(result.model, {"x": x[0]})
    (expected,) = run(model, {"x": x[0]})
    assert np.abs(quantized - expected).max() < 0.1 * np.abs(expected).max()
    assert any(n.op_type == "QuantizeLinear" for n in result.model.graph.node)


def _scan_model(weight_as_state: bool) -> onnx.ModelProto:
    """A Scan over the rows of x: h = Relu(row @ W) per step, W either an initializer the body
    reads from outside or passed in as a state (as tf2onnx writes a tf.scan's weights)."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    body_inputs = [helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, 4])]
    body_outputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 4])]
    weight = "W"
    if weight_as_state:
        body_inputs.insert(0, helper.make_tensor_value_info("W_in", TensorProto.FLOAT, [4, 4]))
        body_outputs.insert(0, helper.make_tensor_value_info("W_out", TensorProto.FLOAT, [4, 4]))
        weight = "W_in"
    body_nodes = [
        helper.make_node("MatMul", ["row", weight], ["m"], name="body_matmul"),
        helper.make_node("Relu", ["m"], ["h"], name="body_relu"),
    ]
    if weight_as_state:
        body_nodes.append(helper.make_node("Identity", ["W_in"], ["W_out"], name="keep_w"))
    body = helper.make_graph(body_nodes, "body", body_inputs, body_outputs)
    scan_inputs = ["W", "x"] if weight_as_state else ["x"]
    scan_outputs = ["W_final", "hs"] if weight_as_state else ["hs"]
    scan = helper.make_node("Scan", scan_inputs, scan_outputs, name="scan", body=body,
                            num_scan_inputs=1)
    return build_model([scan], [float_input("x", [6, 1, 4])], ["hs"], {"W": w}, opset=17)


@pytest.mark.parametrize("weight_as_state", [False, True])
def test_a_loop_body_quantizes_only_anchors_with_a_constant_weight(weight_as_state: bool) -> None:
    _, decisions, activations = _plan(_scan_model(weight_as_state), "auto")
    assert decisions["body_matmul"] is (not weight_as_state)
    assert ("W_in" in activations) is False


@pytest.mark.parametrize(("per_group_in", "per_group_out", "then", "quantized"), [
    (1, 1, "Resize", True),  # depthwise: onnxruntime has an integer kernel of its own for it
    (1, 2, "Resize", False),  # a depth multiplier of 2 (Keras DepthwiseConv2D): 6-11x float
    (4, 4, "Resize", False),  # ResNeXt's narrowest groups: 2-3x
    (8, 8, "Resize", True),  # about as fast as float: its neighbours' integers pay
    # Straight (through a Relu or a MaxPool) into a quantized Conv: onnxruntime would quantize
    # its weight itself (per tensor) and run the same slow kernel, so qcal quantizes it (per
    # channel) instead.
    (1, 2, "Relu", True),
    (1, 2, "MaxPool", True),
])
def test_auto_keeps_float_a_grouped_convolution_whose_groups_are_narrow(
    per_group_in: int, per_group_out: int, then: str, quantized: bool
) -> None:
    """onnxruntime's QLinearConv computes a grouped (not depthwise) Conv as one matrix product
    per group; with a few channels per group those cost more than its float kernel, so under
    "auto" such a Conv stays float (and says why) while the Convs around it are quantized."""
    rng = np.random.default_rng(4)
    groups = 8  # so the pointwise Conv reads 8 channels or more (a narrower one stays float)
    channels, out = groups * per_group_in, groups * per_group_out
    after = {
        "MaxPool": helper.make_node("MaxPool", ["g1"], ["m1"], name="pool", kernel_shape=[2, 2]),
        "Relu": helper.make_node("Relu", ["g1"], ["m1"], name="relu2"),
        "Resize": helper.make_node("Resize", ["g1", "", "scales"], ["m1"], name="upsample",
                                   mode="linear"),
    }[then]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wg"], ["g1"], name="grouped", group=groups,
                         pads=[1, 1, 1, 1]),
        after,
        helper.make_node("Conv", ["m1", "w2"], ["y"], name="pointwise"),
    ]
    inits = {"w1": rng.standard_normal((channels, 8, 3, 3)).astype(np.float32),
             "wg": rng.standard_normal((out, per_group_in, 3, 3)).astype(np.float32),
             "w2": rng.standard_normal((4, out, 1, 1)).astype(np.float32),
             "scales": np.array([1, 1, 2, 2], dtype=np.float32)}
    model = build_model(nodes, [float_input("x", [1, 8, 8, 8])], ["y"], inits)
    prepared, _ = prepare_model(model)
    plan = plan_quantization(prepared, SelectionRules(placement="auto"))
    decisions = {d.node: d for d in plan.nodes}
    assert decisions["conv1"].quantized and decisions["pointwise"].quantized
    assert decisions["grouped"].quantized is quantized
    if not quantized:
        assert decisions["grouped"].reason.startswith(
            f"placement auto: a grouped convolution with {per_group_in} input and "
            f"{per_group_out} output channels per group")
    _, everything, _ = _plan(model, "all")  # emulation quantizes it all the same
    assert everything["grouped"]
