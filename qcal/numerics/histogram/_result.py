"""What a range method returns, and the helpers every method shares to build it.

:class:`RangeSelection` carries the chosen range (a :class:`~qcal.numerics.observers.MinMaxStats`
for the preset's ``compute_qparams``) with what the report shows about it; :class:`QuantRecipe`
is what mse asks of a preset's recipe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._distribution import Distribution
from qcal.numerics.histogram._snapshot import Histogram
from qcal.numerics.observers import MinMaxStats

__all__ = ["QuantRecipe", "RangeSelection"]


class QuantRecipe(Protocol):
    """What mse needs from a preset's tensor recipe (``qcal.numerics.presets.TensorRecipe`` has it)."""

    def qparams(self, stats: MinMaxStats) -> Any:
        """Quantization parameters for a range (per channel for (C,) statistics)."""
        ...

    def fake_quantize(self, x: np.ndarray, qparams: Any) -> np.ndarray:
        """Float32 fake-quantized x, bit-exact to the API."""
        ...


@dataclass(frozen=True, eq=False)
class RangeSelection:
    """A range chosen from a histogram, with what the report shows about it.

    Attributes:
        method: "percentile", "entropy" or "mse".
        stats: the chosen range, to give to ``compute_qparams`` (shape () or (C,)).
        observed: the exact extremes of the data.
        clipped_fraction: float64 (C,), fraction of the values outside the chosen range.
        details: JSON-ready method specifics (parameters, thresholds, divergences, errors).
        histogram_bins: int64 (C,), occupied fixed-resolution bins per channel.
        values: int64 (C,), values observed per channel.
        relative_resolution: the histogram's relative bin width.
    """

    method: str
    stats: MinMaxStats
    observed: MinMaxStats
    clipped_fraction: np.ndarray
    details: Mapping[str, Any]
    histogram_bins: np.ndarray
    values: np.ndarray
    relative_resolution: float

    @property
    def summary(self) -> dict[str, Any]:
        """JSON-ready summary for the report (lists have one entry per channel)."""
        return {
            "method": self.method,
            "histogram": {
                "min": _floats(self.observed.min),
                "max": _floats(self.observed.max),
                "values": [int(v) for v in self.values],
                "bins": [int(v) for v in self.histogram_bins],
                "relative_resolution": self.relative_resolution,
            },
            "clipped_fraction": _floats(self.clipped_fraction),
            **self.details,
        }


def _check_bins(bins: int, quantized_bins: int) -> None:
    if not 2 <= quantized_bins <= bins:
        raise ConfigError(f"quantized-bins: {quantized_bins} must be between 2 and bins ({bins})")


def _clip_to(low: float, high: float, bottom: float, top: float) -> tuple[float, float]:
    """The observed range [low, high] clipped to [bottom, top] (kept non-empty)."""
    return min(max(low, bottom), top), max(min(high, top), bottom)


def _outside(dist: Distribution, lo: float, hi: float) -> float:
    total = dist.total
    below = float(dist.cdf(lo))
    above = total - float(dist.cdf(hi, inclusive=True))
    return (below + above) / total if total > 0 else 0.0


def _selection(
    method: str,
    histogram: Histogram,
    lows: list[float],
    highs: list[float],
    clipped: list[float],
    details: dict[str, Any],
) -> RangeSelection:
    lo = np.asarray(lows, dtype=np.float32)
    hi = np.asarray(highs, dtype=np.float32)
    if histogram.axis is None:
        stats = MinMaxStats(lo.reshape(()), hi.reshape(()))
    else:
        stats = MinMaxStats(lo, hi, histogram.axis)
    occupied = np.asarray(
        [histogram.channel_bins(c)[0].size for c in range(histogram.channels)], dtype=np.int64
    )
    return RangeSelection(
        method=method,
        stats=stats,
        observed=histogram.observed,
        clipped_fraction=np.asarray(clipped, dtype=np.float64),
        details={k: _jsonable(v) for k, v in details.items()},
        histogram_bins=occupied,
        values=histogram.total(),
        relative_resolution=histogram.relative_resolution,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _floats(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]
