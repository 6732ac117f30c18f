"""The written model states the shapes the user's model states, and a node that reads only a
shape reads the quantized codes: onnxruntime then optimizes the float parts of the quantized
model as it does the float model's (no fusion the float model does not get, no tensor
dequantized only to take its shape)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _onnx_testing import build_model, float_input, optimized_ops, run
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.structure import keep_declared_shapes
from qcal.pipeline import calibrate

HIDDEN = 32


def _residual_layer_norm(declared: bool) -> onnx.ModelProto:
    """x [batch, 16, 32] -> MatMul -> flattened and reshaped back by computed shapes (as
    exported attention does) -> Add x -> LayerNormalization -> MatMul. onnxruntime alone cannot
    tell the residual's shape (the Reshape's shape is computed); shape inference with data
    propagation can. With `declared`, the model states the flattened value's shape itself."""
    rng = np.random.default_rng(0)
    inits = {
        "w": (rng.standard_normal((HIDDEN, HIDDEN)) * 0.2).astype(np.float32),
        "gamma": np.ones(HIDDEN, np.float32),
        "beta": np.zeros(HIDDEN, np.float32),
        "first": np.array([0], np.int64),
        "rest": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="project"),
        helper.make_node("Shape", ["h"], ["h_shape"], name="h_shape"),
        helper.make_node("Gather", ["h_shape", "first"], ["batch"], name="batch", axis=0),
        helper.make_node("Concat", ["batch", "rest"], ["flat_shape"], name="flat_shape", axis=0),
        helper.make_node("Reshape", ["h", "flat_shape"], ["flat"], name="flatten"),
        helper.make_node("Shape", ["x"], ["x_shape"], name="x_shape"),
        helper.make_node("Reshape", ["flat", "x_shape"], ["back"], name="unflatten"),
        helper.make_node("Add", ["back", "x"], ["residual"], name="residual"),
        helper.make_node("LayerNormalization", ["residual", "gamma", "beta"], ["normed"],
                         name="norm", axis=-1),
        helper.make_node("MatMul", ["normed", "w"], ["y"], name="head"),
    ]
    model = build_model(nodes, [float_input("x", ["batch", 16, HIDDEN])], ["y"], inits,
                        opset=17)
    if declared:
        model.graph.value_info.append(
            helper.make_tensor_value_info("flat", onnx.TensorProto.FLOAT, ["batch", 512]))
    return model


def _calibrate(model: onnx.ModelProto, tmp_path: Path, x: np.ndarray) -> onnx.ModelProto:
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=x)
    # The layout is checked here, not the verdict on these random weights.
    config = CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz")
    return calibrate(tmp_path / "m.onnx", config, enforce_gates=False).model


def test_the_quantized_model_gets_the_float_models_fusions(tmp_path: Path) -> None:
    # With the shapes shape inference finds, onnxruntime fuses the residual Add and the
    # LayerNormalization into SkipLayerNormalization (several times slower on its CPU
    # provider); the float model as exported never gets that fusion.
    model = _residual_layer_norm(declared=False)
    x = np.random.default_rng(1).standard_normal((16, 16, HIDDEN)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)
    float_ops = optimized_ops(model, tmp_path)
    quantized_ops = optimized_ops(quantized, tmp_path)
    assert float_ops["SkipLayerNormalization"] == 0
    assert quantized_ops["SkipLayerNormalization"] == 0
    assert quantized_ops["LayerNormalization"] == float_ops["LayerNormalization"] == 1
    # It still computes what the float model does.
    feed = {"x": x[:4]}
    reference, got = run(model, feed)[0], run(quantized, feed)[0]
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()


def test_the_shapes_the_model_states_are_kept_and_no_others(tmp_path: Path) -> None:
    model = _residual_layer_norm(declared=True)
    x = np.random.default_rng(2).standard_normal((8, 16, HIDDEN)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    stated = {v.name for v in quantized.graph.value_info}
    producer = {o: n for n in quantized.graph.node for o in n.output}
    shape_read = {n.input[0] for n in quantized.graph.node if n.op_type == "Shape"}
    shape_read |= {producer[v].input[0] for v in shape_read
                   if v in producer and producer[v].op_type == "QuantizeLinear"}
    assert "flat" in stated  # declared by the model
    assert stated <= {"flat"} | shape_read
    assert "residual" not in stated  # inferred by qcal, never stated by the model


def _conv_flattened_by_its_shape() -> onnx.ModelProto:
    """x [1, 8, 8, 8] -> Conv -> Relu -> Reshape to (batch, -1) by the Conv output's own Shape
    -> MatMul: the Conv's integer output is read by a Shape node."""
    rng = np.random.default_rng(3)
    inits = {
        "conv_w": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
        "conv_b": rng.standard_normal(8).astype(np.float32) * 0.1,
        "fc_w": (rng.standard_normal((8 * 8 * 8, 10)) * 0.05).astype(np.float32),
        "first": np.array([0], np.int64),
        "rest": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], name="conv", pads=[1] * 4),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Shape", ["r"], ["r_shape"], name="r_shape"),
        helper.make_node("Gather", ["r_shape", "first"], ["batch"], name="batch", axis=0),
        helper.make_node("Concat", ["batch", "rest"], ["flat_shape"], name="flat_shape", axis=0),
        helper.make_node("Reshape", ["r", "flat_shape"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc_w"], ["y"], name="fc"),
    ]
    return build_model(nodes, [float_input("x", ["batch", 8, 8, 8])],
                       [float_input("y", ["batch", 10])], inits)


def test_a_shape_reader_reads_the_codes_not_a_dequantized_copy(tmp_path: Path) -> None:
    model = _conv_flattened_by_its_shape()
    x = np.random.default_rng(4).standard_normal((16, 8, 8, 8)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    producer = {o: n for n in quantized.graph.node for o in n.output}
    shape = next(n for n in quantized.graph.node if n.op_type == "Shape")
    quantize = producer[shape.input[0]]
    assert quantize.op_type == "QuantizeLinear"
    # The float tensor behind those codes keeps its shape, which onnxruntime reads for them.
    assert quantize.input[0] in {v.name for v in quantized.graph.value_info}
    # One DequantizeLinear of those codes, for the Reshape: none for the Shape.
    readers = [n for n in quantized.graph.node if shape.input[0] in n.input]
    assert sorted(n.op_type for n in readers) == ["DequantizeLinear", "Shape"]
    feed = {"x": x[:3]}
    reference, got = run(model, feed)[0], run(quantized, feed)[0]
    assert got.shape == reference.shape
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()


def test_keep_declared_shapes_reaches_into_subgraphs() -> None:
    def info(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2])

    then_graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["then_out"])],
        "then", [], [info("then_out")], value_info=[info("t")],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Shape", ["a"], ["s"]),
         helper.make_node("Neg", ["a"], ["b"]), helper.make_node("Exp", ["b"], ["else_out"])],
        "else", [], [info("else_out")], value_info=[info("a"), info("b")],
    )
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
         helper.make_node("Greater", ["m", "zero"], ["c"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)],
        "main", [float_input("x", [2])], [info("y")],
        [onnx.numpy_helper.from_array(np.float32(0), "zero")],
        value_info=[helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, []),
                    helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
    )
    keep_declared_shapes(graph, {"c"})
    assert [v.name for v in graph.value_info] == ["c"]
    branches = {a.name: a.g for a in graph.node[2].attribute}  # the If's own copies
    assert [v.name for v in branches["then_branch"].value_info] == []
    assert [v.name for v in branches["else_branch"].value_info] == ["a"]  # a Shape reads it
