"""The quantization plan: per-operator rules and the user's selection decide, for every node,
whether it is quantized and which tensors get Q/DQ. Public through `qcal.graph.model`."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import onnx

from qcal.graph.files.large import tensor_array
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    UseIndex,
    attribute_graphs,
    graph_element_types,
)
from qcal.graph.traps import Traps, find_traps
from qcal.numerics.errors import ConfigError, ModelError

__all__ = [
    "OP_RULES",
    "OP_RULES_DOC",
    "ActivationTarget",
    "BiasTarget",
    "NodeDecision",
    "OpRule",
    "QuantPlan",
    "SelectionRules",
    "WeightTarget",
    "leave_unobserved_float",
    "plan_quantization",
    "rules_table",
]

# ------------------------------------------------------------------------------ the op rules


def _conv_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    return 0


def _conv_transpose_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    return 1


def _gemm_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    # B is (N, K) with transB=1, else (K, N): the output channel N is axis 0 or 1.
    return 0 if _int_attribute(node, "transB", 0) else 1


def _matmul_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    # B is (..., K, N): the output channel is the last axis; a vector B has no channel.
    return rank - 1 if rank >= 2 else None


@dataclass(frozen=True)
class OpRule:
    """How one operator type is quantized.

    Attributes:
        summary: one line for the docs and the plan's reasons.
        inputs: input positions whose float tensors are quantized (None: every input).
            Activations get a Q/DQ pair; constant (initializer) inputs become weights,
            per tensor unless this is the `weight` position.
        outputs: output positions whose float tensors are quantized (None: every output).
        weight: input position of the weight that may be quantized per channel.
        weight_axis: the weight's channel axis from (node, weight rank); None: per tensor.
        bias: input position of a bias stored as int32 (scale = input scale x weight scale).
        fuses_activation: onnxruntime fuses a directly following Relu/Clip into this op, so
            the tensor between them is left float.
        divides_by_constant: the node divides input 0 by input 1 and is quantized only when
            input 1 is a positive constant scalar c; its output then takes input 0's parameters
            with the scale divided by c, and the division is folded into the output's
            DequantizeLinear (``DQ(q, s, z) / c = DQ(q, s / c, z)``): nothing left to run.
    """

    summary: str
    inputs: tuple[int, ...] | None = (0,)
    outputs: tuple[int, ...] | None = (0,)
    weight: int | None = None
    weight_axis: Callable[[onnx.NodeProto, int], int | None] | None = field(
        default=None, compare=False
    )
    bias: int | None = None
    fuses_activation: bool = False
    divides_by_constant: bool = False


def _data_rule(what: str) -> OpRule:
    return OpRule(summary=f"{what} and the output")


OP_RULES: Mapping[str, OpRule] = {
    "Conv": OpRule(
        "input X, weight W (per channel: axis 0) and output Y; bias B as int32",
        inputs=(0, 1),
        weight=1,
        weight_axis=_conv_weight_axis,
        bias=2,
        fuses_activation=True,
    ),
    "ConvTranspose": OpRule(
        "input X, weight W (per channel: axis 1) and output Y; bias stays float",
        inputs=(0, 1),
        weight=1,
        weight_axis=_conv_transpose_weight_axis,
    ),
    "Gemm": OpRule(
        "input A, weight B (per channel: axis 0 if transB=1, else 1) and output Y; "
        "1-D bias C as int32 when alpha = beta = 1",
        inputs=(0, 1),
        weight=1,
        weight_axis=_gemm_weight_axis,
        bias=2,
        fuses_activation=True,
    ),
    "MatMul": OpRule(
        "inputs A and B and output Y; a constant B per channel on its last axis, a constant A "
        "per tensor; two activations (attention) are both quantized",
        inputs=(0, 1),
        weight=1,
        weight_axis=_matmul_weight_axis,
        fuses_activation=True,
    ),
    "Add": OpRule(
        "both inputs (constants per tensor, in the activation type) and the output",
        inputs=(0, 1),
        fuses_activation=True,
    ),
    "Mul": OpRule(
        "both inputs (constants per tensor, in the activation type) and the output",
        inputs=(0, 1),
        fuses_activation=True,
    ),
    "Div": OpRule(
        "input A and the output, only when B is a positive constant scalar c: the output takes "
        "A's parameters with the scale divided by c, which removes the division",
        divides_by_constant=True,
    ),
    "Concat": OpRule("every input and the output", inputs=None),
    "MaxPool": _data_rule("input X (never the Indices output)"),
    "AveragePool": _data_rule("input X"),
    "GlobalAveragePool": _data_rule("input X"),
    "GlobalMaxPool": _data_rule("input X"),
    "Relu": _data_rule("input X"),
    "LeakyRelu": _data_rule("input X"),
    "Sigmoid": _data_rule("input X"),
    "Softmax": _data_rule("input X"),
    "Clip": _data_rule("input X (never min/max)"),
    "Resize": _data_rule("input X (never roi/scales/sizes)"),
    "Reshape": _data_rule("input data (never the shape)"),
    "Transpose": _data_rule("input X"),
    "Flatten": _data_rule("input X"),
    "Squeeze": _data_rule("input data (never axes)"),
    "Unsqueeze": _data_rule("input data (never axes)"),
    "Slice": _data_rule("input data (never starts/ends/axes/steps)"),
    "Gather": _data_rule("input data (never indices)"),
    "DepthToSpace": _data_rule("input X"),
    "SpaceToDepth": _data_rule("input X"),
    "Split": OpRule("input (never split sizes) and every output", outputs=None),
}
OP_RULES_DOC = """Per-operator quantization rules (ai.onnx domain), keyed by op type.

