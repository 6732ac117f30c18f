"""Pass: integer values computed from constants alone (shape arithmetic) become initializers.

tf2onnx writes a Keras `EinsumDense` kernel as ``Reshape(kernel, Concat(c,
ReduceProd(Gather(Shape(kernel), axes))))``: the new shape is computed at run time from the
kernel's own shape, so the reshaped kernel reaches its Gemm as a computed value, and qcal planned
that Gemm as a product of two activations (kept float under placement auto, quantized per tensor
at every run under "all"). onnxruntime folds such chains when it loads the model. Folded here,
`fold-constant-weights` then stores the reshaped kernel as the weight it is. Only integer and
boolean results of shape operators are folded, and float scalars: their arithmetic is exact (or
one IEEE operation), so the model computes what it did.

As onnxruntime does, a Shape (or Size) of a tensor whose shape inference finds fully static (an
input of static shape, and what follows from it) is a constant too. TorchScript exports compute
shapes at run time from the tensors they reshape (a Swin's windows, a MobileViT's patches, the
Expand that broadcasts a BERT-like encoder's token types): left to run, shape inference gave
their MatMuls' inputs a free first axis, the planner expected no Gemm of a MatMul and its bias
Add where onnxruntime, folding the same chains, formed one, and the Gemm then ran in float on
dequantized weights. Folded here, the chains that follow fold too, and inference runs again
(`_ROUNDS`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.files.large import light_copy
from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.passes._folding import evaluate_node, fold_into_initializers, tensor_size
from qcal.graph.passes._inference import infer_shapes
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, default_opset

__all__ = ["FoldConstantShapes"]

# Operators of shape arithmetic. Shape and Size read only their input's dimensions.
_SHAPE_OPS = frozenset({
    "Shape", "Size", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Cast",
    "ReduceProd", "ReduceSum", "ReduceMin", "ReduceMax", "Add", "Sub", "Mul", "Div", "Neg",
    "Abs", "Range", "Max", "Min", "Equal", "Where", "Expand", "Tile", "ConstantOfShape",
    "Mod", "Transpose", "Flatten", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not",
    "And", "Or", "Sign", "Ceil", "Floor", "Round",
})
_EXACT_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})
_TYPES_OF = {np.dtype(np.int64): onnx.TensorProto.INT64, np.dtype(np.int32): onnx.TensorProto.INT32,
             np.dtype(np.bool_): onnx.TensorProto.BOOL, np.dtype(np.float32): onnx.TensorProto.FLOAT,
             np.dtype(np.float64): onnx.TensorProto.DOUBLE}
# Shape computations that go through floats (torch's `math.ceil(height / patch) * patch`, as a
# Cast, Div, Ceil, Mul, Cast chain) fold where their values are scalars: each a single IEEE
# operation, numpy computes what onnxruntime does. Larger float tensors are weights, not shapes.
_FLOAT_SCALARS = 1
# Shape arithmetic works on a handful of values: larger operands are left to onnxruntime.
_MOST_VALUES = 4096
# Rounds of shape inference and folding: each may make more shapes static (a shape folded
# gives a Reshape a constant target, whose output's Shape folds in the next round).
_ROUNDS = 8
# Shape inference reads these weights' dims, not their bytes: larger ones are left out of its copy.
_DETACH_BYTES = 1 << 12


class FoldConstantShapes:
    """Replace each node of the main graph that computes an integer value from constants
    alone with shape operators by an initializer of its output's name, in graph order (so
    chains fold in one run); a constant nothing reads any more goes."""

    name: ClassVar[str] = "fold-constant-shapes"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:  # initializers must be inputs
            return StepResult(model, False)
        opset = default_opset(model) or 1
        conditions = _if_conditions(model.graph)

        def value_of(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
                     ) -> np.ndarray | None:
            if (node.op_type not in _SHAPE_OPS or node.domain not in DEFAULT_DOMAINS
                    or len(node.output) != 1 or node.output[0] in conditions):
                return None
            return _evaluate(node, constants, opset)

        count = fold_into_initializers(model, value_of)
        for _ in range(_ROUNDS):
            read = _fold_static_shape_reads(model, conditions)
            if not read:
                break
            count += read + fold_into_initializers(model, value_of)
        if not count:
            return StepResult(model, False)
        return StepResult(model, True, f"folded {count} shape computation{'s' * (count != 1)} "
                                       "on constants into initializers")


def _shape_value(node: onnx.NodeProto, dims: list[int]) -> np.ndarray:
    """What a Shape or Size node gives for an input of these dimensions."""
    if node.op_type == "Size":
        return np.array(int(np.prod(dims, dtype=np.int64)), np.int64)
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attributes.get("start", 0), attributes.get("end")
    return np.array(dims[start:end], np.int64)


def _if_conditions(graph: onnx.GraphProto) -> frozenset[str]:
    """The values an If's condition is computed from in `graph` (the condition included): they
    stay computed. Made constants, onnxruntime would inline the branch the If picks and check the
    shapes there, which onnx's own AffineGrid expansion fails (its 2-D branch gives Range a [1]
    bound) although the model as it stands runs."""
    return UseIndex.build(graph).upstream(
        n.input[0] for n in graph.node if n.op_type == "If" and n.input)


def _fold_static_shape_reads(model: onnx.ModelProto, conditions: frozenset[str]) -> int:
    """Replace each main-graph Shape/Size of a computed tensor whose shape inference finds
    static by an initializer (not those an If's condition is computed from); how many. Inference runs on a copy without the model's value_info
    (what an exporter declared is not checked) and without large weights."""
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    outputs = {v.name for v in graph.output}
    reads = [n for n in graph.node
             if n.op_type in ("Shape", "Size") and n.domain in DEFAULT_DOMAINS and n.input
             and n.input[0] not in constants and len(n.output) == 1
             and n.output[0] not in outputs and n.output[0] not in conditions]
    if not reads:
        return 0
    light, _ = light_copy(model, min_bytes=_DETACH_BYTES)
    del light.graph.value_info[:]
    try:
        inferred = infer_shapes(light, strict=False).graph
    except Exception:  # noqa: BLE001  the C++ inference raises assorted types: nothing folds
        return 0
    static: dict[str, list[int]] = {}
    for value in (*inferred.input, *inferred.value_info):
        shape = value.type.tensor_type.shape if value.type.HasField("tensor_type") else None
        if (shape is not None and value.type.tensor_type.HasField("shape")
                and all(d.HasField("dim_value") for d in shape.dim)):
            static[value.name] = [int(d.dim_value) for d in shape.dim]
    folded = {n.output[0]: _shape_value(n, static[n.input[0]]) for n in reads
              if n.input[0] in static}
    if not folded:
        return 0
    kept = [n for n in graph.node if not (n.output and n.output[0] in folded)]
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in folded.items())
    return len(folded)


def _evaluate(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
              opset: int) -> np.ndarray | None:
    """The integer value `node` computes from the constants it reads, or None (float scalars
    too: `_FLOAT_SCALARS`)."""
    if node.op_type in ("Shape", "Size"):  # the dimensions alone: no data read
        return _shape_value(node, [int(d) for d in constants[node.input[0]].dims])
    if not all(_shape_like(t.data_type, tensor_size(t))
               for t in (constants[v] for v in node.input if v)):
        return None
    value = evaluate_node(node, constants, opset)
    if value is None or not _shape_like(_TYPES_OF.get(value.dtype, 0), value.size):
        return None
    return value


def _shape_like(data_type: int, size: int) -> bool:
    """Values shape arithmetic computes: a few integers or booleans (a shape's comparison, the
    condition of a Where choosing dims), or a float scalar (`_FLOAT_SCALARS`)."""
    if data_type in _EXACT_TYPES:
        return size <= _MOST_VALUES
    return data_type in _FLOAT_TYPES and size <= _FLOAT_SCALARS
