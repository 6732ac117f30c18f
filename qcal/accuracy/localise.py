"""Where the quantized model's error comes from, in two passes instead of one per tensor.

The float model and the quantized model run side by side on a few samples with every planned
activation of the main graph exposed as an output. Both models compute these tensors (the Q/DQ
writer keeps each producer's output and sends its readers through the pair), so their difference
is the error that has reached that point: `r_t = Σ(q - f)² / Σf²` per tensor. A quantized node
whose output carries much more error than its inputs is where error jumps: its quantized inputs
and weights (what it reads through Q/DQ) take the jump as their harm. Measured on data, this
finds the tensors whose error is amplified downstream (denominators, exp and pow inputs,
differences of nearly equal quantities) however an exporter spells them, at the cost of two
passes. The fallback then confirms on the real QDQ model, as with per-tensor sensitivity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from qcal.accuracy.evaluate import COMPARE_THREADS
from qcal.accuracy.sensitivity import SensitivityResult, TensorSensitivity
from qcal.calibration.runtime import create_session
from qcal.graph.model import QuantPlan
from qcal.graph.placement import FUSED_ACTIVATIONS
from qcal.graph.structure import UseIndex, exposing

__all__ = ["localise_error"]

Feed = Mapping[str, np.ndarray]


def localise_error(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    plan: QuantPlan,
    batches: Iterable[tuple[Feed, int]],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> SensitivityResult:
    """Each planned tensor's harm as the error jump at the nodes that read it quantized (module
    docstring), as a `SensitivityResult` the fallback ranks by (`noise_ratio` is the jump)."""
    produced = {v for n in float_model.graph.node for v in n.output if v}
    quant_produced = {v for n in quant_model.graph.node for v in n.output if v}
    outputs = [o.name for o in float_model.graph.output]
    watched = sorted(({a.tensor for a in plan.activations} & produced & quant_produced)
                     - set(outputs)) + outputs
    ratios, samples = _error_ratios(float_model, quant_model, watched, batches, providers)

    harm: dict[str, float] = {}
    inputs_of = {n.name: [v for v in n.input if v] for n in float_model.graph.node}
    outputs_of = {n.name: [v for v in n.output if v] for n in float_model.graph.node}
    quantized = [d.node for d in plan.nodes if d.quantized and d.node in inputs_of]
    reads: dict[str, set[str]] = {}
    for target in plan.activations:
        for consumer in target.consumers:
            reads.setdefault(consumer, set()).add(target.tensor)
    for weight in plan.weights:
        reads.setdefault(weight.node, set()).add(weight.tensor)
    # A Conv whose Relu/Clip onnxruntime fuses writes a float tensor, not watched: its error
    # is read where that activation writes (the activation adds none of its own).
    through = _through_fused_activations(float_model.graph, set(ratios))
    for node in quantized:
        after = max((ratios.get(through.get(v, v), 0.0) for v in outputs_of[node]), default=0.0)
        before = max((ratios.get(v, 0.0) for v in inputs_of[node]), default=0.0)
        jump = max(0.0, after - before)
        for tensor in reads.get(node, ()):
            harm[tensor] = max(harm.get(tensor, 0.0), jump)
    roles = {a.tensor: "activation" for a in plan.activations}
    roles.update({w.tensor: "weight" for w in plan.weights})
    found = [
        TensorSensitivity(tensor, roles.get(tensor, "activation"), None, value, None, None,
                          samples=samples)
        for tensor, value in harm.items()
    ]
    found.sort(key=lambda s: (-s.harm, s.tensor))
    return SensitivityResult(samples, tuple(found), method="error-jump")


def _through_fused_activations(graph: onnx.GraphProto, watched: set[str]) -> dict[str, str]:
    """Unwatched tensor -> the watched output of the Relu/Clip that alone reads it (through a
    chain of them)."""
    index = UseIndex.build(graph)
    found: dict[str, str] = {}
    for value in (v for node in graph.node for v in node.output if v and v not in watched):
        end, _ = index.follow(value, FUSED_ACTIVATIONS, until=watched)
        if end in watched:
            found[value] = end
    return found


def _error_ratios(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, names: list[str],
    batches: Iterable[tuple[Feed, int]], providers: tuple[str, ...],
) -> tuple[dict[str, float], int]:
    """Tensor -> noise energy over signal energy of the quantized model's value, over the
    elements both compute finite; and the number of samples."""
    float_session = create_session(exposing(float_model, names), providers=providers,
                                   threads=COMPARE_THREADS, what="float model")
    quant_session = create_session(exposing(quant_model, names), providers=providers,
                                   threads=COMPARE_THREADS, what="quantized model")
    signal = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    samples = 0
    for feed, n in batches:
        floats = float_session.run(names, dict(feed))
        quants = quant_session.run(names, dict(feed))
        for name, f, q in zip(names, floats, quants):
            f64 = np.asarray(f, dtype=np.float64).ravel()
            q64 = np.asarray(q, dtype=np.float64).ravel()
            if f64.shape != q64.shape:
                continue
            both = np.isfinite(f64) & np.isfinite(q64)
            f64, q64 = f64[both], q64[both]
            signal[name] += float(f64 @ f64)
            noise[name] += float((q64 - f64) @ (q64 - f64))
        samples += n
    ratios = {name: noise[name] / signal[name] if signal[name] > 0 else 0.0 for name in names}
    return ratios, samples
