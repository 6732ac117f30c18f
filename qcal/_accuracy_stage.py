"""The accuracy stage of a run: sensitivity when asked for, the accuracy floor's check, and the
fallback search towards it (or towards the user's target)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import onnx

from qcal._stages import Progress, _stage_progress, _Timings
from qcal.accuracy.evaluate import Comparison, compare_models
from qcal.accuracy.fallback import (
    Candidate,
    Confirmation,
    FallbackResult,
    Missed,
    rank_blocks,
    rank_candidates,
    search_fallback,
)
from qcal.accuracy.localise import localise_error
from qcal.accuracy.macs import body_macs, compute_macs, shape_probe
from qcal.accuracy.reference import FloatReference
from qcal.accuracy.sensitivity import SensitivityResult, measure_blocks, measure_sensitivity
from qcal.calibration import data as data_mod
from qcal.config import CalibrationConfig
from qcal.graph.files.large import weight_bytes
from qcal.graph.model import InputSpec, QuantPlan
from qcal.graph.qdq import InsertQDQ, QuantizedWeight
from qcal.numerics.errors import DataError, ModelError
from qcal.numerics.onnx_mapping import OnnxQParams


@dataclass(frozen=True)
class _Accuracy:
    sensitivity: SensitivityResult | None
    fallback: FallbackResult | None
    comparison: Comparison | None = None  # the full model's, when the floor held without help


# Samples looked at for the one whose shapes the MACs are counted at.
_SHAPE_SAMPLES = 32


def _compute_macs(
    model: onnx.ModelProto, calib: Any, order: data_mod.ContentOrder,
    inputs: Sequence[InputSpec], config: CalibrationConfig,
) -> tuple[dict[str, int | None], dict[str, int]]:
    """MACs per compute node of the main graph, and per call of those in bodies whose shapes
    inference knows (`body_macs`, when placement weighs sizes), at the shapes of the largest of
    the first few samples in their content's `order` (most input values; the first of equals):
    a decoder step's first sample may hold an empty cache, whose attention products count
    nothing (coverage read 99.8 % where it is 87 % at a cache of 31). Where every input's shape
    is fixed but for the batch axis, the first sample is read alone."""
    varies = any(not isinstance(d, int) for spec in inputs for d in spec.shape[1:])
    candidates = order.positions[:_SHAPE_SAMPLES if varies else 1]
    largest = None
    if candidates:  # kept from the content pass, or read when beyond those
        k = max(range(len(candidates)), key=lambda k: (order.sizes[candidates[k]], -k))
        largest = (order.leading[k] if k < len(order.leading)
                   else next(iter(data_mod.SampleSubset(calib, [candidates[k]]).samples())))
    probe = None if largest is None else shape_probe(
        model, largest, providers=config.providers, threads=config.threads)
    # the bodies' sizes serve placement "auto" alone (`with_product_sizes`)
    bodies = body_macs(model, largest) if config.places_for_speed else {}
    return compute_macs(model, largest, run_shapes=probe), bodies


def _improve_accuracy(
    model: onnx.ModelProto, plan: QuantPlan, quant_model: onnx.ModelProto,
    act_params: Mapping[str, OnnxQParams], weights: Mapping[str, QuantizedWeight], *,
    config: CalibrationConfig, inputs: Any, source: Any, macs: Mapping[str, int | None],
    evaluate: Callable[..., Comparison], timings: _Timings, progress: Progress | None,
    declared_shapes: frozenset[str], confirm: Confirmation | None = None,
) -> _Accuracy:
    """Per-tensor sensitivity when asked for, and the fallback search towards the user's target
    or, by default, the accuracy floor. The target is checked on the full model first (with
    `--sensitivity` too); only when it fails is the error localised, unless measured per
    tensor, and searched: by blocks of tensors measured against the outputs
    (`measure_blocks`), then, where that falls short or cannot be measured, by the error jumps
    of two passes (`qcal.accuracy.localise`). `confirm`: the second check a model that met
    the target must pass (on the calibration samples), before the search and in it."""
    sensitivity = None
    first_samples = _first_by_content(source)
    if config.sensitivity:
        with timings.stage("sensitivity"):
            count, screen = _sensitivity_samples(config, plan, source)
            # One sample per run here and in the localisation: the batch check ran the float
            # model, not these models with their tensors exposed, which joined samples can
            # change in the last bits (and the fallback's ranking with them).
            sensitivity = measure_sensitivity(
                model, plan, act_params, weights,
                data_mod.iter_batches(first_samples(count), inputs, 1),
                screen_samples=screen, refine_runs=_REFINE_RUNS, providers=config.providers,
                on_batch=_stage_progress(progress, "sensitivity", count),
            )
    if not config.fallback and not config.has_fallback_target:
        return _Accuracy(sensitivity, None)
    target = config.accuracy_target()  # the user's, else the floor: checked and met alike
    with timings.stage("evaluate"):
        planned = (quant_model, evaluate(quant_model))  # written and evaluated
    planned_missed = None
    if target.is_met(planned[1]):
        planned_missed = None if confirm is None else confirm(*planned)
        if planned_missed is None:
            return _Accuracy(sensitivity, None, planned[1])
    floor = max(config.min_coverage, config.fail_if_coverage_below or 0.0) / 100.0

    def confirm_once(quantized: onnx.ModelProto, comparison: Comparison) -> Missed | None:
        """`confirm`, the model as planned confirmed once (above)."""
        assert confirm is not None
        return planned_missed if quantized is planned[0] else confirm(quantized, comparison)

    def search(candidates: list[Candidate]) -> FallbackResult:
        return search_fallback(
            model=model, plan=plan, candidates=candidates, macs=macs, target=target,
            floor=floor,
            write=lambda restricted: InsertQDQ(
                restricted, act_params, weights, declared_shapes=declared_shapes)(model).model,
            evaluate=lambda quantized: evaluate(quantized, "fallback"), planned=planned,
            confirm=None if confirm is None else confirm_once,
        )

    by_blocks = None
    if sensitivity is None and weight_bytes(model) <= _BLOCK_WEIGHT_BYTES:
        # What the tensors do to the outputs, measured in blocks, ranks them first: the error
        # jumps see where error appears, not what it does later, and fell short of the floor
        # where blocks reached it (PP-OCRv4 rec, the layout detector); a run the blocks bring
        # to the floor never localises by jumps at all.
        with timings.stage("localise blocks"):
            feeds = [feed for feed, _ in data_mod.iter_batches(
                first_samples(_BLOCK_SAMPLES), inputs, 1)]
            try:
                blocks = measure_blocks(model, plan, act_params, weights, feeds,
                                        providers=config.providers)
            except (ModelError, DataError):  # a form the switch model cannot take (per-axis
                blocks = ()                  # activations): the jumps rank alone
            samples = len(feeds)
            del feeds
        candidates = rank_blocks(model, plan, blocks, macs, samples)
        if candidates:
            with timings.stage("fallback"):
                by_blocks = search(candidates)
            if by_blocks.reached and by_blocks.confirmed:
                return _Accuracy(None, replace(
                    by_blocks, message=f"{by_blocks.message} ({_BLOCKS})"))
    if sensitivity is None:
        with timings.stage("localise"):
            sensitivity = localise_error(
                model, quant_model, plan,
                data_mod.iter_batches(first_samples(_LOCALISE_SAMPLES), inputs, 1),
                providers=config.providers,
            )
    with timings.stage("fallback"):
        fallback = search(rank_candidates(model, plan, sensitivity, macs))
    if by_blocks is not None:
        fallback = _after_both(by_blocks, fallback)
    return _Accuracy(sensitivity, fallback)


# At most this many calibration samples check the target the held-out ones met: of more, the
# first this many by content, their float outputs computed again (the collection keeps them
# for no more), so a large calibration set costs no quantized run over all of it.
_CONFIRM_SAMPLES = 768


def _confirmation(
    model: onnx.ModelProto, calib: Any, inputs: Any, config: CalibrationConfig,
    reference: FloatReference | None, progress: Progress | None, timings: _Timings,
) -> Confirmation:
    """The second check of a model the held-out samples accepted, with their comparison: the
    target checked on the calibration samples `calib` (their float outputs kept from the
    collection in `reference`, or computed again), what they show missed
    (`AccuracyTarget.clearly_missed`, `Missed`) or None; timed as the "confirm" stage (within
    the fallback's, for the sets it checks). A quarter held out is often a dozen samples, and
    the fallback stops at the first model they accept."""
    target = config.accuracy_target()

    def confirm(quant_model: onnx.ModelProto, held_out: Comparison) -> Missed | None:
        with timings.stage("confirm"):
            comparison = compare_models(
                model, quant_model, data_mod.iter_batches(calib, inputs, config.batch_size),
                providers=config.providers, reference=reference,
                on_batch=_stage_progress(progress, "confirm", calib.num_samples()))
        missed = target.clearly_missed(comparison, held_out)
        return None if missed is None else Missed(calib.num_samples(), missed,
                                                  target.tells_apart(comparison, held_out))
    return confirm


def _confirm_samples(calib: Any, all_calib: Any, order: data_mod.ContentOrder) -> Any:
    """The calibration samples `calib` (of `all_calib`, the held-out ones first in `order`)
    that `_confirmation` checks: all of them, or past _CONFIRM_SAMPLES the first of
    them by content."""
    if calib.num_samples() <= _CONFIRM_SAMPLES:
        return calib
    held = len(order.positions) - calib.num_samples()
    return data_mod.SampleSubset(all_calib,
                                 sorted(order.positions[held:held + _CONFIRM_SAMPLES]))


def _standing(result: FallbackResult) -> tuple[bool, bool]:
    """How good a search's result is: the target met and confirmed, then met."""
    return result.reached and result.confirmed, result.reached


_BLOCKS = "ranked by their measured effect on the outputs, in blocks"
_JUMPS = "ranked by where their error jumps"


def _after_both(blocks: FallbackResult, jumps: FallbackResult) -> FallbackResult:
    """The second search's (by the error jumps) result if it stands as well as the first's (by
    blocks: `_standing`), else the first's; the steps of both, in order (their first step,
    the model as planned, is listed once)."""
    chosen = jumps if _standing(jumps) >= _standing(blocks) else blocks
    steps = (*blocks.steps, *(s for s in jumps.steps if s.kept))
    message = (f"{jumps.message} ({_JUMPS}; {_BLOCKS}, they fell short)"
               if chosen is jumps and jumps.reached
               else f"{blocks.message} ({_BLOCKS}; {_JUMPS}, they fell short)" if blocks.reached
               else f"{blocks.message} ({_BLOCKS}, then {_JUMPS}: neither reached it)")
    return replace(chosen, steps=steps, message=message)


def _first_by_content(source: Any) -> Callable[[int], Any]:
    """A function of `count` giving the first `count` samples of `source` in their content's
    order (`data.content_order`, read once when first asked for): the same samples whatever
    order the data comes in, and spread over it as a random choice is (its first samples may
    all be alike: a recording that starts in silence)."""
    order: list[int] | None = None

    def first(count: int) -> Any:
        nonlocal order
        if order is None:
            order = data_mod.content_order(source).positions
        return data_mod.SampleSubset(source, order[:count])

    return first


_LOCALISE_SAMPLES = 4  # samples the two localisation passes run on (every tensor exposed)
# Samples each block of tensors is measured on (`qcal.accuracy.sensitivity.measure_blocks`:
# about 100 runs per sample): on PP-OCRv4 rec, two reached the floor with as few tensors kept
# float as four (19-20), in half the runs.
_BLOCK_SAMPLES = 2
# Blocks are measured on models of at most this many bytes of weights: the switch model holds
# every weight twice (float and dequantized codes), and onnxruntime copies both.
_BLOCK_WEIGHT_BYTES = 256 << 20


# Sensitivity runs the model once per tensor and sample. Every tensor is screened on a few
# samples (as many of 4 as keep that under 256 runs, at least 1); those that matter
# (`qcal.accuracy.sensitivity.SCREEN_FRACTION`, typically a few dozen) are measured on all the
# sensitivity samples, 16 by default, within 1024 more runs: the figures the fallback ranks by
# rest on many samples, and a model of hundreds of tensors costs at most its tensor count plus
# 1024 runs instead of tensors x samples.
_SENSITIVITY_SAMPLES = 16
_SCREEN_SAMPLES = 4
_SCREEN_RUNS = 256
_REFINE_RUNS = 1024


def _sensitivity_samples(
    config: CalibrationConfig, plan: QuantPlan, source: Any
) -> tuple[int, int]:
    """(samples for the relevant tensors, screening samples for every tensor)."""
    units = len({a.tensor for a in plan.activations if a.consumers})
    units += len({w.tensor for w in plan.weights})
    wanted = config.sensitivity_samples or _SENSITIVITY_SAMPLES
    available = source.num_samples()
    total = min(wanted, available) if available else wanted
    screen = max(1, min(_SCREEN_SAMPLES, _SCREEN_RUNS // max(units, 1)))
    return total, min(total, screen)
