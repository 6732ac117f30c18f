"""The quantization plan: per-operator rules and the user's selection decide, for every node,
whether it is quantized and which tensors get Q/DQ. Public through `qcal.model`."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import onnx

from qcal.errors import ConfigError, ModelError
from qcal.passes._graph import (
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    UseIndex,
    attribute_graphs,
    element_types,
)

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
    "Add": OpRule("both inputs (constants per tensor) and the output", inputs=(0, 1)),
    "Mul": OpRule("both inputs (constants per tensor) and the output", inputs=(0, 1)),
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
between a Conv, Gemm or MatMul and a Relu or Clip (constant bounds) that is its only reader is
left float: onnxruntime fuses the activation into the integer kernel, and the Relu/Clip output
is quantized instead. Constants at quantized inputs are stored pre-quantized as weights.
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
    """

    op_types: frozenset[str] | None = None
    exclude_op_types: frozenset[str] = frozenset()
    exclude_nodes: tuple[str, ...] = ()
    exclude_tensors: frozenset[str] = frozenset()
    per_channel: bool = True


@dataclass(frozen=True)
class ActivationTarget:
    """An activation to observe and quantize once.

    Attributes:
        tensor: its name.
        consumers: names of the quantized nodes that read it through the DQ (sorted).
    """

    tensor: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class WeightTarget:
    """A constant (initializer) read by a quantized node, stored pre-quantized.

    Attributes:
        tensor: the initializer's name.
        node: the quantized node reading it.
        op_type: that node's op type.
        axis: channel axis for per-channel quantization, None for per-tensor.
    """

    tensor: str
    node: str
    op_type: str
    axis: int | None


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
    If/Loop/Scan bodies are skipped for now, with that reason.

    Raises:
        ConfigError: an op type in `rules.op_types` has no rule, or a tensor in
            `rules.exclude_tensors` is not in the model.
        ModelError: a node has no name or a repeated one, or the model is already quantized.
    """
    _check_selection(model, rules)
    return _Planner(model.graph, rules).plan()


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
    notes: list[str] = field(default_factory=list)  # what the user should know

    def is_empty(self) -> bool:
        return not (self.inputs or self.outputs or self.weights)

    def empty_reason(self) -> str:
        if self.notes:
            return "nothing to quantize: " + "; ".join(self.notes)
        return "no float tensor to quantize"


class _Planner:
    """One planning run over the main graph (indexes built once)."""

    def __init__(self, graph: onnx.GraphProto, rules: SelectionRules) -> None:
        self._graph = graph
        self._rules = rules
        self._index = UseIndex.build(graph)
        self._types = element_types(graph)
        self._selected: dict[str, OpRule] = {}
        self._skips: dict[str, str] = {}
        for node in graph.node:
            rule, reason = self._select(node)
            if rule is not None:
                self._selected[node.name] = rule
            else:
                self._skips[node.name] = reason
        self._fused = self._fused_tensors()

    def plan(self) -> QuantPlan:
        readers: dict[str, set[str]] = {}
        weights: dict[str, list[tuple[str, str, int | None]]] = {}
        biases: list[BiasTarget] = []
        decisions: list[NodeDecision] = []
        for node, container in _walk_nodes(self._graph, None):
            if container is not None:
                reason = f"inside {container}: subgraphs are not quantized yet"
                decisions.append(NodeDecision(node.name, node.op_type, False, reason))
                continue
            rule = self._selected.get(node.name)
            targets = self._targets(node, rule) if rule is not None else self._skips[node.name]
            if isinstance(targets, str) or targets.is_empty():
                reason = targets if isinstance(targets, str) else targets.empty_reason()
                decisions.append(NodeDecision(node.name, node.op_type, False, reason))
                continue
            assert rule is not None
            for tensor in targets.inputs:
                readers.setdefault(tensor, set()).add(node.name)
            for tensor in targets.outputs:
                readers.setdefault(tensor, set())
            for tensor, axis in targets.weights:
                weights.setdefault(tensor, []).append((node.name, node.op_type, axis))
            bias = self._bias(node, rule, targets)
            if bias is not None:
                biases.append(bias)
            reason = "; ".join([f"{node.op_type} rule: {rule.summary}", *targets.notes])
            decisions.append(NodeDecision(node.name, node.op_type, True, reason))
        return QuantPlan(
            activations=tuple(
                ActivationTarget(t, tuple(sorted(readers[t]))) for t in sorted(readers)
            ),
            weights=_weight_targets(weights),
            biases=tuple(sorted(biases, key=lambda b: (b.tensor, b.node))),
            nodes=tuple(decisions),
        )

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
                and all(not v or self._index.constant(v) is not None for v in activation.input[1:])
            ):
                fused[tensor] = (node.name, activation.name)
        return fused

    def _quantizable(self, tensor: str) -> bool:
        return tensor not in self._rules.exclude_tensors and self._types.get(tensor) in FLOAT_TYPES

    def _targets(self, node: onnx.NodeProto, rule: OpRule) -> _NodeTargets | str:
        """What `node` quantizes under `rule`, or why it cannot be quantized."""
        found = _NodeTargets()
        main = node.input[0] if node.input else ""
        if rule.weight is not None and main and self._types.get(main) not in FLOAT_TYPES:
            return f"input {main!r} is {self._type_name(main)}, not float"
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
        if tensor in self._fused:
            found.notes.append(
                f"input {tensor!r} left float: onnxruntime fuses this "
                f"{node.op_type} into {self._fused[tensor][0]!r}"
            )
            return
        if not self._accepts(tensor, found):
            return
        constant = self._index.constant(tensor)
        if constant is None:
            found.inputs.append(tensor)
            return
        axis = None
        if slot == rule.weight and rule.weight_axis is not None and self._rules.per_channel:
            axis = rule.weight_axis(node, len(constant.dims))
        found.weights.append((tensor, axis))

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
        constant = self._index.constant(bias)
        weight_constant = self._index.constant(weight)
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
) -> tuple[WeightTarget, ...]:
    """One target per (weight, reading node); a weight read on different axes goes per tensor."""
    targets = []
    for tensor in sorted(found):
        uses = found[tensor]
        shared_axis = uses[0][2] if len({axis for _, _, axis in uses}) == 1 else None
        targets += [WeightTarget(tensor, node, op_type, shared_axis) for node, op_type, _ in uses]
    return tuple(sorted(targets, key=lambda t: (t.tensor, t.node)))


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
