"""Calibration method -> observer, and observer state -> the range handed to `compute_qparams`.

`minmax` and `moving-average` take the range straight from the preset's own observers; the
histogram methods (`percentile`, `entropy`, `mse`, `auto`) observe a streaming histogram and
choose a range from it. Either way the chosen range goes through the preset's scheme, so every
preset works with every method.

`auto` takes the mse range (the least squared error of the actual fake-quantization, clipping
included), except on the model's output side (`qcal.graph.output_side`), where it keeps the
exact extremes: there a clipped tail is the output's own error, not one of many a layer sums.
Entropy is not a candidate: its threshold ignores what clipping costs, and can cut off a tail
the model needs (see the README's Range methods).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcal.numerics.errors import DataError
from qcal.numerics.histogram import (
    CompactHistogram,
    HistogramObserver,
    compact_histogram,
    select_range,
)
from qcal.numerics.observers import Granularity, MinMaxStats, Observer
from qcal.numerics.presets import TensorRecipe

__all__ = [
    "HISTOGRAM_METHODS",
    "METHODS",
    "HistogramSettings",
    "RangeChoice",
    "choose_range",
    "new_observer",
]

# Every range method; the histogram ones choose a range from a streaming histogram.
METHODS = ("auto", "minmax", "moving-average", "percentile", "entropy", "mse")
HISTOGRAM_METHODS = frozenset({"auto", "percentile", "entropy", "mse"})


@dataclass(frozen=True)
class HistogramSettings:
    """How the histogram methods choose a range (the run's options of the same names)."""

    percentile: float
    bins: int
    quantized_bins: int


@dataclass(frozen=True)
class RangeChoice:
    observed: MinMaxStats                 # the extremes the data reached
    stats: MinMaxStats                    # the range given to compute_qparams
    summary: dict[str, Any] = field(default_factory=dict)   # method details for the report
    histogram: CompactHistogram | None = None  # histogram methods: what the report plots


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def new_observer(recipe: TensorRecipe, method: str, granularity: Granularity) -> Observer:
    if method in HISTOGRAM_METHODS:
        return HistogramObserver(granularity)
    return recipe.observer(method, granularity)


def choose_range(
    observer: Observer, recipe: TensorRecipe, method: str, settings: HistogramSettings,
    *, percentile: float | None = None, output_side: bool = False,
) -> RangeChoice:
    """The range for `method`; a non-finite range (infinite values in the data) is refused.

    `percentile` overrides `settings.percentile` (a per-tensor setting); `output_side` tells
    `auto` the tensor is on the model's output side (it then keeps the observed extremes).
    """
    if method == "auto" and not isinstance(observer, HistogramObserver):
        method = "minmax"  # a range read from elsewhere (a ranges file) is kept as it is
    if method in HISTOGRAM_METHODS:
        histogram = observer.state()
        symmetric = bool(getattr(recipe.scheme, "symmetric", True))
        selection = select_range(
            histogram, "mse" if method == "auto" else method, recipe,
            percentile=settings.percentile if percentile is None else percentile,
            symmetric_percentile=symmetric,
            bins=settings.bins, quantized_bins=settings.quantized_bins,
        )
        summary, stats = dict(selection.summary), selection.stats
        if method == "auto":  # the report keeps mse's errors for both candidates
            summary.update(method="auto", chose="minmax" if output_side else "mse")
            if output_side:  # mse's own grid ends no longer describe the range
                stats = selection.observed
                for key in ("representable_min", "representable_max"):
                    summary.pop(key, None)
                summary.update(reason="output side: its tail would clip the model's outputs",
                               clipped_fraction=[0.0] * len(summary["clipped_fraction"]))
        choice = RangeChoice(selection.observed, stats, summary,
                             compact_histogram(histogram, symmetric=symmetric))
    else:
        state = observer.state()
        choice = RangeChoice(observed=state, stats=state, summary={"method": method})
    if not (np.all(np.isfinite(choice.stats.min)) and np.all(np.isfinite(choice.stats.max))):
        raise DataError("its range is not finite: the data holds infinite or NaN values")
    # Values near the float32 maximum (padding sentinels, an overflow upstream) leave no finite
    # step, or one whose grid ends past float32: no data that means numbers does that.
    low = np.minimum(np.asarray(choice.stats.min, np.float64), 0.0)
    high = np.maximum(np.asarray(choice.stats.max, np.float64), 0.0)
    if np.any(high - low > _FLOAT32_MAX / 2):
        raise DataError(f"its range [{float(np.min(low)):.4g}, {float(np.max(high)):.4g}] "
                        "reaches the float32 maximum: the data holds sentinel-like values "
                        "(padding?) that no quantization grid can represent")
    return choice
