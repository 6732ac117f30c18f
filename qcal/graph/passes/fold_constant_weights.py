"""Pass: store a weight computed from constants alone as the initializer it computes.

Two kinds of computation reach a Conv, ConvTranspose, MatMul or Gemm as its weight:

* views: a Transpose, Reshape, Squeeze, Unsqueeze, Flatten or Cast of constants. torch.onnx's
  dynamo exporter writes a tied language-model head as ``MatMul(h, Transpose(embedding))``;
* arithmetic: the same exporter keeps weight normalization (``g * v / ||v||``: ReduceL2, Div,
  Mul on the parameters) for every weight too large for its own constant folding, as in
  vocoders and wav2vec2's positional convolution; weight standardization and scaled weights are
  written the same way.

Planned as it stands, such a weight is an activation: observed over the calibration data,
quantized per tensor and quantized again by a QuantizeLinear on every run (a weight-normalized
vocoder ran 1.12x its float latency, against 0.75x for the same network exported with the
computation folded). Folded, it is a weight like any other (per channel, codes stored once).
onnxruntime folds such nodes itself when it loads the float model. Views are taken exactly;
arithmetic is computed by onnx's reference evaluator (numpy), which may differ from
onnxruntime's kernels in the last bit of a sum: far below any quantization step.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from qcal.graph.files.large import tensor_array
from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.passes._folding import evaluate_node, fold_into_initializers
from qcal.graph.structure import (
    COMPUTE_OPS,
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    default_opset,
)

__all__ = ["FoldConstantWeights"]

_VIEW_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast"})
# Deterministic arithmetic on float constants that exporters write to compute a weight; random
# operators, and those without inputs, never fold.
_ARITHMETIC_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Pow", "Exp", "Log",
    "Max", "Min", "Clip", "Sign", "Tanh", "Sigmoid", "Erf",
    "ReduceL1", "ReduceL2", "ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceMax",
    "ReduceMin", "LpNormalization", "Concat", "Slice", "Gather", "Expand", "Tile", "Where",
})
_FOLDED_OPS = _VIEW_OPS | _ARITHMETIC_OPS
# A computed weight holds at most as many values as its operands together, or this many.
_FEW_VALUES = 1 << 16


class FoldConstantWeights:
    """Replace each view of or arithmetic on constants in the main graph whose float result a
    Conv, ConvTranspose, MatMul or Gemm reads (through further such nodes) by an initializer
    of its output's name; chains fold in one run, and a constant nothing reads any more goes.
    What is read otherwise stays: a bias reshaped for an Add is planned as it stands."""

    name: ClassVar[str] = "fold-constant-weights"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:  # initializers must be inputs
            return StepResult(model, False)
        opset = default_opset(model) or 1
        wanted = _read_as_weights(model.graph)
        folded = {"views": 0, "arithmetic": 0}

        def value_of(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
                     ) -> np.ndarray | None:
            if node.output[0] not in wanted:
                return None
            if node.op_type in _VIEW_OPS:
                value = _view(node, constants, opset)
                folded["views"] += value is not None
                return value
            value = _arithmetic(node, constants, opset)
            folded["arithmetic"] += value is not None
            return value

        count = fold_into_initializers(model, value_of)
        if not count:
            return StepResult(model, False)
        views, arithmetic = folded["views"], folded["arithmetic"]
        parts = [f"{views} view{'s' * (views != 1)}"] if views else []
        if arithmetic:
            parts.append(f"{arithmetic} computation{'s' * (arithmetic != 1)}")
        return StepResult(model, True, f"stored {' and '.join(parts)} of constant weights "
                                       "as initializers")


def _read_as_weights(graph: onnx.GraphProto) -> set[str]:
    """Values a compute node reads as an operand, and the values the views and arithmetic that
    make them read (walked back from the readers, so chains count)."""
    wanted = {v for n in graph.node if n.op_type in COMPUTE_OPS and n.domain in DEFAULT_DOMAINS
              for v in n.input[:2] if v}
    for node in reversed(graph.node):  # readers come after what they read
        if (node.op_type in _FOLDED_OPS and node.domain in DEFAULT_DOMAINS and node.input
                and any(o in wanted for o in node.output)):
            wanted.update(v for v in node.input if v)
    return wanted


def _arithmetic(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
                opset: int) -> np.ndarray | None:
    """The float value arithmetic `node` computes from constants alone, or None."""
    if (node.op_type not in _ARITHMETIC_OPS or node.domain not in DEFAULT_DOMAINS
            or len(node.output) != 1 or not node.input
            or any(v and v not in constants for v in node.input)
            or not any(constants[v].data_type in FLOAT_TYPES for v in node.input if v)):
        return None
    value = evaluate_node(node, constants, opset)
    if value is None or value.dtype.kind != "f":
        return None
    # An Expand or Tile that only repeats a constant stays: onnxruntime folds it at load, and
    # stored, it would grow the model file.
    read = sum(_size(constants[v]) for v in node.input if v)
    return value if value.size <= max(read, _FEW_VALUES) else None


def _size(tensor: onnx.TensorProto) -> int:
    return math.prod(int(d) for d in tensor.dims)


def _view(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
          opset: int) -> np.ndarray | None:
    """The value `node` computes from constants alone, when it is a float view; else None."""
    if (node.op_type not in _VIEW_OPS or node.domain not in DEFAULT_DOMAINS
            or len(node.output) != 1 or not node.input or not node.input[0]
            or any(v and v not in constants for v in node.input)):
        return None
    first = constants[node.input[0]]
    attributes: dict[str, Any] = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    to = attributes.get("to")
    if (to if node.op_type == "Cast" else first.data_type) not in FLOAT_TYPES:
        return None
    x = tensor_array(first)
    extra = [tensor_array(constants[v]) if v else None for v in node.input[1:]]
    if node.op_type == "Transpose":
        perm = attributes.get("perm")
        return np.ascontiguousarray(np.transpose(x, perm))
    if node.op_type == "Cast":
        return x.astype(helper.tensor_dtype_to_np_dtype(int(attributes["to"])))
    if node.op_type == "Flatten":
        axis = int(attributes.get("axis", 1))
        axis = axis + x.ndim if axis < 0 else axis
        return x.reshape(math.prod(x.shape[:axis]), -1)
    if node.op_type == "Reshape":
        if not extra or extra[0] is None:
            return None
        shape = [int(d) for d in extra[0]]
        if not attributes.get("allowzero", 0):
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape)
    axes = attributes.get("axes") if opset < 13 else (
        [int(a) for a in extra[0]] if extra and extra[0] is not None else None)
    if node.op_type == "Unsqueeze":
        if axes is None:
            return None
        rank = x.ndim + len(axes)
        for axis in sorted(a + rank if a < 0 else a for a in axes):
            x = np.expand_dims(x, axis)
        return x
    # Squeeze: the given axes, or every axis of size 1.
    if axes is None:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(a + x.ndim if a < 0 else a for a in axes))
