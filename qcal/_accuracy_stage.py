"""The accuracy stage of a run: sensitivity when asked for, the accuracy floor's check, and the
fallback search towards it (or towards the user's target); and the quantized model timed
against the user's."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qcal._inputs import _SampleRange
from qcal._stages import Progress, _stage_progress, _Timings
from qcal.accuracy.coverage import compute_macs, shape_probe
from qcal.accuracy.evaluate import COMPARE_THREADS, Comparison
from qcal.accuracy.fallback import FallbackResult, rank_candidates, search_fallback
from qcal.accuracy.gates import GateResult
from qcal.accuracy.latency import SideBySide, time_side_by_side
from qcal.accuracy.localise import localise_error
from qcal.accuracy.sensitivity import SensitivityResult, measure_sensitivity
from qcal.calibration import data as data_mod
from qcal.calibration.runtime import create_session, run_feed
from qcal.config import CalibrationConfig
from qcal.graph.files.load import LoadedModel, load_model
from qcal.graph.model import QuantPlan
from qcal.graph.qdq import InsertQDQ, QuantizedWeight
from qcal.graph.structure import keep_declared_shapes
from qcal.numerics.errors import QcalError
from qcal.numerics.onnx_mapping import OnnxQParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Accuracy:
    sensitivity: SensitivityResult | None
    fallback: FallbackResult | None
    comparison: Comparison | None = None  # the full model's, when the floor held without help


def _compute_macs(
    model: onnx.ModelProto, calib: Any, config: CalibrationConfig
) -> dict[str, int | None]:
    first = next(iter(calib.samples()), None)
    probe = None if first is None else shape_probe(
        model, first, providers=config.providers, threads=config.threads)
    return compute_macs(model, first, run_shapes=probe)


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


# Calibration samples the prepared-model gate runs both float models on, at most.
PREPARED_CHECK_SAMPLES = 4
# The prepared float model computes what the user's does to float32 rounding (folds reorder
# sums; a float16 model widened to float32 computes more precisely): 40 dB is far below what
# any of that costs and far above a preparation that changed the model (a linear Upsample
# converted with half-pixel coordinates: 29 dB).
PREPARED_MIN_SQNR_DB = 40.0


def users_model(model_path: Path) -> onnx.ModelProto | None:
    """The float model as the user gave it, read again (the prepared one replaced it in
    memory), or None where it cannot be read."""
    try:
        return load_model(model_path).model
    except QcalError:
        return None


def prepared_model_drift(
    users: onnx.ModelProto, prepared: onnx.ModelProto,
    feeds: Iterable[Mapping[str, np.ndarray]], config: CalibrationConfig,
) -> GateResult | None:
    """The built-in "prepared-model" gate: the prepared float model, which every figure of the
    run compares the quantized model with, must compute what the user's does on the first
    calibration samples (`feeds`: each output's error energy over their signal energy, summed
    over them, as the evaluation sums: a blank page's detection map holds 1e-7 and its float
    rounding alone, so one such sample says nothing), worst output SQNR at least
    PREPARED_MIN_SQNR_DB. None where onnxruntime cannot run the user's model as it is."""
    sessions = []
    for model, what in ((users, "your float model"), (prepared, "the prepared float model")):
        try:
            session = create_session(model, providers=config.providers,
                                     threads=COMPARE_THREADS, what=what)
        except Exception:  # noqa: BLE001  onnxruntime's own too: the user's may not run
            return None
        sessions.append((session, [o.name for o in session.get_outputs()], what))
    energy: dict[str, list[float]] = {}  # output -> [signal, noise]
    for feed in feeds:
        try:
            theirs_all, ours_all = (run_feed(s, names, feed, what=what)
                                    for s, names, what in sessions)
        except Exception:  # noqa: BLE001  likewise
            return None
        for name, theirs in theirs_all.items():
            ours = ours_all.get(name)
            if not (isinstance(theirs, np.ndarray) and isinstance(ours, np.ndarray)
                    and theirs.dtype.kind == "f" and theirs.shape == ours.shape):
                continue  # sequences and maps, integer outputs: the floor compares them alone
            finite = np.isfinite(theirs) & np.isfinite(ours)
            a, b = theirs[finite].astype(np.float64), ours[finite].astype(np.float64)
            sums = energy.setdefault(name, [0.0, 0.0])
            sums[0] += float(a @ a)
            sums[1] += float((a - b) @ (a - b))
    worst = min((10 * math.log10(max(signal, 1e-300) / noise)
                 for signal, noise in energy.values() if noise > 0), default=math.inf)
    return GateResult(
        "prepared-model", "worst output SQNR of qcal's prepared float model against yours on "
        "the first calibration samples (dB)", PREPARED_MIN_SQNR_DB,
        None if math.isinf(worst) else worst, worst >= PREPARED_MIN_SQNR_DB)


def time_against_users_model(
    users: onnx.ModelProto | None, prepared: onnx.ModelProto, loaded: LoadedModel,
    quant_model: onnx.ModelProto, feed: Mapping[str, np.ndarray], config: CalibrationConfig,
) -> SideBySide:
    """The quantized model timed against the float model the user gave, not the one qcal
    prepared from it: "slower than float" is about the user's model (a model whose Einsum qcal
    writes as MatMuls ran 0.52x the user's and 1.15x the prepared one, and failed the gate).
    The prepared one stands in where onnxruntime cannot run the user's as it is."""
    def timed(float_model: onnx.ModelProto) -> SideBySide:
        return time_side_by_side(float_model, quant_model, feed, providers=config.providers,
                                 threads=(1, 2), for_gate=config.fail_if_slower is not None)

    if users is not None:
        try:
            return timed(users)
        except Exception as err:  # noqa: BLE001  onnxruntime's own errors too; the quantized
            # model ran before, so what fails here again is raised as it always was
            logger.info("timed against the prepared model: %s", err)
    # As timed, the prepared model states the shapes the quantized one does (in place: the
    # prepared model's last use, and a copy would hold its weights twice).
    keep_declared_shapes(prepared.graph, loaded.declared_shapes)
    return timed(prepared)
