"""Is the quantized model faster? Both models timed side by side on one sample, at one and at two
threads.

Integer kernels pay on large convolutions and matmuls; on a model of a fraction of a
millisecond the Q/DQ pairs at its edges can cost more than they save. qcal times what it wrote
instead of assuming: the float and the quantized model run on the same sample, interleaved (so
both see the same machine load), at one and at two intra-op threads, for about a second in all
(a second each for the `--fail-if-slower` gate), and the medians are compared. The figures are
machine timings: they go with the run's other timings, never into what must be byte-identical.
Unless the run allows it, a quantized model slower beyond the timing noise (a sign test on the
interleaved pairs, `Latency.clearly_slower`) fails the built-in "not-slower" gate.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from qcal.calibration.runtime import create_session

__all__ = ["Latency", "SideBySide", "measure_latency", "time_side_by_side"]

_BUDGET_SECONDS = 1.0
# The figure every run reports stops at 50 pairs (a small model's check stays a fraction of its
# calibration); the --fail-if-slower gate, whose ratio decides an exit code, takes up to 2000.
_MIN_PAIRS, _MAX_PAIRS, _MAX_PAIRS_FOR_GATE = 3, 50, 2000
_BLOCK = 5  # timed runs of one model in a row
# The quantized model is slower beyond the noise when it lost more of the interleaved pairs
# than a fair coin would one time in this many (a sign test, whatever the timing spread): a
# model as fast as float fails it one run in a thousand; one 10 % slower, measured in 50 pairs
# with a few per cent of jitter, nearly always.
_NOISE_LEVEL = 1e-3
# ...and its median time is over this ratio of the float model's: a run measures one sample on
# a machine doing other work, and two measurements of the same pair of models (here, on a
# 2-core machine) differ by a per cent or two.
_TOLERANCE = 1.02


@dataclass(frozen=True)
class Latency:
    """Median seconds per run of each model at one thread, over `pairs` interleaved runs."""

    float_seconds: float
    quantized_seconds: float
    pairs: int
    slower_pairs: int = 0  # pairs in which the quantized model took longer

    @property
    def ratio(self) -> float:
        return self.quantized_seconds / self.float_seconds if self.float_seconds > 0 else 1.0

    @property
    def clearly_slower(self) -> bool:
        """Whether the quantized model is slower beyond the timing noise (`_NOISE_LEVEL`)."""
        return (self.ratio > _TOLERANCE
                and _chance_of_losing(self.pairs, self.slower_pairs) < _NOISE_LEVEL)


def _chance_of_losing(pairs: int, lost: int) -> float:
    """The chance that a model as fast as the other loses at least `lost` of `pairs` runs."""
    # in integers: 2.0 ** pairs overflows a float past 1023 pairs (the gate takes up to 2000)
    return sum(math.comb(pairs, k) for k in range(lost, pairs + 1)) / (1 << pairs)


@dataclass(frozen=True)
class SideBySide:
    """Both models timed at each thread count.

    Attributes:
        figures: the report's timings (seconds, microsecond precision,
            ``latency_float_1_thread``, ``latency_quantized_2_threads``, ...).
        worst_ratio: quantized/float median latency, the worse of the thread counts.
        clearly_slower: the thread counts at which the quantized model is slower beyond the
            timing noise (`Latency.clearly_slower`).
    """

    figures: dict[str, float] = field(default_factory=dict)
    worst_ratio: float = 0.0
    clearly_slower: tuple[int, ...] = ()


def measure_latency(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Mapping[str, np.ndarray],
    *, providers: tuple[str, ...], threads: int = 1, for_gate: bool = False,
    budget: float = _BUDGET_SECONDS,
) -> Latency:
    """Both models at `threads` intra-op threads, in alternating blocks, for at most about
    `budget` seconds.

    Each block runs one model once untimed and then `_BLOCK` times timed, the two models taking
    turns at going first; the i-th timed run of one block is paired with the i-th of the other
    model's block. The threads of both sessions sleep when idle: two pools spinning on a 2-core
    machine made the same model time 0.75x or 1.3x itself at 2 threads, by which session was
    made first, where without spinning it times 0.98-1.02x (the untimed run lets the other
    session's threads settle)."""
    most = _MAX_PAIRS_FOR_GATE if for_gate else _MAX_PAIRS
    sessions = [create_session(m, providers=providers, threads=threads, what=what)
                for m, what in ((float_model, "float model"), (quant_model, "quantized model"))]
    names = [[o.name for o in s.get_outputs()] for s in sessions]
    for session, outputs in zip(sessions, names):  # warm-up: allocations, first-run costs
        session.run(outputs, dict(feed))
    times: list[list[float]] = [[], []]
    started = time.perf_counter()
    while len(times[0]) < most and (
        len(times[0]) < _MIN_PAIRS or time.perf_counter() - started < budget
    ):
        for i in (0, 1) if len(times[0]) % (2 * _BLOCK) == 0 else (1, 0):
            sessions[i].run(names[i], dict(feed))
            for _ in range(_BLOCK):
                begin = time.perf_counter()
                sessions[i].run(names[i], dict(feed))
                times[i].append(time.perf_counter() - begin)
    lost = sum(q > f for f, q in zip(*times))
    return Latency(statistics.median(times[0]), statistics.median(times[1]), len(times[0]), lost)


def time_side_by_side(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Mapping[str, np.ndarray],
    *, providers: tuple[str, ...], threads: tuple[int, ...], for_gate: bool = False,
) -> SideBySide:
    """Both models at each thread count. The figure every run reports shares one budget between
    the thread counts; the `--fail-if-slower` gate's takes a whole one for each."""
    figures: dict[str, float] = {}
    worst, slower = 0.0, []
    budget = _BUDGET_SECONDS if for_gate else _BUDGET_SECONDS / len(threads)
    for count in threads:
        latency = measure_latency(float_model, quant_model, feed, providers=providers,
                                  threads=count, for_gate=for_gate, budget=budget)
        unit = "thread" if count == 1 else "threads"
        figures[f"latency_float_{count}_{unit}"] = round(latency.float_seconds, 6)
        figures[f"latency_quantized_{count}_{unit}"] = round(latency.quantized_seconds, 6)
        worst = max(worst, latency.ratio)
        if latency.clearly_slower:
            slower.append(count)
    return SideBySide(figures, worst, tuple(slower))
