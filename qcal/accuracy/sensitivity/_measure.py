"""Per-tensor sensitivity: how much the model outputs move when one tensor alone is quantized.

One onnxruntime session runs a "switch model": the float model in which every planned tensor
``t`` also has its fake-quantized copy ``fq(t)`` (the same Q/DQ arithmetic as the written model:
optional Clip, QuantizeLinear, DequantizeLinear; weights as their dequantized codes) and a
``If(units[k], fq(t), t)`` that the tensor's quantized consumers read. Feeding no flag set
gives the float model exactly; flag k alone quantizes tensor k alone. For every batch the float
outputs are computed once and then every unit is run, so only per-unit sums are kept, never
activations of more than one batch.

Screening (``screen_samples``): that is one model run per tensor and sample, the whole cost of
sensitivity. Most tensors of a real model barely move the outputs, and their exact figure does
not change any decision (the fallback ranks by harm, largest first). So every tensor is measured
on the first ``screen_samples`` samples only; the tensors whose harm there is at least
``screen_fraction`` of the worst tensor's (and not negligible, below -60 dB) are measured on the
remaining samples too, with a switch model rebuilt for them alone (fewer ``If`` nodes, so each
run costs about one float inference), until ``refine_runs`` runs are spent (a model whose harm
is spread over many tensors measures them on fewer samples instead of costing more). Each
tensor's ``samples`` says what it was measured on. Local SQNR is always measured on every sample
(one run per batch for all tensors together).

Per tensor, with x the float outputs and y the outputs with only that tensor quantized:

* output SQNR = ``10 log10(sum x^2 / sum (x - y)^2)`` per model output, the worst output kept;
  ``noise_ratio`` is its linear form ``sum (x - y)^2 / sum x^2`` (the harm, additive to first
  order over tensors whose errors are independent);
* top-1 agreement of classifier-like outputs (`qcal.accuracy.evaluate`), the worst kept;
* local SQNR = ``10 log10(sum t^2 / sum (t - fq(t))^2)`` over the tensor itself;
* for outputs computed by Softmax or LogSoftmax (through reshapes), the same noise ratio over
  the logits the softmax reads (``logit_noise_ratio``), and that is the tensor's ``harm``.
  Probabilities are a poor yardstick for ranking: a small perturbation moves them only where
  two classes are close, so their noise is a handful of argmax flips, which a few samples
  estimate badly and which do not add up over tensors; the logits move smoothly with the
  perturbation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx

from qcal.accuracy.evaluate import COMPARE_THREADS
from qcal.accuracy.sensitivity._models import _Models, switch_flags
from qcal.accuracy.sensitivity._results import SensitivityResult, _OutputNoise
from qcal.calibration.runtime import Feed, create_session
from qcal.graph.model import QuantPlan
from qcal.graph.qdq import QuantizedWeight
from qcal.numerics.errors import DataError
from qcal.numerics.onnx_mapping import OnnxQParams
from qcal.numerics.sums import inner_product

__all__ = ["SCREEN_FRACTION", "measure_sensitivity"]

logger = logging.getLogger(__name__)


# Screening keeps measuring a tensor when its harm is at least this share of the worst tensor's
# (1 %: 20 dB below it; the fallback ranks by harm, so the order below that changes nothing it
# could reach) and above -60 dB (a millionth of the output energy: harmless whatever the rest).
SCREEN_FRACTION = 0.01
_NEGLIGIBLE = 1e-6


def measure_sensitivity(
    model: onnx.ModelProto,
    plan: QuantPlan,
    activations: Mapping[str, OnnxQParams],
    weights: Mapping[str, QuantizedWeight],
    batches: Iterable[tuple[Feed, int]],
    *,
    screen_samples: int | None = None,
    screen_fraction: float = SCREEN_FRACTION,
    refine_runs: int | None = None,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    on_batch: Callable[[int], None] | None = None,
) -> SensitivityResult:
    """Quantize each planned tensor of `model` alone and measure the outputs (module docstring).

    Args:
        model: the prepared float model the plan was made for.
        plan: its quantization plan; every activation and weight target is measured.
        activations: ONNX parameters per planned activation (as given to InsertQDQ).
        weights: codes and parameters per planned weight (as given to InsertQDQ).
        batches: evaluation batches (feed, samples in it), streamed once.
        screen_samples: measure every tensor on this many samples only (at least; whole
            batches), the relevant ones on all (module docstring); None: every tensor on all.
        screen_fraction: relevance threshold of screening, a fraction of the worst harm.
        refine_runs: after screening, at most about this many runs (whole batches) for the
            relevant tensors; None: all samples.
        providers: onnxruntime's execution providers (on COMPARE_THREADS threads).
        on_batch: called with the number of samples after each batch.

    Raises:
        DataError: no batch, or onnxruntime failed on one.
        ModelError: onnxruntime cannot load the switch model.
    """
    models = _Models.build(model, plan, activations, weights)
    outputs = models.outputs
    if not outputs:  # nothing to compare: no tensor measurably changes the outputs
        return SensitivityResult(0, ())
    probe_model, probe_outputs = models.probe_model()
    probe = create_session(probe_model, providers=providers, threads=COMPARE_THREADS,
                           what="sensitivity probe model")
    del probe_model
    switch: object | None = create_session(models.switch, providers=providers,
                                           threads=COMPARE_THREADS, what="sensitivity model")
    selector = models.selector
    probes = [name for pair in probe_outputs.values() for name in pair]
    units = models.units
    noise = {u: models.empty_noise() for u, _ in units}
    local = {u: [0.0, 0.0] for u, _ in units}
    measured = {u: 0 for u, _ in units}
    active = list(range(len(units)))  # unit indices still run; position = selector flag
    refine_until: int | None = None  # samples after which the relevant tensors stop
    samples, mask_measured = 0, False
    for feed, n in batches:
        values = _run(probe, outputs + probes, feed)
        reference = values[: len(outputs)]
        if not mask_measured:
            mask_measured, models = models.measured(feed, probe, reference)
        valid = models.positions(feed)
        probed = dict(zip(probes, values[len(outputs):]))
        del values
        for tensor, (plain, faked) in probe_outputs.items():
            x = probed[plain].astype(np.float64, copy=False).ravel()
            d = x - probed[faked].astype(np.float64, copy=False).ravel()
            local[tensor][0] += inner_product(x, x)
            local[tensor][1] += inner_product(d, d)
        del probed
        for k, unit in enumerate(active):
            tensor = units[unit][0]
            flags = switch_flags(len(active), [k])
            quantized = _run(switch, outputs, {**feed, selector: flags})
            noise[tensor].add(reference, quantized, valid)
            measured[tensor] += n
        samples += n
        if on_batch is not None:
            on_batch(n)
        if refine_until is not None and samples >= refine_until and active:
            logger.info("sensitivity: refinement budget spent after %d samples", samples)
            active, switch = [], None
        if screen_samples is not None and samples >= screen_samples and len(active) == len(units):
            relevant = _relevant(units, noise, screen_fraction)
            if refine_runs is not None:
                refine_until = samples + refine_runs // max(len(relevant), 1)
            if len(relevant) < len(active):
                logger.info("sensitivity: %d of %d tensors relevant after %d samples",
                            len(relevant), len(units), samples)
                active, switch = relevant, None  # release the large session first
                if active:
                    rebuilt, selector = models.switch_for(active)
                    switch = create_session(rebuilt, providers=providers, threads=COMPARE_THREADS,
                                            what="sensitivity model")
            screen_samples = None
    if samples == 0:
        raise DataError("sensitivity data has no samples")
    found = [
        noise[tensor].result(tensor, role, local[tensor][0], local[tensor][1], measured[tensor])
        for tensor, role in units
    ]
    found.sort(key=lambda s: (-s.harm, -s.noise_ratio, s.tensor))
    return SensitivityResult(samples, tuple(found))


def _relevant(units: tuple[tuple[str, str], ...], noise: Mapping[str, _OutputNoise],
              fraction: float) -> list[int]:
    """Indices of the units whose harm so far passes the screening thresholds."""
    harms = [noise[tensor].harm() for tensor, _ in units]
    worst = max(harms, default=0.0)
    bar = max(fraction * worst, _NEGLIGIBLE)
    return [k for k, harm in enumerate(harms) if harm > 0.0 and harm >= bar]


def _run(session: object, names: list[str], feed: Feed) -> list[np.ndarray]:
    try:
        return session.run(names, dict(feed))  # type: ignore[attr-defined, no-any-return]
    except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"onnxruntime failed on a sensitivity batch: {message}") from None
