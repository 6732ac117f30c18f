"""Percentile range selection: the range holding a given share of the values."""

from __future__ import annotations

from typing import Any

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._distribution import abs_distribution, signed_distribution
from qcal.numerics.histogram._result import RangeSelection, _clip_to, _outside, _selection
from qcal.numerics.histogram._snapshot import Histogram

__all__ = ["percentile_range"]


def percentile_range(
    histogram: Histogram, percentile: float = 99.99, *, symmetric: bool = True
) -> RangeSelection:
    """Range holding ``percentile`` % of the values.

    * symmetric: ``t`` = the percentile of |x|; the range is the observed one clipped to
      ``[-t, t]``.
    * two-sided: ``[q((100 - p) / 2), q((100 + p) / 2)]`` of x: (100 - p) / 2 % is clipped on
      each side.

    Quantiles are read from the piecewise-linear model of the histogram (see
    ``qcal.numerics.histogram._distribution``): the result lies inside the fixed bin of the order
    statistic of rank ``ceil(p * n / 100)``, within 2**-mantissa_bits of it relatively.

    Raises:
        ConfigError: percentile outside (0, 100].
    """
    p = float(percentile)
    if not 0.0 < p <= 100.0:
        raise ConfigError(f"percentile: {percentile} is not in (0, 100]")
    lows, highs, clipped, thresholds = [], [], [], []
    for channel in range(histogram.channels):
        low, high = float(histogram.min[channel]), float(histogram.max[channel])
        if symmetric:
            dist = abs_distribution(histogram, channel)
            t = float(dist.quantile(p / 100.0 * dist.total))
            thresholds.append(t)
            lo, hi = _clip_to(low, high, -t, t)
        else:
            dist = signed_distribution(histogram, channel)
            total = dist.total
            lo = float(dist.quantile((100.0 - p) / 200.0 * total))
            hi = float(dist.quantile((100.0 + p) / 200.0 * total))
        lows.append(lo)
        highs.append(hi)
        clipped.append(_outside(signed_distribution(histogram, channel), lo, hi))
    details: dict[str, Any] = {"percentile": p, "symmetric": symmetric}
    if symmetric:
        details["threshold"] = thresholds
    return _selection("percentile", histogram, lows, highs, clipped, details)
