"""What the planner collects and how it becomes the plan's targets: per node (`_NodeTargets`),
over the graphs (`_Found`), weights one per (tensor, node) with a shared axis, and activations
that take another's parameters (outputs of `SAME_SCALE_OPS` and of a Div by a constant)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx

from qcal.graph.plan._rules import SAME_SCALE_OPS
from qcal.graph.plan._types import BiasTarget, NodeDecision, WeightTarget
from qcal.graph.structure import DEFAULT_DOMAINS, string_attribute


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
    integer_forms: set[str] = field(default_factory=set)  # `QuantPlan.integer_forms`


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
    if node.op_type == "Resize" and string_attribute(node, "mode", "nearest") == "cubic":
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
