"""Is the quantized model faster? Both models timed side by side on one sample, at one and at two
threads.

Integer kernels pay on large convolutions and matmuls; on a model of a fraction of a
millisecond the Q/DQ pairs at its edges can cost more than they save. qcal times what it wrote
instead of assuming: the float and the quantized model run on the same sample, interleaved (so
both see the same machine load), at one and at two intra-op threads, for about a second in all
(a second each for the `--fail-if-slower` gate), and the medians are compared. The figures are
machine timings: they go with the run's other timings, never into what must be byte-identical.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.calibration.runtime import create_session

__all__ = ["Latency", "measure_latency", "time_side_by_side"]

_BUDGET_SECONDS = 1.0
# The figure every run reports stops at 50 pairs (a small model's check stays a fraction of its
# calibration); the --fail-if-slower gate, whose ratio decides an exit code, takes up to 2000.
_MIN_PAIRS, _MAX_PAIRS, _MAX_PAIRS_FOR_GATE = 3, 50, 2000


@dataclass(frozen=True)
class Latency:
    """Median seconds per run of each model at one thread, over `pairs` interleaved runs."""

    float_seconds: float
    quantized_seconds: float
    pairs: int

    @property
    def ratio(self) -> float:
        return self.quantized_seconds / self.float_seconds if self.float_seconds > 0 else 1.0


def measure_latency(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Mapping[str, np.ndarray],
    *, providers: tuple[str, ...], threads: int = 1, for_gate: bool = False,
    budget: float = _BUDGET_SECONDS,
) -> Latency:
    """Both models at `threads` intra-op threads, interleaved, for at most about `budget`
    seconds."""
    most = _MAX_PAIRS_FOR_GATE if for_gate else _MAX_PAIRS
    # Spinning threads, as a deployment with onnxruntime's default options has them.
    sessions = [create_session(m, providers=providers, threads=threads, what=what, spin=True)
                for m, what in ((float_model, "float model"), (quant_model, "quantized model"))]
    names = [[o.name for o in s.get_outputs()] for s in sessions]
    for session, outputs in zip(sessions, names):  # warm-up: allocations, first-run costs
        session.run(outputs, dict(feed))
    times: list[list[float]] = [[], []]
    started = time.perf_counter()
    while len(times[0]) < most and (
        len(times[0]) < _MIN_PAIRS or time.perf_counter() - started < budget
    ):
        for i, (session, outputs) in enumerate(zip(sessions, names)):
            begin = time.perf_counter()
            session.run(outputs, dict(feed))
            times[i].append(time.perf_counter() - begin)
    return Latency(statistics.median(times[0]), statistics.median(times[1]), len(times[0]))


def time_side_by_side(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Mapping[str, np.ndarray],
    *, providers: tuple[str, ...], threads: tuple[int, ...], for_gate: bool = False,
) -> tuple[dict[str, float], float]:
    """Both models at each thread count: the report's figures (seconds, microsecond precision,
    ``latency_float_1_thread``, ``latency_quantized_2_threads``, ...) and the worst ratio. The
    figure every run reports shares one budget between the thread counts; the gate's takes a
    whole one for each."""
    figures: dict[str, float] = {}
    worst = 0.0
    budget = _BUDGET_SECONDS if for_gate else _BUDGET_SECONDS / len(threads)
    for count in threads:
        latency = measure_latency(float_model, quant_model, feed, providers=providers,
                                  threads=count, for_gate=for_gate, budget=budget)
        unit = "thread" if count == 1 else "threads"
        figures[f"latency_float_{count}_{unit}"] = round(latency.float_seconds, 6)
        figures[f"latency_quantized_{count}_{unit}"] = round(latency.quantized_seconds, 6)
        worst = max(worst, latency.ratio)
    return figures, worst
