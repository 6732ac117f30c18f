"""The float model as the user gave it, kept beside the prepared one: the prepared model, which
every figure compares the quantized model with, is checked against it (the built-in
prepared-model gate), and the quantized model is timed against it (the not-slower gate)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx

from qcal.accuracy.evaluate import COMPARE_THREADS
from qcal.accuracy.gates import GateResult
from qcal.accuracy.latency import SideBySide, time_side_by_side
from qcal.calibration.runtime import create_session, run_feed
from qcal.config import CalibrationConfig
from qcal.graph.files.load import LoadedModel
from qcal.graph.structure import keep_declared_shapes
from qcal.numerics.errors import one_line
from qcal.numerics.sums import inner_product

__all__ = ["PREPARED_CHECK_SAMPLES", "prepared_model_drift", "time_against_users_model"]

logger = logging.getLogger(__name__)

# Calibration samples the prepared-model gate runs both float models on, at most.
PREPARED_CHECK_SAMPLES = 4
# The prepared float model computes what the user's does to float32 rounding (folds reorder
# sums; a float16 model widened to float32 computes more precisely): 40 dB is far below what
# any of that costs and far above a preparation that changed the model (a linear Upsample
# converted with half-pixel coordinates: 29 dB).
PREPARED_MIN_SQNR_DB = 40.0


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
            sums[0] += inner_product(a, a)
            sums[1] += inner_product(a - b, a - b)
    worst = min((10 * math.log10(max(signal, 1e-300) / noise)
                 for signal, noise in energy.values() if noise > 0), default=math.inf)
    return GateResult(
        "prepared-model", "worst output SQNR of qcal's prepared float model against yours on "
        "the first calibration samples (dB)", PREPARED_MIN_SQNR_DB,
        None if math.isinf(worst) else worst, worst >= PREPARED_MIN_SQNR_DB)


def time_against_users_model(
    users: onnx.ModelProto, prepared: onnx.ModelProto, loaded: LoadedModel,
    quant_model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
    config: CalibrationConfig,
) -> tuple[SideBySide, str | None]:
    """The quantized model timed against the float model the user gave, not the one qcal
    prepared from it: "slower than float" is about the user's model (a model whose Einsum qcal
    writes as MatMuls ran 0.52x the user's and 1.15x the prepared one, and failed the gate).
    The prepared one stands in where onnxruntime cannot run the user's as it is, and the
    second value then says so, and why (a float16 BERT exported by torch, whose
    LayerNormalization mixes float16 and float32, runs widened to float32 only)."""
    def timed(float_model: onnx.ModelProto) -> SideBySide:
        return time_side_by_side(float_model, quant_model, feeds, providers=config.providers,
                                 threads=(1, 2), for_gate=config.fail_if_slower is not None)

    try:
        return timed(users), None
    except Exception as err:  # noqa: BLE001  onnxruntime's own errors too; the quantized model
        # ran before, so what fails here again is raised as it always was
        stand_in = (f"your float model does not run in onnxruntime as it is "
                    f"({one_line(err)}): the float model qcal prepared from it does, and the "
                    "quantized model is compared with it and timed against it")
        logger.info("timed against the prepared model: %s", err)
    # As timed, the prepared model states the shapes the quantized one does (in place: the
    # prepared model's last use, and a copy would hold its weights twice).
    keep_declared_shapes(prepared.graph, loaded.declared_shapes)
    return timed(prepared), stand_in
