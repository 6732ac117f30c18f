"""A plan with some tensors kept float, and everything that has to go float with them.

Shared by the accuracy fallback (`qcal.accuracy.fallback`) and the onnxruntime check
(`qcal.accuracy.runnable`): both keep tensors float and need the rest of the plan to stay
consistent with what onnxruntime will do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qcal.graph.model import NodeDecision, QuantPlan

__all__ = ["restrict_plan"]


def restrict_plan(plan: QuantPlan, keep_float: Mapping[str, str]) -> QuantPlan:
    """`plan` without the tensors in `keep_float` (name -> reason), and what depends on them.

    A weight kept float takes the activations its node reads with it: given a quantized input
    and a float weight, onnxruntime quantizes the weight itself (its WeightBiasQuantization
    optimizer, per tensor), and a float input is only float for every reader (the QDQ writer
    sends float readers of an integer kernel's output through the pair). Conversely, an
    activation kept float takes the constant weight of a MatMul reading it: given a float input
    and a dequantized constant weight, onnxruntime fuses them into MatMulNBits, which quantizes
    the input on the fly (per block, its own error), so the input would not be float at all.
    Biases whose input or weight goes float stay float. A node left with nothing to quantize is
    marked not quantized with the reason; a node that still quantizes something gets the reason
    appended.
    """
    if not keep_float:
        return plan
    keep = dict(keep_float)
    matmul_weights: dict[str, list[str]] = {}
    ops = {d.node: d.op_type for d in plan.nodes}
    for w in plan.weights:
        if ops.get(w.node) == "MatMul":
            matmul_weights.setdefault(w.node, []).append(w.tensor)
    while True:  # each rule may feed the other (a weight's input read by another MatMul)
        before = len(keep)
        for a in plan.activations:
            if a.tensor not in keep:
                continue
            for consumer in a.consumers:
                for weight in matmul_weights.get(consumer, ()):
                    keep.setdefault(weight, f"kept float with input {a.tensor!r} of MatMul "
                                            f"{consumer!r} (a float input would be quantized "
                                            "on the fly by onnxruntime's MatMulNBits)")
        float_nodes = {w.node: w.tensor for w in plan.weights if w.tensor in keep}
        for a in plan.activations:
            node = next((c for c in a.consumers if c in float_nodes), None)
            if node is not None and a.tensor not in keep:
                keep[a.tensor] = f"kept float with weight {float_nodes[node]!r} of {node!r}"
        if len(keep) == before:
            break
    activations = tuple(a for a in plan.activations if a.tensor not in keep)
    weights = tuple(w for w in plan.weights if w.tensor not in keep and w.node not in float_nodes)
    reads = {(a.tensor, c) for a in activations for c in a.consumers}
    quantized_weights = {(w.tensor, w.node) for w in weights}
    biases = tuple(
        b for b in plan.biases
        if b.tensor not in keep and (b.input_tensor, b.computed_by) in reads
        and (b.weight_tensor, b.computed_by) in quantized_weights
    )
    touched: dict[str, set[str]] = {}
    for a in plan.activations:
        if a.tensor in keep:
            for consumer in a.consumers:
                touched.setdefault(consumer, set()).add(a.tensor)
    for w in plan.weights:
        if w.tensor in keep:
            touched.setdefault(w.node, set()).add(w.tensor)
    still = {c for a in activations for c in a.consumers} | {w.node for w in weights}
    nodes = []
    for decision in plan.nodes:
        tensors = touched.get(decision.node)
        if not decision.quantized or not tensors:
            nodes.append(decision)
            continue
        why = "; ".join(f"{t!r} {keep[t]}" for t in sorted(tensors))
        if decision.node in still:
            nodes.append(dataclasses.replace(decision, reason=f"{decision.reason}; {why}"))
        else:
            nodes.append(NodeDecision(decision.node, decision.op_type, False, why))
    return QuantPlan(activations, weights, biases, tuple(nodes))
