"""A histogram small enough to keep in the report: at most `PLOT_BINS` equal bins over the
observed range, with the ranges the percentile method would choose beside the chosen one.

The fixed-resolution histogram has thousands of occupied bins per tensor; the report keeps this
compact form instead, for plots and for a person reading it (the chosen range and the clipped
fraction are computed from the full histogram, never from this one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qcal.numerics.histogram._distribution import abs_distribution, signed_distribution
from qcal.numerics.histogram._result import _clip_to
from qcal.numerics.histogram._snapshot import Histogram

__all__ = ["CANDIDATE_PERCENTILES", "PLOT_BINS", "CompactHistogram", "compact_histogram"]

PLOT_BINS = 128
CANDIDATE_PERCENTILES = (99.9, 99.99, 99.999)


@dataclass(frozen=True)
class CompactHistogram:
    """Counts of `counts.size` equal bins over [low, high] (the observed extremes), rounded to
    whole values, and candidate ranges by name ("minmax", "percentile 99.99", ...)."""

    low: float
    high: float
    counts: np.ndarray
    candidates: dict[str, tuple[float, float]]

    def to_json(self) -> dict[str, Any]:
        return {
            "low": self.low,
            "high": self.high,
            "counts": [int(c) for c in self.counts],
            "candidates": {name: [lo, hi] for name, (lo, hi) in self.candidates.items()},
        }


def compact_histogram(
    histogram: Histogram, *, symmetric: bool, bins: int = PLOT_BINS
) -> CompactHistogram | None:
    """The compact form of a per-tensor histogram; None for a per-channel one."""
    if histogram.channels != 1:
        return None
    low, high = float(histogram.min[0]), float(histogram.max[0])
    dist = signed_distribution(histogram)
    counts = np.rint(dist.histogram(low, high, bins if high > low else 1)).astype(np.int64)
    candidates = {"minmax": (low, high)}
    for p, (lo, hi) in zip(CANDIDATE_PERCENTILES, _percentile_ranges(histogram, symmetric)):
        candidates[f"percentile {p:g}"] = (lo, hi)
    return CompactHistogram(low, high, counts, candidates)


def _percentile_ranges(histogram: Histogram, symmetric: bool) -> list[tuple[float, float]]:
    """What `percentile_range` chooses for each of CANDIDATE_PERCENTILES (the same quantiles of
    the same distribution, read in one call; a test holds them equal)."""
    low, high = float(histogram.min[0]), float(histogram.max[0])
    p = np.asarray(CANDIDATE_PERCENTILES, dtype=np.float64)
    if symmetric:
        dist = abs_distribution(histogram)
        thresholds = dist.quantile(p / 100.0 * dist.total)
        ranges = [_clip_to(low, high, -float(t), float(t)) for t in thresholds]
    else:
        dist = signed_distribution(histogram)
        lows = dist.quantile((100.0 - p) / 200.0 * dist.total)
        highs = dist.quantile((100.0 + p) / 200.0 * dist.total)
        ranges = list(zip(lows, highs))
    # float32, as a chosen range is
    return [(float(np.float32(lo)), float(np.float32(hi))) for lo, hi in ranges]
