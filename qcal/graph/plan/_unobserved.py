"""A plan narrowed after calibration: what received no values, or values the preset cannot
represent, stays float (`leave_unobserved_float`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx

from qcal.graph.integer_kernels import INTEGER_OUTPUT_ANCHORS
from qcal.graph.plan._types import ActivationTarget, NodeDecision, QuantPlan
from qcal.graph.plan._walk import _CONTROL_FLOW_OPS, _walk_nodes
from qcal.graph.structure import DEFAULT_DOMAINS, attribute_graphs


def leave_unobserved_float(
    model: onnx.ModelProto, plan: QuantPlan, unobserved: Iterable[str],
    unrepresentable: Mapping[str, str] | None = None,
) -> QuantPlan:
    """`plan` without what calibration never saw, which stays float, nor what the
    calibration saw but the preset cannot represent (`unrepresentable`: tensor -> why).

    An activation in `unobserved` received no values (an If branch not taken, a Loop that ran
    no iteration, a tensor empty in every batch): it is not quantized, and its quantized
    readers say so. An If/Loop/Scan body none of whose planned tensors received values never
    ran during calibration: every node in it (nested bodies included) stays float, with that
    reason. An activation in `unrepresentable` is not quantized either, its readers saying why.
    """
    never = set(unobserved)
    why = dict(unrepresentable or {})
    dropped = set(never)  # grows by activations whose every quantized reader stays float
    if not never and not why:
        return plan
    planned = {t.tensor for t in plan.activations}
    idle: dict[str, str] = {}  # node -> why it stays float
    producers: dict[str, str] = {}  # planned activation -> node writing it
    writes_integers: set[str] = set()  # Conv, ConvTranspose: their integer kernels write codes

    def visit(graph: onnx.GraphProto, where: str | None) -> None:
        local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        for node in graph.node:
            local.update(node.output)
            producers.update((v, node.name) for v in node.output if v in planned)
            if node.op_type in INTEGER_OUTPUT_ANCHORS and node.domain in DEFAULT_DOMAINS:
                writes_integers.add(node.name)
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
    dropped.update(why)
    # A Conv whose own output cannot be quantized cannot run in integers at all: onnxruntime
    # would run it in float on dequantized weights, behind a Quantize/Dequantize of its input.
    for tensor, cause in why.items():
        writer = producers.get(tensor)
        if writer in writes_integers and writer not in idle:
            idle[writer] = (f"left float: its integer kernel would write its output {tensor!r} "
                            f"in integers, and {cause}")
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
        b for b in plan.biases if b.computed_by not in idle and b.input_tensor not in dropped
    )
    live: set[str] = {w.node for w in weights}
    live.update(c for t in activations for c in t.consumers)
    live.update(producers[t.tensor] for t in activations if t.tensor in producers)
    notes: dict[str, list[str]] = {}
    for target in plan.activations:
        reason = "it received no values in calibration" if target.tensor in never else (
            why.get(target.tensor))
        if reason is not None:
            for consumer in target.consumers:
                notes.setdefault(consumer, []).append(
                    f"input {target.tensor!r} left float: {reason}")
            if target.tensor in why and target.tensor in producers:
                notes.setdefault(producers[target.tensor], []).append(
                    f"output {target.tensor!r} left float: {reason}")
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
    return QuantPlan(tuple(activations), weights, biases, tuple(decisions), plan.integer_forms)
