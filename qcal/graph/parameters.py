"""Which inputs of an operator are parameters: never quantized.

An operator's inputs are either the values it computes with or
parameters that say how (Resize's roi/scales/sizes, Reshape's shape, Pad's pads, Slice's starts,
TopK's k, ...). Which is which comes from the ONNX schemas, not from a list: an input after the
first whose type constraint differs from the first output's, and allows other types, is a
parameter (Attention's V has a constraint of its own, T2, that allows exactly the float types
its output's T1 does: a value, the attention's values). The first input is
always a value, even where the operator writes another type (Cast, ArgMax, Greater). A float tensor that flows only into
parameters (a scale factor computed from a shape, divided and concatenated on its way to a
Resize) is a parameter too, with everything computed only for it: quantizing it changes what
the operator does, not how precisely (and onnxruntime may refuse the result, e.g. a cubic Resize).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import onnx
import onnx.defs

from qcal.graph.structure import DEFAULT_DOMAINS, SUBGRAPH_SLOT, UseIndex

__all__ = ["PARAMETER_ONLY", "parameter_slots", "parameter_tensors"]

# How a tensor that flows only into parameters is named in a node's reason.
PARAMETER_ONLY = "computed only for"


def parameter_slots(node: onnx.NodeProto, opset: int) -> frozenset[int]:
    """Input positions of `node` that are parameters by its schema (type constraint differs
    from the first output's). Unknown operators and variadic inputs: none."""
    if node.domain not in DEFAULT_DOMAINS:
        return frozenset()
    return frozenset(s for s in _schema_parameter_slots(node.op_type, opset) if s < len(node.input))


@functools.lru_cache(maxsize=512)
def _schema_parameter_slots(op_type: str, opset: int) -> frozenset[int]:
    """The schema's parameter positions, looked up once per (op type, opset): planning asks
    for every use of every tensor."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return frozenset()
    if not schema.outputs:
        return frozenset()
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}

    def types(type_str: str) -> frozenset[str]:  # a constraint's types, or one fixed type
        return allowed.get(type_str, frozenset({type_str}))

    value_type = schema.outputs[0].type_str
    slots = set()
    for slot, formal in enumerate(schema.inputs):
        if formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            break
        # The first input is what the operator works on, whatever type it writes: Cast's data,
        # ArgMax's logits, Greater's left side. (A model ending in Cast or ArgMax otherwise had
        # every tensor "computed only for a parameter", and nothing quantized.)
        if (slot > 0 and formal.type_str != value_type
                and types(formal.type_str) != types(value_type)):
            slots.add(slot)
    return frozenset(slots)


def parameter_tensors(graph: onnx.GraphProto, index: UseIndex, opset: int) -> dict[str, str]:
    """Tensor -> reason, for every tensor that flows only into parameters (module docstring)."""
    roots: dict[str, str] = {}  # tensor -> the parameter input it ends in
    for node in reversed(graph.node):  # readers before producers: graphs are sorted
        for slot in sorted(parameter_slots(node, opset)):
            tensor = node.input[slot]
            if tensor and tensor not in roots and _only_parameter_uses(tensor, index, roots, opset):
                roots[tensor] = f"a parameter of {node.op_type} node {node.name!r}"
        outputs = [v for v in node.output if v]
        if outputs and all(v in roots for v in outputs):
            for tensor in node.input:
                if tensor and tensor not in roots and _only_parameter_uses(
                    tensor, index, roots, opset
                ):
                    roots[tensor] = roots[outputs[0]]
    return {
        tensor: f"{PARAMETER_ONLY} {root}: never quantized" for tensor, root in roots.items()
    }


def _only_parameter_uses(
    tensor: str, index: UseIndex, found: Mapping[str, str], opset: int
) -> bool:
    if tensor in index.graph_outputs:
        return False
    for use in index.uses.get(tensor, ()):
        if use.slot == SUBGRAPH_SLOT:
            return False
        if use.slot in parameter_slots(use.node, opset):
            continue
        outputs = [v for v in use.node.output if v]
        if not outputs or not all(v in found for v in outputs):
            return False
    return True