Only tensors with a float element type (float32, float16, bfloat16; observed in float32) are
quantized: shapes, indices and masks never are. A node whose op type has no rule stays float.
A tensor read by a quantized node at a quantized input position is quantized for that node
(whoever produced it, graph inputs included); a quantized node's quantized outputs are
quantized even when nothing quantized reads them. For onnxruntime's CPU provider, the tensor
between a Conv, Gemm, MatMul, Add or Mul and a Relu or Clip (constant bounds) that is its only
reader is left float: onnxruntime folds the activation into the QuantizeLinear that follows
it, and the Relu/Clip output is quantized instead. The outputs of Reshape, Transpose, Flatten,
Squeeze, Unsqueeze, Gather, Split, DepthToSpace, SpaceToDepth, MaxPool, GlobalMaxPool and
Resize (not cubic) take the parameters of their input and are not observed: their values lie
in its range, and onnxruntime then runs them on the integers (float readers of such an output
read its DequantizeLinear, which holds the same values). The output of a Div by a positive
constant scalar c takes its input's parameters with the scale divided by c: the
DequantizeLinear of the input's codes with that scale is the quotient, and the Div is removed
(as in the x * relu6(x + 3) / 6 of hard-swish). Constants at quantized inputs are
stored pre-quantized: at a weight input with the weight scheme, elsewhere (Add, Mul, Concat,
a constant MatMul A) per tensor with the activation scheme, whose type the integer kernels need.
"""
"""The principles behind `OP_RULES`, for the README and `qcal inspect`."""

_FUSED_ACTIVATIONS = frozenset({"Relu", "Clip"})
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


def rules_table() -> str:
    """`OP_RULES` as a Markdown table (for the README and `qcal inspect`); see `OP_RULES_DOC`."""
    lines = ["| op type | quantized |", "| --- | --- |"]
    lines += [f"| {op} | {rule.summary} |" for op, rule in OP_RULES.items()]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class SelectionRules:
    """Which nodes and tensors the user lets qcal quantize.

    Attributes:
        op_types: only these op types (None: every op type with a rule).
        exclude_op_types: op types to leave float.
        exclude_nodes: fnmatch globs on node names to leave float.
        exclude_tensors: tensors never to quantize.
        per_channel: quantize weights per channel where the rule allows.
        default_exclusions: apply the trap-avoiding default exclusions (`TRAP_RULES_DOC`).
    """

    op_types: frozenset[str] | None = None
    exclude_op_types: frozenset[str] = frozenset()
    exclude_nodes: tuple[str, ...] = ()
    exclude_tensors: frozenset[str] = frozenset()
    per_channel: bool = True
    default_exclusions: bool = True


@dataclass(frozen=True)
class ActivationTarget:
    """An activation to observe and quantize once.

    Attributes:
        tensor: its name.
        consumers: names of the quantized nodes that read it through the DQ (sorted).
        same_as: for the output of an operator that only moves or selects values (Reshape,
            Transpose, MaxPool, Resize, ...; `SAME_SCALE_OPS`), the activation upstream whose
            parameters it takes instead of being observed: its values lie within that tensor's
            range, and with equal parameters onnxruntime runs the operator on the integers,
            without a DequantizeLinear/QuantizeLinear pair around it. None: observed itself.
        divisor: with `same_as`, the source's scale is divided by this: the tensor is the
            source divided by a positive constant (a Div, `OpRule.divides_by_constant`, on the
            way). 1.0 when only data movement lies between them.
    """

    tensor: str
    consumers: tuple[str, ...]
    same_as: str | None = None
    divisor: float = 1.0


@dataclass(frozen=True)
class WeightTarget:
    """A constant (initializer) read by a quantized node, stored pre-quantized.

    Attributes:
        tensor: the initializer's name.
        node: the quantized node reading it.
        op_type: that node's op type.
        axis: channel axis for per-channel quantization, None for per-tensor.
        role: "weight" at the rule's weight input (the preset's weight scheme); "operand" at
            another input (Add, Mul, Concat, a constant MatMul A): per tensor in the activation
            scheme, so that its type matches the activations and onnxruntime's integer kernels
            (QLinearAdd, QLinearMul, ...) take the node.
    """

    tensor: str
    node: str
    op_type: str
    axis: int | None
    role: str = "weight"


@dataclass(frozen=True)
class BiasTarget:
    """A bias stored as int32 with scale = input scale x weight scale.

    Attributes:
        tensor: the bias initializer.
        node: the Conv/Gemm reading it.
        input_tensor: the quantized activation feeding the node.
        weight_tensor: the node's quantized weight.
    """

    tensor: str
    node: str
    input_tensor: str
    weight_tensor: str


@dataclass(frozen=True)
class NodeDecision:
    """Whether a node is quantized, and why (the rule used, or the reason it was skipped)."""

    node: str
    op_type: str
    quantized: bool
    reason: str


@dataclass(frozen=True)
class QuantPlan:
    """What to quantize: targets sorted by tensor name, node decisions in graph order."""

    activations: tuple[ActivationTarget, ...]
    weights: tuple[WeightTarget, ...]
    biases: tuple[BiasTarget, ...]
    nodes: tuple[NodeDecision, ...]


def plan_quantization(model: onnx.ModelProto, rules: SelectionRules) -> QuantPlan:
    """Decide, by `OP_RULES` and `rules`, which nodes and tensors of `model` to quantize.

    `model` should come from `prepare_model` (named nodes, Constant weights as initializers,
    inferred types): tensors whose element type is unknown are not quantized. Nodes inside
    If/Loop/Scan bodies are planned by the same rules (constants of enclosing graphs count as
    weights); nodes in the graphs of other operators stay float, with that reason.

    Raises:
        ConfigError: an op type in `rules.op_types` has no rule, or a tensor in
            `rules.exclude_tensors` is not in the model.
        ModelError: a node has no name or a repeated one, or the model is already quantized.
    """
    _check_selection(model, rules)
    return _Planner(model.graph, rules, ambiguous=_defined_twice(model.graph)).plan()


def leave_unobserved_float(
    model: onnx.ModelProto, plan: QuantPlan, unobserved: Iterable[str]
) -> QuantPlan:
    """`plan` without what calibration never saw, which stays float.

    An activation in `unobserved` received no values (an If branch not taken, a Loop that ran
    no iteration, a tensor empty in every batch): it is not quantized, and its quantized
    readers say so. An If/Loop/Scan body none of whose planned tensors received values never
    ran during calibration: every node in it (nested bodies included) stays float, with that
    reason.
    """
    never = set(unobserved)
    dropped = set(never)  # grows by activations whose every quantized reader stays float
    if not never:
        return plan
    planned = {t.tensor for t in plan.activations}
    idle: dict[str, str] = {}  # node -> why it stays float
    producers: dict[str, str] = {}  # planned activation -> node writing it

    def visit(graph: onnx.GraphProto, where: str | None) -> None:
        local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        for node in graph.node:
            local.update(node.output)
            producers.update((v, node.name) for v in node.output if v in planned)
        mine = planned & local
        if where is not None and mine and mine <= dropped:
            reason = f"inside {where}, which never ran during calibration: left float"
            idle.update((node.name, reason) for node, _ in _walk_nodes(graph, where))
            return
        for node in graph.node:
            if node.op_type not in _CONTROL_FLOW_OPS or node.domain not in DEFAULT_DOMAINS:
                continue
            for attribute in node.attribute:
                for body in attribute_graphs(attribute):
                    visit(body, f"the {attribute.name} of {node.op_type} node {node.name!r}")

    visit(model.graph, None)
    activations = []
    for target in plan.activations:
        consumers = tuple(c for c in target.consumers if c not in idle)
        if target.tensor in dropped or (target.consumers and not consumers):
            dropped.add(target.tensor)
            continue
        activations.append(
            ActivationTarget(target.tensor, consumers, target.same_as, target.divisor)
        )
    weights = tuple(w for w in plan.weights if w.node not in idle)
    biases = tuple(
        b for b in plan.biases if b.node not in idle and b.input_tensor not in dropped
    )
    live: set[str] = {w.node for w in weights}
    live.update(c for t in activations for c in t.consumers)
    live.update(producers[t.tensor] for t in activations if t.tensor in producers)
    notes: dict[str, list[str]] = {}
    for target in plan.activations:
        if target.tensor in never:
            for consumer in target.consumers:
                notes.setdefault(consumer, []).append(
                    f"input {target.tensor!r} left float: it received no values in calibration"
                )
    decisions = []
    for decision in plan.nodes:
        if decision.node in idle:
            decision = NodeDecision(decision.node, decision.op_type, False, idle[decision.node])
        elif decision.quantized and decision.node not in live:
            reason = "; ".join(notes.get(decision.node, ["nothing it quantizes received values"]))
            decision = NodeDecision(decision.node, decision.op_type, False, f"left float: {reason}")
        elif decision.node in notes:
            reason = "; ".join([decision.reason, *notes[decision.node]])
            decision = NodeDecision(decision.node, decision.op_type, decision.quantized, reason)
        decisions.append(decision)
    return QuantPlan(tuple(activations), weights, biases, tuple(decisions))


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
        if node.op_type in _QDQ_OPS and node.domain in (*DEFAULT_DOMAINS, "com.microsoft"):
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


def _walk_nodes(
    graph: onnx.GraphProto, container: str | None
) -> Iterator[tuple[onnx.NodeProto, str | None]]:
    """Nodes depth first in graph order, with where they sit (None: the main graph)."""
    for node in graph.node:
        yield node, container
        for attribute in node.attribute:
            for subgraph in attribute_graphs(attribute):
                where = f"the {attribute.name} of {node.op_type} node {node.name!r}"
                yield from _walk_nodes(subgraph, container or where)


@dataclass
class _NodeTargets:
    """What one selected node would quantize, before it is known to be quantized."""

    inputs: list[str] = field(default_factory=list)  # activations it reads through a DQ
    outputs: list[str] = field(default_factory=list)  # activations it writes
    weights: list[tuple[str, int | None]] = field(default_factory=list)  # (tensor, axis)
    operands: list[str] = field(default_factory=list)  # weights not at the rule's weight input
    notes: list[str] = field(default_factory=list)  # what the user should know

    def is_empty(self) -> bool:
        return not (self.inputs or self.outputs or self.weights)

    def empty_reason(self) -> str:
        if self.notes:
            return "nothing to quantize: " + "; ".join(self.notes)
        return "no float tensor to quantize"


_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})


def _defined_twice(graph: onnx.GraphProto) -> frozenset[str]:
    """Value names defined in more than one graph (sibling subgraphs may reuse a name)."""
    seen: set[str] = set()
    twice: set[str] = set()

    def visit(g: onnx.GraphProto) -> None:
        names = {v.name for v in g.input} | {t.name for t in g.initializer}
        names.update(v for node in g.node for v in node.output)
        names.discard("")
        twice.update(names & seen)
        seen.update(names)
        for node in g.node:
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    visit(subgraph)

    visit(graph)
    return frozenset(twice)


@dataclass
class _Found:
    """What planning found so far, over the main graph and its bodies."""

    readers: dict[str, set[str]] = field(default_factory=dict)
    weights: dict[str, list[tuple[str, str, int | None]]] = field(default_factory=dict)
    operands: set[tuple[str, str]] = field(default_factory=set)  # (weight, node) not at `weight`
    # output -> (input, divisor) of a SAME_SCALE_OPS node (1.0) or a Div by a constant
    shares: dict[str, tuple[str, float]] = field(default_factory=dict)
    biases: list[BiasTarget] = field(default_factory=list)
    decisions: list[NodeDecision] = field(default_factory=list)


class _Planner:
    """One planning run over one graph, the main graph or an If/Loop/Scan body (indexes built
    once); bodies are planned by planners of their own, in graph order, depth first."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        rules: SelectionRules,
        *,
        types: Mapping[str, int] | None = None,
        outer_constants: Mapping[str, onnx.TensorProto] | None = None,
        ambiguous: frozenset[str] = frozenset(),
    ) -> None:
        self._graph = graph
        self._rules = rules
        self._index = UseIndex.build(graph)
        # Value names are unique across scopes (bar `ambiguous`), so one type map serves all.
        self._types = graph_element_types(graph) if types is None else types
        self._outer_constants = outer_constants or {}
        self._ambiguous = ambiguous
        self._selected: dict[str, OpRule] = {}
        self._skips: dict[str, str] = {}
        self._traps = (
            find_traps(graph, self._index, self._types, self._constant)
            if rules.default_exclusions else Traps()
        )
        for node in graph.node:
            rule, reason = self._select(node)
            if rule is not None:
                self._selected[node.name] = rule
            else:
                self._skips[node.name] = reason
        self._fused = self._fused_tensors()
        self._ranks = {
            v.name: len(v.type.tensor_type.shape.dim)
            for v in (*graph.input, *graph.value_info, *graph.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
        }

    def plan(self) -> QuantPlan:
        found = _Found()
        self._plan_into(found)
        readers = found.readers
        roots = _share_roots(found.shares, readers)
        return QuantPlan(
            activations=tuple(
                ActivationTarget(t, tuple(sorted(readers[t])), *roots.get(t, (None, 1.0)))
                for t in sorted(readers)
            ),
            weights=_weight_targets(found.weights, found.operands),
            biases=tuple(sorted(found.biases, key=lambda b: (b.tensor, b.node))),
            nodes=tuple(found.decisions),
        )

    def _plan_into(self, found: _Found) -> None:
        for node in self._graph.node:
            self._decide(node, found)
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    where = f"the {attribute.name} of {node.op_type} node {node.name!r}"
                    if node.op_type in _CONTROL_FLOW_OPS and node.domain in DEFAULT_DOMAINS:
                        body = _Planner(
                            subgraph,
                            self._rules,
                            types=self._types,
                            outer_constants=self._scope_constants(),
                            ambiguous=self._ambiguous,
                        )
                        body._plan_into(found)
                        continue
                    reason = f"inside {where}: only If, Loop and Scan bodies are quantized"
                    found.decisions += [
                        NodeDecision(inner.name, inner.op_type, False, reason)
                        for inner, _ in _walk_nodes(subgraph, where)
                    ]

    def _decide(self, node: onnx.NodeProto, found: _Found) -> None:
        rule = self._selected.get(node.name)
        targets = self._targets(node, rule) if rule is not None else self._skips[node.name]
        if isinstance(targets, str) or targets.is_empty():
            reason = targets if isinstance(targets, str) else targets.empty_reason()
            found.decisions.append(NodeDecision(node.name, node.op_type, False, reason))
            return
        assert rule is not None
        for tensor in targets.inputs:
            found.readers.setdefault(tensor, set()).add(node.name)
        for tensor in targets.outputs:
            found.readers.setdefault(tensor, set())
        for tensor, axis in targets.weights:
            found.weights.setdefault(tensor, []).append((node.name, node.op_type, axis))
        found.operands.update((tensor, node.name) for tensor in targets.operands)
        found.shares.update(_shared_outputs(node, targets, self._divisor(node)))
        bias = self._bias(node, rule, targets)
        if bias is not None:
            found.biases.append(bias)
        reason = "; ".join([f"{node.op_type} rule: {rule.summary}", *targets.notes])
        found.decisions.append(NodeDecision(node.name, node.op_type, True, reason))

    def _constant(self, value: str) -> onnx.TensorProto | None:
        """The initializer holding `value`, in this graph or an enclosing one."""
        own = self._index.constant(value)
        if own is not None or value in self._index.graph_inputs or value in self._index.producer:
            return own
        return self._outer_constants.get(value)

    def _scope_constants(self) -> dict[str, onnx.TensorProto]:
        """The constants a body inside this graph sees: ours and those of enclosing graphs."""
        visible = {
            name: tensor
            for name, tensor in self._outer_constants.items()
            if name not in self._index.graph_inputs and name not in self._index.producer
        }
        visible.update(
            (name, tensor)
            for name, tensor in self._index.initializers.items()
            if name not in self._index.graph_inputs
        )
        return visible

    def _select(self, node: onnx.NodeProto) -> tuple[OpRule | None, str]:
        """The node's rule, or why it is not quantized (by op type or name)."""
        rules = self._rules
        op = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        rule = OP_RULES.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if rules.op_types is not None and op not in rules.op_types:
            return None, f"op type {op} not in --op-types"
        if rule is None:
            return None, f"no quantization rule for op {op}"
        if op in rules.exclude_op_types:
            return None, f"op type {op} excluded by --exclude-op-types"
        for pattern in rules.exclude_nodes:
            if fnmatch.fnmatchcase(node.name, pattern):
                return None, f"node name matches --exclude-nodes pattern {pattern!r}"
        if node.name in self._traps.nodes:
            return None, self._traps.nodes[node.name]
        return rule, ""

    def _fused_tensors(self) -> dict[str, tuple[str, str]]:
        """Tensor -> (compute node, activation node) for outputs onnxruntime fuses."""
        fused: dict[str, tuple[str, str]] = {}
        for node in self._graph.node:
            rule = self._selected.get(node.name)
            if rule is None or not rule.fuses_activation or not node.output:
                continue
            tensor = node.output[0]
            readers = self._index.readers(tensor)
            if tensor in self._index.graph_outputs or len(readers) != 1:
                continue
            if not (node.input and self._quantizable(node.input[0])):
                continue  # the compute node itself will not run quantized
            (activation,) = readers
            if (
                activation.op_type in _FUSED_ACTIVATIONS
                and activation.domain in DEFAULT_DOMAINS
                and activation.name in self._selected
                and activation.input[0] == tensor
                and len(self._index.uses.get(tensor, ())) == 1
                and self._quantizable(activation.output[0])
                and all(not v or self._constant(v) is not None for v in activation.input[1:])
            ):
                fused[tensor] = (node.name, activation.name)
        return fused

    def _divisor(self, node: onnx.NodeProto) -> float | None:
        """The positive finite scalar constant `node` divides by, or None (not such a node)."""
        rule = self._selected.get(node.name)
        if rule is None or not rule.divides_by_constant or len(node.input) < 2:
            return None
        constant = self._constant(node.input[1])
        if constant is None or constant.data_type not in FLOAT_TYPES:
            return None
        values = tensor_array(constant)
        if values.size != 1:
            return None
        if values.ndim and values.ndim > self._ranks.get(node.input[0], -1):
            return None  # a divisor of higher (or unknown) rank may broadcast to a new shape
        value = float(values.reshape(()))
        return value if math.isfinite(value) and value > 0 else None

    def _quantizable(self, tensor: str) -> bool:
        return tensor not in self._rules.exclude_tensors and self._types.get(tensor) in FLOAT_TYPES

    def _targets(self, node: onnx.NodeProto, rule: OpRule) -> _NodeTargets | str:
        """What `node` quantizes under `rule`, or why it cannot be quantized."""
        found = _NodeTargets()
        main = node.input[0] if node.input else ""
        if rule.weight is not None and main and self._types.get(main) not in FLOAT_TYPES:
            return f"input {main!r} is {self._type_name(main)}, not float"
        if rule.divides_by_constant and self._divisor(node) is None:
            return "the divisor is not a positive constant scalar"
        for slot, tensor in enumerate(node.input):
            if tensor and _quantized_slot(rule.inputs, slot):
                self._add_input(node, rule, slot, tensor, found)
        for slot, tensor in enumerate(node.output):
            if tensor and _quantized_slot(rule.outputs, slot):
                self._add_output(node, tensor, found)
        return found

    def _add_input(
        self, node: onnx.NodeProto, rule: OpRule, slot: int, tensor: str, found: _NodeTargets
    ) -> None:
        if (node.name, tensor) in self._traps.reads:
            found.notes.append(self._traps.reads[(node.name, tensor)])
            return
        if tensor in self._fused:
            found.notes.append(
                f"input {tensor!r} left float: onnxruntime fuses this "
                f"{node.op_type} into {self._fused[tensor][0]!r}"
            )
            return
        if not self._accepts(tensor, found):
            return
        constant = self._constant(tensor)
        if constant is None:
            found.inputs.append(tensor)
            return
        axis = None
        if slot == rule.weight and rule.weight_axis is not None and self._rules.per_channel:
            axis = rule.weight_axis(node, len(constant.dims))
        found.weights.append((tensor, axis))
        if slot != rule.weight:
            found.operands.append(tensor)

    def _add_output(self, node: onnx.NodeProto, tensor: str, found: _NodeTargets) -> None:
        if tensor in self._fused:
            found.notes.append(
                f"output {tensor!r} left float: onnxruntime fuses the "
                f"following {self._fused[tensor][1]!r} into it"
            )
            return
        if self._accepts(tensor, found):
            found.outputs.append(tensor)

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
        return elem_type in FLOAT_TYPES

    def _bias(self, node: onnx.NodeProto, rule: OpRule, targets: _NodeTargets) -> BiasTarget | None:
        if rule.bias is None or len(node.input) <= rule.bias or not node.input[rule.bias]:
            return None
        bias, source, weight = node.input[rule.bias], node.input[0], node.input[1]
        why = self._bias_problem(node, bias, weight)
        if why is None and source not in targets.inputs:
            why = f"input {source!r} is not quantized"
        if why is None and weight not in {t for t, _ in targets.weights}:
            why = f"weight {weight!r} is not a quantized constant"
        if why is not None:
            targets.notes.append(f"bias {bias!r} stays float: {why}")
            return None
        return BiasTarget(tensor=bias, node=node.name, input_tensor=source, weight_tensor=weight)

    def _bias_problem(self, node: onnx.NodeProto, bias: str, weight: str) -> str | None:
        constant = self._constant(bias)
        weight_constant = self._constant(weight)
        if bias in self._rules.exclude_tensors:
            return "excluded by --exclude-tensors"
        if constant is None or constant.data_type not in FLOAT_TYPES:
            return "not a float constant"
        if len(self._index.readers(bias)) != 1:
            return "other nodes read it too"
        if weight_constant is None:
            return "the weight is not constant"
        if node.op_type == "Gemm":
            if (
                _float_attribute(node, "alpha", 1.0) != 1.0
                or _float_attribute(node, "beta", 1.0) != 1.0
            ):
                return "alpha or beta is not 1"
            channels = weight_constant.dims[0 if _int_attribute(node, "transB", 0) else -1]
        else:
            channels = weight_constant.dims[0]
        if list(constant.dims) != [channels]:
            return f"shape {list(constant.dims)} is not [{channels}]"
        return None

    def _type_name(self, tensor: str) -> str:
        elem_type = self._types.get(tensor)
        if elem_type is None:
            return "of unknown type"
        return str(onnx.TensorProto.DataType.Name(elem_type)).lower()


def _quantized_slot(slots: tuple[int, ...] | None, slot: int) -> bool:
    return slots is None or slot in slots


def _weight_targets(
    found: dict[str, list[tuple[str, str, int | None]]],
    operands: set[tuple[str, str]],
) -> tuple[WeightTarget, ...]:
    """One target per (weight, reading node); a weight read on different axes goes per tensor,
    and one read as a weight by any node is a weight for all (it has one set of codes)."""
    targets = []
    for tensor in sorted(found):
        uses = found[tensor]
        shared_axis = uses[0][2] if len({axis for _, _, axis in uses}) == 1 else None
        role = "operand" if all((tensor, node) in operands for node, _, _ in uses) else "weight"
        targets += [
            WeightTarget(tensor, node, op_type, shared_axis, role) for node, op_type, _ in uses
        ]
    return tuple(sorted(targets, key=lambda t: (t.tensor, t.node)))


# Operators whose outputs hold only values of their first input (moved, selected, or the max of
# some), or, for Resize, values between them: an output quantized with the input's parameters
# loses nothing the input did not, and onnxruntime then drops the DequantizeLinear/QuantizeLinear
# pair around the node and runs it on the integers.
SAME_SCALE_OPS = frozenset(
    {
        "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Gather", "Split",
        "DepthToSpace", "SpaceToDepth", "MaxPool", "GlobalMaxPool", "Resize",
    }
)


def _shared_outputs(
    node: onnx.NodeProto, targets: _NodeTargets, divisor: float | None
) -> list[tuple[str, tuple[str, float]]]:
    """(output, (input, divisor)) pairs where `node`'s quantized outputs take its quantized
    input's parameters (every output of a Split, the first of the others), with the scale
    divided by `divisor` for a Div by a constant (`divisor` set)."""
    if node.domain not in DEFAULT_DOMAINS:
        return []
    if divisor is not None:
        source, output = node.input[0], node.output[0]
        if source in targets.inputs and output in targets.outputs:
            return [(output, (source, divisor))]
        return []
    if node.op_type not in SAME_SCALE_OPS:
        return []
    if node.op_type == "Resize" and _string_attribute(node, "mode", "nearest") == "cubic":
        return []  # cubic interpolation overshoots its inputs
    source = node.input[0] if node.input else ""
    outputs = [o for o in node.output[: None if node.op_type == "Split" else 1] if o]
    if source not in targets.inputs or not outputs or not set(outputs) <= set(targets.outputs):
        return []
    return [(output, (source, 1.0)) for output in outputs]


def _share_roots(
    shares: Mapping[str, tuple[str, float]], readers: Mapping[str, set[str]]
) -> dict[str, tuple[str, float]]:
    """Shared output -> (the observed activation at the start of its chain of shares, the
    product of the divisors along the chain)."""
    roots: dict[str, tuple[str, float]] = {}
    for output in shares:
        (root, divisor), seen = shares[output], {output}
        while root in shares and root not in seen:
            seen.add(root)
            root, step = shares[root]
            divisor *= step
        if root in readers and root not in shares:
            roots[output] = (root, divisor)
    return roots


def _string_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    for attribute in node.attribute:
        if attribute.name == name:
            return str(attribute.s.decode())
    return default


def _int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(attribute.i)
    return default


def _float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    for attribute in node.attribute:
        if attribute.name == name:
            return float(attribute.f)
    return default
