"""What the user lets qcal quantize and what stays float by default: the selection checked
against the model before planning (`_check_selection`: op types with a rule, tensors that exist,
named nodes, a float model), and the per-node and per-tensor exclusions the planner applies
(`_Selection`: --op-types, --exclude-op-types, --exclude-nodes, --exclude-tensors, the default
exclusions `qcal.graph.traps` finds, names defined in several subgraphs)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING

import onnx

from qcal.graph.plan._rules import OP_RULES, OpRule
from qcal.graph.plan._walk import _walk_nodes
from qcal.graph.structure import DEFAULT_DOMAINS, FLOAT_TYPES, NO_RULE, attribute_graphs
from qcal.numerics.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from qcal.graph.placement import Placement
    from qcal.graph.plan._targets import _NodeTargets
    from qcal.graph.plan._types import SelectionRules
    from qcal.graph.traps import Traps

_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
# Operators that compute on integer codes: a model holding one is quantized already, though it
# may have no Q/DQ pair (a weight-only model's MatMulNBits reads float activations).
_QUANTIZED_OPS = _QDQ_OPS | {"QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger"}
_QUANTIZED_CONTRIB_OPS = frozenset({
    "MatMulNBits", "MatMulBnb4", "GatherBlockQuantized", "QGemm", "QAttention",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QOrderedMatMul", "DynamicQuantizeLSTM",
})


def _quantized_op(node: onnx.NodeProto) -> bool:
    if node.domain in DEFAULT_DOMAINS:
        return node.op_type in _QUANTIZED_OPS
    return node.domain == "com.microsoft" and (
        node.op_type in _QDQ_OPS or node.op_type in _QUANTIZED_CONTRIB_OPS
        or node.op_type.startswith("QLinear"))


def _check_selection(model: onnx.ModelProto, rules: SelectionRules) -> None:
    if rules.op_types is not None:
        unknown = sorted(rules.op_types - OP_RULES.keys())
        if unknown:
            raise ConfigError(
                f"op_types: no quantization rule for op type {unknown[0]!r} "
                f"(rules exist for {', '.join(sorted(OP_RULES))})"
            )
    if rules.exclude_tensors:
        missing = sorted(rules.exclude_tensors - _tensor_names(model.graph))
        if missing:
            raise ConfigError(f"exclude_tensors: {missing[0]!r} is not a tensor of the model")
    names: set[str] = set()
    for node, _ in _walk_nodes(model.graph, None):
        if not node.name:
            raise ModelError(f"a {node.op_type} node has no name; run prepare_model first")
        if node.name in names:
            raise ModelError(f"node name {node.name!r} is used twice; run prepare_model first")
        names.add(node.name)
        if _quantized_op(node):
            raise ModelError(
                f"node {node.name!r} is a {node.op_type}: the model is already "
                "quantized, and qcal quantizes float models only"
            )


def _tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names.update(t.name for t in graph.initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attribute in node.attribute:
            for subgraph in attribute_graphs(attribute):
                names |= _tensor_names(subgraph)
    names.discard("")
    return names


class _Selection:
    """The planner's exclusions (`_Planner` holds the state they read, set by its constructor)."""

    _rules: SelectionRules
    _traps: Traps
    _ambiguous: frozenset[str]
    _types: Mapping[str, int]
    _parameters: Mapping[str, str]
    _placed: Placement

    def _select(self, node: onnx.NodeProto) -> tuple[OpRule | None, str]:
        """The node's rule, or why it is not quantized (by op type or name)."""
        rules = self._rules
        op = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        rule = OP_RULES.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if rules.op_types is not None and op not in rules.op_types:
            return None, f"op type {op} not in --op-types"
        if rule is None:
            return None, f"{NO_RULE} {op}"
        if op in rules.exclude_op_types:
            return None, f"op type {op} excluded by --exclude-op-types"
        for pattern in rules.exclude_nodes:
            if fnmatch.fnmatchcase(node.name, pattern):
                return None, f"node name matches --exclude-nodes pattern {pattern!r}"
        if node.name in self._traps.nodes:
            return None, self._traps.nodes[node.name]
        return rule, ""

    def _quantizable(self, tensor: str) -> bool:
        return tensor not in self._rules.exclude_tensors and self._types.get(tensor) in FLOAT_TYPES

    def _accepts(self, tensor: str, found: _NodeTargets) -> bool:
        """Whether `tensor` may be quantized; notes why not when the user should know."""
        if tensor in self._rules.exclude_tensors:
            found.notes.append(f"{tensor!r} excluded by --exclude-tensors")
            return False
        if tensor in self._traps.tensors:
            found.notes.append(f"{tensor!r} left float: {self._traps.tensors[tensor]}")
            return False
        if tensor in self._ambiguous:
            found.notes.append(f"{tensor!r} left float: its name is defined in several subgraphs")
            return False
        elem_type = self._types.get(tensor)
        if elem_type is None:
            found.notes.append(f"{tensor!r} left float: element type unknown")
            return False
        if elem_type not in FLOAT_TYPES:
            return False
        why = self._parameters.get(tensor) or self._placed.tensors.get(tensor)
        if why is not None:
            found.notes.append(f"{tensor!r} left float: {why}")
            return False
        return True
