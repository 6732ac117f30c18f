"""Pass: store a weight that reaches its reader through a Transpose, Reshape, Squeeze,
Unsqueeze, Flatten or Cast of constants as the initializer it computes.

torch.onnx's dynamo exporter writes a tied language-model head as ``MatMul(h,
Transpose(embedding))``: planned as it stands, the transposed weight is an activation, observed
over the calibration data, quantized per tensor and quantized again by a QuantizeLinear on every
run. Folded, it is a weight like any other (per channel, codes stored once). onnxruntime folds
such nodes itself when it loads the float model, so the float model computes the same values.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from qcal.graph.files.large import tensor_array
from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.passes._folding import fold_into_initializers
from qcal.graph.structure import (
    COMPUTE_OPS,
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    default_opset,
)

__all__ = ["FoldConstantWeights"]

_VIEW_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast"})


class FoldConstantWeights:
    """Replace each view of constants in the main graph whose float result a Conv,
    ConvTranspose, MatMul or Gemm reads (through further views) by an initializer of its
    output's name; chains fold in one run, and a constant nothing reads any more goes. Views
    read otherwise stay: a bias reshaped for an Add is planned as it stands."""

    name: ClassVar[str] = "fold-constant-weights"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:  # initializers must be inputs
            return StepResult(model, False)
        opset = default_opset(model) or 1
        wanted = _read_as_weights(model.graph)

        def value_of(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
                     ) -> np.ndarray | None:
            return _fold(node, constants, opset) if node.output[0] in wanted else None

        count = fold_into_initializers(model, value_of)
        if not count:
            return StepResult(model, False)
        return StepResult(model, True, f"stored {count} view{'s' * (count != 1)} of constant "
                                       "weights as initializers")


def _read_as_weights(graph: onnx.GraphProto) -> set[str]:
    """Values a compute node reads as an operand, and the values views of them are made from
    (walked back from the readers, so chains of views count)."""
    wanted = {v for n in graph.node if n.op_type in COMPUTE_OPS and n.domain in DEFAULT_DOMAINS
              for v in n.input[:2] if v}
    for node in reversed(graph.node):  # readers come after their views
        if (node.op_type in _VIEW_OPS and node.domain in DEFAULT_DOMAINS and node.input
                and any(o in wanted for o in node.output)):
            wanted.add(node.input[0])
    return wanted


def _fold(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
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
