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

_NO_KERNEL = ("given a float input, onnxruntime has no integer kernel for it and would "
              "dequantize the weight at every run")
_FLOAT_INPUT = {"MatMul": "a float input would be quantized on the fly by onnxruntime's "
                          "MatMulNBits"}


def restrict_plan(
    plan: QuantPlan, keep_float: Mapping[str, str], writers: Mapping[str, str]
) -> QuantPlan:
    """`plan` without the tensors in `keep_float` (name -> reason), and what depends on them.

    `writers` maps a tensor to the Conv/ConvTranspose whose integer kernel writes it
    (`qcal.graph.placement.integer_output_writers`). Such a node whose output is kept float has
    no integer kernel in onnxruntime: given dequantized inputs and no QuantizeLinear after it,
    it runs in float on a weight dequantized at every run. So it goes float whole: its weight
    is kept float, and it reads its input through the DequantizeLinear only where another node
    quantizes that input anyway (with no QuantizeLinear after it, onnxruntime leaves a float
    weight float).

    A weight kept float takes the activations its node reads with it: given a quantized input
    and a float weight, onnxruntime quantizes the weight itself (its WeightBiasQuantization
    optimizer, per tensor), and a float input is only float for every reader (the QDQ writer
    sends float readers of an integer kernel's output through the pair). Conversely, an
    activation kept float takes the constant weights of the nodes reading it: given a float
    input, onnxruntime has no integer kernel for a Conv or Gemm and runs it in float on a weight
    dequantized at every run (a streaming model's STFT Conv, its input kept float, ran 1.14x
    float with its basis dequantized per chunk), and it fuses a MatMul of a dequantized constant
    weight into MatMulNBits, which quantizes the input on the fly (per block, its own error), so
    the input would not be float at all.
    Biases whose input or weight goes float stay float. A node left with nothing to quantize is
    marked not quantized with the reason; a node that still quantizes something gets the reason
    appended.
    """
    if not keep_float:
        return plan
    keep = dict(keep_float)
    weights_of: dict[str, list[str]] = {}
    for w in plan.weights:
        weights_of.setdefault(w.node, []).append(w.tensor)
    ops = {d.node: d.op_type for d in plan.nodes}
    float_output: set[str] = set()  # Convs whose output is kept float: float whole
    while True:  # each rule may feed the other (a weight's input read by another MatMul)
        before = len(keep)
        for tensor in list(keep):
            node = writers.get(tensor)
            if node is None or node in float_output:
                continue
            float_output.add(node)
            for weight in weights_of.get(node, ()):
                keep.setdefault(weight, f"kept float with output {tensor!r} of {node!r} (without "
                                        "a QuantizeLinear after it, onnxruntime has no integer "
                                        "kernel for it and would dequantize the weight at "
                                        "every run)")
        for a in plan.activations:
            if a.tensor not in keep:
                continue
            for consumer in a.consumers:
                for weight in weights_of.get(consumer, ()):
                    op = ops.get(consumer, "")
                    keep.setdefault(weight, f"kept float with input {a.tensor!r} of {op} "
                                            f"{consumer!r} ({_FLOAT_INPUT.get(op, _NO_KERNEL)})")
        float_nodes = {w.node: w.tensor for w in plan.weights if w.tensor in keep}
        for a in plan.activations:
            node = next((c for c in a.consumers
                         if c in float_nodes and c not in float_output), None)
            if node is not None and a.tensor not in keep:
                keep[a.tensor] = f"kept float with weight {float_nodes[node]!r} of {node!r}"
        if len(keep) == before:
            break
    activations = []
    for a in plan.activations:
        consumers = tuple(c for c in a.consumers if c not in float_output)
        if a.tensor in keep:
            continue
        if a.consumers and not consumers and a.tensor not in writers:
            # read quantized only by a Conv now float, and no integer kernel writes it
            keep[a.tensor] = f"kept float with {a.consumers[0]!r}, its only quantized reader"
            continue
        activations.append(dataclasses.replace(a, consumers=consumers))
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
    return QuantPlan(tuple(activations), weights, biases, tuple(nodes), plan.integer_forms)
