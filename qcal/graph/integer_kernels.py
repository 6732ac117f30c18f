"""What onnxruntime's CPU provider runs on integers in a QDQ graph, and what it does with a
QuantizeLinear on its own: the operators placement builds on (`qcal.graph.placement`) and the
checks of a written model read back (`qcal.accuracy.runnable`)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx

from qcal.graph.structure import DEFAULT_DOMAINS, FLOAT_TYPES, UseIndex, all_graphs

__all__ = ["ANCHOR_OPS", "FUSED_ACTIVATIONS", "INTEGER_OUTPUT_ANCHORS", "QUANTIZE_SEES_THROUGH",
           "added_bias_of", "integer_output_writers", "through_gemm_bias"]

ANCHOR_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
# Anchors whose integer kernel writes integers: their output is quantized whoever reads it.
INTEGER_OUTPUT_ANCHORS = frozenset({"Conv", "ConvTranspose"})
# Activations onnxruntime folds into the QuantizeLinear after an integer kernel.
FUSED_ACTIVATIONS = frozenset({"Relu", "Clip"})

# What onnxruntime looks through from a float Conv to the QuantizeLinear whose pattern makes it
# quantize the Conv's weight: a fused Relu/Clip, and the operators it moves a QuantizeLinear
# up through (its QDQ propagation).
QUANTIZE_SEES_THROUGH = FUSED_ACTIVATIONS | {
    "MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"}


def added_bias_of(
    node: onnx.NodeProto, index: UseIndex, constant: Callable[[str], onnx.TensorProto | None]
) -> str | None:
    """The MatMul whose output this Add only adds a constant row to (a bias the exporter wrote
    apart), or None. The MatMul then takes the row as an int32 bias (`qcal.graph.plan`), as a
    Gemm does, and the Add stays float: quantized itself, it would cost an integer Add and a
    requantization of the product, and hold the bias in 8 bits."""
    if node.op_type != "Add" or node.domain not in DEFAULT_DOMAINS or len(node.input) != 2:
        return None
    for product, bias in (node.input, reversed(node.input)):
        matmul = index.producer.get(product)
        if matmul is None or matmul.op_type != "MatMul" or matmul.domain not in DEFAULT_DOMAINS:
            continue
        if (len(matmul.input) < 2 or product in index.graph_outputs
                or len(index.uses.get(product, ())) != 1):
            return None
        weight, row = constant(matmul.input[1]), constant(bias)
        if (weight is None or len(weight.dims) != 2 or row is None or not row.dims
                or row.data_type not in FLOAT_TYPES or row.dims[-1] != weight.dims[1]
                or any(d != 1 for d in row.dims[:-1]) or len(index.readers(bias)) != 1):
            return None
        return matmul.name
    return None


def through_gemm_bias(value: str, index: UseIndex, gemm_biases: Collection[str]) -> list[str]:
    """`value`, and the output of its only reader where that is one of `gemm_biases` (an Add
    of a MatMul's bias row that onnxruntime fuses with it into a Gemm): the values a product
    runs through to what reads it as that Gemm's output."""
    readers = index.readers(value)
    if len(readers) == 1 and readers[0].name in gemm_biases and readers[0].output:
        return [value, readers[0].output[0]]
    return [value]


def integer_output_writers(graph: onnx.GraphProto) -> dict[str, str]:
    """Tensor -> the Conv/ConvTranspose whose integer kernel writes it, in `graph` and its
    bodies: the anchor's output, or that of the Relu/Clip that is its only reader (fused).
    onnxruntime has an integer kernel for these only with a QuantizeLinear on that tensor."""
    writers: dict[str, str] = {}
    for scope in all_graphs(graph):
        index = UseIndex.build(scope)
        for node in scope.node:
            if (node.op_type not in INTEGER_OUTPUT_ANCHORS or node.domain not in DEFAULT_DOMAINS
                    or not node.output or not node.output[0]):
                continue
            output = node.output[0]
            writers[output] = node.name
            readers = index.readers(output)
            if (len(readers) == 1 and readers[0].op_type in FUSED_ACTIVATIONS
                    and readers[0].domain in DEFAULT_DOMAINS and readers[0].output
                    and output not in index.graph_outputs):
                writers[readers[0].output[0]] = node.name
    return writers
