"""The accuracy stage of a run: sensitivity when asked for, the accuracy floor's check, and the
fallback search towards it (or towards the user's target)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import onnx

from qcal._inputs import _SampleRange
from qcal._stages import Progress, _stage_progress, _Timings
from qcal.accuracy.coverage import compute_macs, shape_probe
from qcal.accuracy.evaluate import Comparison
from qcal.accuracy.fallback import FallbackResult, rank_candidates, search_fallback
from qcal.accuracy.localise import localise_error
from qcal.accuracy.sensitivity import SensitivityResult, measure_sensitivity
from qcal.calibration import data as data_mod
from qcal.config import CalibrationConfig
from qcal.graph.model import InputSpec, QuantPlan
from qcal.graph.qdq import InsertQDQ, QuantizedWeight
from qcal.numerics.onnx_mapping import OnnxQParams


@dataclass(frozen=True)
class _Accuracy:
    sensitivity: SensitivityResult | None
    fallback: FallbackResult | None
    comparison: Comparison | None = None  # the full model's, when the floor held without help


# Samples looked at for the one whose shapes the MACs are counted at.
_SHAPE_SAMPLES = 32


def _compute_macs(
    model: onnx.ModelProto, calib: Any, inputs: Sequence[InputSpec], config: CalibrationConfig
) -> dict[str, int | None]:
    """MACs per compute node at the shapes of the largest of the first few samples (most input
    values; the first of equals): a decoder step's first sample may hold an empty cache, whose
    attention products count nothing (coverage read 99.8 % where it is 87 % at a cache of 31).
    Where every input's shape is fixed but for the batch axis, the first sample is read alone."""
    varies = any(not isinstance(d, int) for spec in inputs for d in spec.shape[1:])
    largest, most = None, -1
    for sample in islice(calib.samples(), _SHAPE_SAMPLES if varies else 1):
        size = sum(int(np.size(value)) for value in sample.values())
        if size > most:
            largest, most = sample, size
    probe = None if largest is None else shape_probe(
        model, largest, providers=config.providers, threads=config.threads)
    return compute_macs(model, largest, run_shapes=probe)


def _improve_accuracy(
    model: onnx.ModelProto, plan: QuantPlan, quant_model: onnx.ModelProto,
    act_params: Mapping[str, OnnxQParams], weights: Mapping[str, QuantizedWeight], *,
    config: CalibrationConfig, inputs: Any, source: Any, macs: Mapping[str, int | None],
    evaluate: Callable[..., Comparison], timings: _Timings, progress: Progress | None,
    declared_shapes: frozenset[str],
) -> _Accuracy:
    """Per-tensor sensitivity when asked for, and the fallback search towards the user's target
    or, by default, the accuracy floor. The floor is checked on the full model first (with
    `--sensitivity` too); only when it fails is the error localised (two passes,
    `qcal.accuracy.localise`), unless measured per tensor, and searched."""
    sensitivity = None
    if config.wants_sensitivity:
        with timings.stage("sensitivity"):
            count, screen = _sensitivity_samples(config, plan, source)
            # One sample per run here and in the localisation: the batch check ran the float
            # model, not these models with their tensors exposed, which joined samples can
            # change in the last bits (and the fallback's ranking with them).
            sensitivity = measure_sensitivity(
                model, plan, act_params, weights,
                data_mod.iter_batches(_SampleRange(source, 0, count), inputs, 1),
                screen_samples=screen, refine_runs=_REFINE_RUNS, providers=config.providers,
                on_batch=_stage_progress(progress, "sensitivity", count),
            )
        if not config.has_fallback_target and not config.fallback:
            return _Accuracy(sensitivity, None)
    elif not config.fallback:
        return _Accuracy(None, None)
    target = config.accuracy_target()
    if not config.has_fallback_target:  # the default floor, measured sensitivity or not
        with timings.stage("evaluate"):
            comparison = evaluate(quant_model)
        if target.is_met(comparison):
            return _Accuracy(sensitivity, None, comparison)
    if sensitivity is None:
        with timings.stage("localise"):
            # Spread over the data: its first samples may all be alike (a recording that
            # starts in silence).
            available = source.num_samples() or _LOCALISE_SAMPLES
            step = max(1, available // _LOCALISE_SAMPLES)
            spread = _SampleRange(source, 0, min(available, step * _LOCALISE_SAMPLES), step)
            sensitivity = localise_error(
                model, quant_model, plan, data_mod.iter_batches(spread, inputs, 1),
                providers=config.providers,
            )
    floor = max(config.min_coverage, config.fail_if_coverage_below or 0.0) / 100.0
    with timings.stage("fallback"):
        fallback = search_fallback(
            model=model, plan=plan, candidates=rank_candidates(model, plan, sensitivity, macs),
            macs=macs, target=target, floor=floor,
            write=lambda restricted: InsertQDQ(
                restricted, act_params, weights, declared_shapes=declared_shapes)(model).model,
            evaluate=lambda quantized: evaluate(quantized, "fallback"),
        )
    return _Accuracy(sensitivity, fallback)


_LOCALISE_SAMPLES = 4  # samples the two localisation passes run on (every tensor exposed)


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
