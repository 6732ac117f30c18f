"""Small ONNX model builders and an onnxruntime runner for the model and pass tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def float_input(name: str, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(
        name, TensorProto.FLOAT, None if shape is None else list(shape)
    )


def build_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[str | onnx.ValueInfoProto],
    initializers: Mapping[str, np.ndarray] | None = None,
    *,
    opset: int = 13,
    ir_version: int = 8,
) -> onnx.ModelProto:
    """A checked model; outputs given by name are float tensors, shaped by shape inference."""
    output_infos = [
        o
        if isinstance(o, onnx.ValueInfoProto)
        else helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
        for o in outputs
    ]
    tensors = [numpy_helper.from_array(a, n) for n, a in (initializers or {}).items()]
    graph = helper.make_graph(list(nodes), "test", list(inputs), output_infos, tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version  # helper's default is newer than onnxruntime accepts
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for given, found in zip(model.graph.output, inferred.graph.output):
        given.type.CopyFrom(found.type)
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[Any]:
    """Outputs of `model` in onnxruntime (graph optimizations off: compare the graph as written)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return list(session.run(None, dict(feeds)))


def run_optimized(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[Any]:
    """Outputs of `model` as onnxruntime runs it by default (its fusions: integer kernels)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return list(session.run(None, dict(feeds)))


def read_rounded(model: onnx.ModelProto, tensor: str, scale: float, zero_point: np.ndarray,
                 ) -> onnx.ModelProto:
    """A copy of `model` whose readers of `tensor` read it through a QuantizeLinear ->
    DequantizeLinear pair of that scale and zero point (its producer's output left as it is,
    as the Q/DQ writer leaves it)."""
    rounded = onnx.ModelProto()
    rounded.CopyFrom(model)
    graph = rounded.graph
    graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{tensor}_s"),
                              numpy_helper.from_array(zero_point, f"{tensor}_z")])
    for node in graph.node:
        node.input[:] = [f"{tensor}_dq" if v == tensor else v for v in node.input]
    after = next(i for i, n in enumerate(graph.node) if tensor in n.output) + 1
    pair = [helper.make_node("QuantizeLinear", [tensor, f"{tensor}_s", f"{tensor}_z"],
                             [f"{tensor}_q"]),
            helper.make_node("DequantizeLinear", [f"{tensor}_q", f"{tensor}_s", f"{tensor}_z"],
                             [f"{tensor}_dq"])]
    for offset, node in enumerate(pair):
        graph.node.insert(after + offset, node)
    return rounded


def batchnorm_relu(
    rng: np.random.Generator, source: str, channels: int, *, variance: tuple[float, float]
) -> tuple[dict[str, np.ndarray], list[onnx.NodeProto]]:
    """`source` -> BatchNormalization (random statistics, variance drawn in `variance`) -> Relu
    -> y: the parameters (scale, shift, mean, variance, drawn in that order) and the two nodes."""
    inits = {
        "bn_scale": rng.uniform(0.5, 2.0, channels).astype(np.float32),
        "bn_shift": rng.standard_normal(channels).astype(np.float32),
        "bn_mean": rng.standard_normal(channels).astype(np.float32),
        "bn_var": rng.uniform(*variance, channels).astype(np.float32),
    }
    nodes = [
        helper.make_node("BatchNormalization", [source, *inits], ["bn_out"], name="bn",
                         epsilon=1e-3),
        helper.make_node("Relu", ["bn_out"], ["y"], name="relu"),
    ]
    return inits, nodes


def conv_bn_relu(rng: np.random.Generator, *, with_bias: bool = True) -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization -> Relu -> y, random weights and BN statistics."""
    inits = {"W": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    bn_inits, bn_nodes = batchnorm_relu(rng, "conv_out", 4, variance=(0.2, 3.0))
    inits.update(bn_inits)
    conv_inputs = ["x", "W"]
    if with_bias:
        inits["B"] = rng.standard_normal(4).astype(np.float32)
        conv_inputs.append("B")
    nodes = [
        helper.make_node("Conv", conv_inputs, ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
        *bn_nodes,
    ]
    return build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)


def residual_classifier(
    rng: np.random.Generator, *, in_channels: int, channels: int, classes: int, side: int,
    second_scale: float, softmax: bool = False,
) -> onnx.ModelProto:
    """Conv -> Relu -> Conv + residual Add -> global pool -> Gemm (-> Softmax), batch free;
    output "y". Weights drawn from `rng` in a fixed order."""
    logits = "logits" if softmax else "y"
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="residual"),
        helper.make_node("GlobalAveragePool", ["s"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "G", "gb"], [logits], name="fc", transB=1),
    ]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=1))
    inits = {
        "W1": (rng.standard_normal((channels, in_channels, 3, 3)) * 0.3).astype(np.float32),
        "B1": (rng.standard_normal(channels) * 0.1).astype(np.float32),
        "W2": (rng.standard_normal((channels, channels, 3, 3)) * second_scale).astype(np.float32),
        "G": (rng.standard_normal((classes, channels)) * 0.5).astype(np.float32),
        "gb": np.zeros(classes, np.float32),
    }
    return build_model(nodes, [float_input("x", ["N", in_channels, side, side])], ["y"], inits)


def optimized_ops(model: onnx.ModelProto, folder: Path) -> Counter[str]:
    """Op types of the graph onnxruntime's CPU provider runs `model` as (all its optimizations,
    its default level, as a user runs it), written to `folder`."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(folder / "optimized.onnx").graph.node)


def sqnr_db(reference: np.ndarray, got: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of `got` against `reference`, in dB."""
    wide = np.asarray(reference, np.float64)
    return float(10 * np.log10(np.sum(wide ** 2) / np.sum((np.asarray(got) - wide) ** 2)))
