"""The written QDQ layout is one onnxruntime's CPU provider turns into integer kernels: constants
of Add/Mul in the activation type, Relu/Clip after Add/Mul left to the QuantizeLinear, data
movement on shared parameters, and integer kernels whose readers are float."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from _onnx_testing import build_model, float_input
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.model import SelectionRules, plan_quantization, prepare_model
from qcal.pipeline import calibrate


def _optimized_ops(model: onnx.ModelProto, folder: Path) -> Counter[str]:
    """Op types of onnxruntime's optimized CPU graph (ORT_ENABLE_ALL), as a benchmark counts."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(folder / "optimized.onnx").graph.node)


def _calibrate(model: onnx.ModelProto, tmp_path: Path, x: np.ndarray) -> onnx.ModelProto:
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=x)
    config = CalibrationConfig(data=tmp_path / "calib.npz")
    return calibrate(tmp_path / "m.onnx", config).model


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _hard_swish_block(rng: np.random.Generator) -> onnx.ModelProto:
    """conv -> hard-swish written out (Add 3, Clip 0..6, Mul, Div 6) -> scalar affine ->
    max pool -> SE-style conv -> HardSigmoid -> Mul -> conv: PP-LCNet's building blocks."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "three"], ["a1"], name="add3"),
        helper.make_node("Clip", ["a1", "zero", "six"], ["r6"], name="relu6"),
        helper.make_node("Mul", ["c1", "r6"], ["m1"], name="mul"),
        helper.make_node("Div", ["m1", "six"], ["hs"], name="div6"),
        helper.make_node("Mul", ["hs", "scale"], ["scaled"], name="lab_scale"),
        helper.make_node("Add", ["scaled", "bias"], ["shifted"], name="lab_bias"),
        helper.make_node(
            "MaxPool", ["shifted"], ["pooled"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["pooled", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("HardSigmoid", ["c2"], ["gate"], name="gate"),
        helper.make_node("Mul", ["pooled", "gate"], ["gated"], name="se_mul"),
        helper.make_node("Conv", ["gated", "w3", "b3"], ["y"], name="conv3"),
    ]
    inits = {
        "w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(8).astype(np.float32),
        "w3": rng.standard_normal((4, 8, 1, 1)).astype(np.float32) * 0.3,
        "b3": rng.standard_normal(4).astype(np.float32),
        "three": np.array(3.0, np.float32),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
        "scale": np.array([1.3], np.float32),
        "bias": np.array([-0.2], np.float32),
    }
    return build_model(nodes, [float_input("x", ["N", 3, 16, 16])], ["y"], inits)


def test_every_compute_node_runs_in_integers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    model = _hard_swish_block(rng)
    x = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    ops = _optimized_ops(quantized, tmp_path)
    # Only the Div and HardSigmoid (no integer kernels) stay float, one pair around each, and
    # the last Conv, which writes the model's output in float from integer inputs.
    assert ops["QLinearConv"] == 2 and ops["QLinearAdd"] == 2 and ops["QLinearMul"] == 3
    assert not {"FusedConv", "Add", "Mul", "Clip", "Relu"} & set(ops), ops
    assert ops["Div"] == 1 and ops["HardSigmoid"] == 1 and ops["Conv"] == 1
    # Q: input, Div, HardSigmoid; DQ: Div, HardSigmoid, and the last Conv's three inputs.
    assert ops["QuantizeLinear"] == 3 and ops["DequantizeLinear"] == 5, ops
    # The max pool runs on the integers: equal parameters on both sides, no pair around it.
    assert ops["MaxPool"] + ops["NhwcMaxPool"] == 1
    reference = _outputs(model, x[:4])
    error = np.abs(_outputs(quantized, x[:4]) - reference).max()
    assert error < 0.05 * np.abs(reference).max()


def test_plan_shares_parameters_across_data_movement() -> None:
    rng = np.random.default_rng(1)
    prepared, _ = prepare_model(_hard_swish_block(rng))
    plan = plan_quantization(prepared, SelectionRules())
    targets = {t.tensor: t for t in plan.activations}
    assert targets["pooled"].same_as == "shifted"
    assert all(t.same_as is None for name, t in targets.items() if name != "pooled")
    # Clip after Add is left to the QuantizeLinear: the tensor between them is not quantized.
    assert "a1" not in targets and "r6" in targets
    roles = {w.tensor: w.role for w in plan.weights}
    assert roles["w1"] == "weight" and roles["three"] == "operand" and roles["scale"] == "operand"


def test_shared_outputs_take_the_source_parameters(tmp_path: Path) -> None:
    """Reshape -> Transpose -> MaxPool chain: one observer, identical parameters on all."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("MaxPool", ["t"], ["p"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("Conv", ["p", "w2"], ["y"], name="conv2"),
    ]
    inits = {
        "w": rng.standard_normal((4, 3, 1, 1)).astype(np.float32),
        "shape": np.array([0, 4, 8, 8], np.int64),
        "w2": rng.standard_normal((2, 4, 1, 1)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(data=tmp_path / "calib.npz"))
    records = {t["name"]: t for t in result.report["tensors"] if t["role"] == "activation"}
    for name in ("r", "t", "p"):
        assert records[name]["onnx"] == records["c"]["onnx"]
        assert records[name]["range"]["same_as"] == "c"
    ops = _optimized_ops(result.model, tmp_path)
    # Reshape, Transpose and MaxPool run on the integers, between two integer convolutions
    # (the second writes the model's float output from integer inputs).
    assert ops["QLinearConv"] == 1 and ops["QuantizeLinear"] == 1, ops
    assert {"Reshape", "Transpose"} <= set(ops) and ops["DequantizeLinear"] == 2, ops


def test_graph_outputs_stay_float(tmp_path: Path) -> None:
    """An Add whose output is a graph output keeps it float (no QuantizeLinear on it)."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "x"], ["y"], name="add"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 6])], ["y"], {"k": np.array([0.5], np.float32)}
    )
    quantized = _calibrate(model, tmp_path, rng.standard_normal((8, 6)).astype(np.float32))
    producers = {o: n for n in quantized.graph.node for o in n.output}
    assert producers["y"].op_type == "Add"
    assert all(n.input[0] != "y" for n in quantized.graph.node if n.op_type == "QuantizeLinear")
