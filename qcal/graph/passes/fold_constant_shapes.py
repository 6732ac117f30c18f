"""Pass: integer values computed from constants alone (shape arithmetic) become initializers.

tf2onnx writes a Keras `EinsumDense` kernel as ``Reshape(kernel, Concat(c,
ReduceProd(Gather(Shape(kernel), axes))))``: the new shape is computed at run time from the
kernel's own shape, so the reshaped kernel reaches its Gemm as a computed value, and qcal planned
that Gemm as a product of two activations (kept float under placement auto, quantized per tensor
at every run under "all"). onnxruntime folds such chains when it loads the model. Folded here,
`fold-constant-weights` then stores the reshaped kernel as the weight it is. Only integer results of
shape operators are folded: their arithmetic is exact, so the model computes what it did.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import helper

from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.passes._folding import evaluate_node, fold_into_initializers, tensor_size
from qcal.graph.structure import DEFAULT_DOMAINS, default_opset

__all__ = ["FoldConstantShapes"]

# Operators of shape arithmetic. Shape and Size read only their input's dimensions.
_SHAPE_OPS = frozenset({
    "Shape", "Size", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Cast",
    "ReduceProd", "ReduceSum", "ReduceMin", "ReduceMax", "Add", "Sub", "Mul", "Div", "Neg",
    "Abs", "Range", "Max", "Min", "Equal", "Where", "Expand", "Tile", "ConstantOfShape",
})
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})
# Shape arithmetic works on a handful of values: larger operands are left to onnxruntime.
_MOST_VALUES = 4096


class FoldConstantShapes:
    """Replace each node of the main graph that computes an integer value from constants
    alone with shape operators by an initializer of its output's name, in graph order (so
    chains fold in one run); a constant nothing reads any more goes."""

    name: ClassVar[str] = "fold-constant-shapes"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:  # initializers must be inputs
            return StepResult(model, False)
        opset = default_opset(model) or 1

        def value_of(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
                     ) -> np.ndarray | None:
            if (node.op_type not in _SHAPE_OPS or node.domain not in DEFAULT_DOMAINS
                    or len(node.output) != 1):
                return None
            return _evaluate(node, constants, opset)

        count = fold_into_initializers(model, value_of)
        if not count:
            return StepResult(model, False)
        return StepResult(model, True, f"folded {count} shape computation{'s' * (count != 1)} "
                                       "on constants into initializers")


def _evaluate(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
              opset: int) -> np.ndarray | None:
    """The integer value `node` computes from the constants it reads, or None."""
    if node.op_type in ("Shape", "Size"):  # the dimensions alone: no data read
        dims = [int(d) for d in constants[node.input[0]].dims]
        if node.op_type == "Size":
            return np.array(int(np.prod(dims, dtype=np.int64)), np.int64)
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = attributes.get("start", 0), attributes.get("end")
        return np.array(dims[start:end], np.int64)
    operands = [constants[v] for v in node.input if v]
    if any(t.data_type not in _INTEGER_TYPES and t.data_type != onnx.TensorProto.BOOL
           for t in operands) or any(tensor_size(t) > _MOST_VALUES for t in operands):
        return None
    value = evaluate_node(node, constants, opset)
    if value is None:
        return None
    if value.dtype not in (np.int64, np.int32) or value.size > _MOST_VALUES:
        return None
    return value

