"""The continuous distribution a fixed-resolution histogram stands for.

Each occupied bin's count is spread uniformly over the bin's interval, clipped to the exact
observed extremes; the bin holding zero is a point mass at 0. The cumulative distribution is then
piecewise linear, and every range method reads its numbers from it: quantiles (percentile),
uniform re-binning (entropy) and bin masses (mse).

Approximation bound: every value is moved by at most the width of its bin, i.e. by at most
``2**-mantissa_bits * |x|`` (values below the smallest normal float32 magnitude, ``2**-126``, are
moved to within ``2**-126`` of where they were). A p-th quantile of the model lies inside the bin
of the order statistic of rank ``ceil(p * n)`` (1-based): within one relative bin width of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qcal.numerics.histogram._snapshot import Histogram

__all__ = ["Distribution", "abs_distribution", "signed_distribution"]


@dataclass(frozen=True, eq=False)
class Distribution:
    """Masses spread uniformly over sorted, non-overlapping intervals ``[lo, hi]``.

    An interval with ``lo == hi`` is a point mass.

    Attributes:
        lo: float64 (B,) interval starts, non-decreasing.
        hi: float64 (B,) interval ends, ``lo <= hi <= next lo``.
        mass: float64 (B,) masses, all > 0.
    """

    lo: np.ndarray
    hi: np.ndarray
    mass: np.ndarray
    point_at: np.ndarray = field(init=False)  # float64 locations of the point masses
    point_mass: np.ndarray = field(init=False)  # and their masses
    _knots_x: np.ndarray = field(init=False, repr=False)
    _knots_y: np.ndarray = field(init=False, repr=False)
    _points_before: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        spread = self.hi > self.lo
        # The spread part's cdf is continuous and piecewise linear: np.interp over its knots
        # evaluates it exactly (and fast on sorted queries). Point masses are kept apart.
        before = np.concatenate([[0.0], np.cumsum(self.mass[spread])])
        setattr_ = object.__setattr__  # frozen dataclass: derived fields are set once, here
        setattr_(self, "_knots_x", np.stack([self.lo[spread], self.hi[spread]], axis=1).ravel())
        setattr_(self, "_knots_y", np.stack([before[:-1], before[1:]], axis=1).ravel())
        setattr_(self, "point_at", self.lo[~spread])
        setattr_(self, "point_mass", self.mass[~spread])
        setattr_(self, "_points_before", np.concatenate([[0.0], np.cumsum(self.point_mass)]))

    @property
    def bins(self) -> int:
        """Number of occupied bins."""
        return int(self.mass.size)

    @property
    def total(self) -> float:
        """Total mass (the cdf's value above the largest value)."""
        spread = float(self._knots_y[-1]) if self._knots_y.size else 0.0
        return spread + float(self._points_before[-1])

    def spread_cdf(self, t: np.ndarray | float) -> np.ndarray:
        """Mass of the spread (non-point) bins below ``t``; continuous in t."""
        points = np.asarray(t, dtype=np.float64)
        if self._knots_x.size == 0:
            return np.zeros_like(points)
        below: np.ndarray = np.interp(points, self._knots_x, self._knots_y)
        return below

    def cdf(self, t: np.ndarray | float, *, inclusive: bool = False) -> np.ndarray:
        """Mass below ``t`` (``inclusive``: at or below), for an array of points."""
        points = np.asarray(t, dtype=np.float64)
        where = np.searchsorted(self.point_at, points, side="right" if inclusive else "left")
        below: np.ndarray = self.spread_cdf(points) + self._points_before[where]
        return below

    def quantile(self, mass: np.ndarray | float) -> np.ndarray:
        """The smallest t whose cdf reaches ``mass`` (linear inside a bin)."""
        target = np.asarray(mass, dtype=np.float64)
        before = np.concatenate([[0.0], np.cumsum(self.mass)])
        j = np.minimum(np.searchsorted(before[1:], target, side="left"), self.bins - 1)
        part = np.clip((target - before[j]) / self.mass[j], 0.0, 1.0)
        value: np.ndarray = self.lo[j] + part * (self.hi[j] - self.lo[j])
        return value

    def histogram(self, start: float, stop: float, bins: int) -> np.ndarray:
        """Float64 masses of ``bins`` equal bins over ``[start, stop]``.

        A point mass on an inner edge goes to the bin on its right; one at ``stop`` to the last.
        """
        edges = start + (stop - start) * (np.arange(bins + 1, dtype=np.float64) / bins)
        below = self.cdf(edges)
        below[-1] = self.cdf(stop, inclusive=True)
        return np.diff(below)


def _bin_edges(magnitude_keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 [lower, upper] magnitude edges of bins given by their sign-less keys."""
    shift = np.uint32(23 - bits)
    keys = magnitude_keys.astype(np.uint32)
    lower = (keys << shift).view(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        # The last bin below the inf/NaN exponent ends at 2**128, which float32 holds as inf;
        # clipping to the observed maximum brings it back.
        upper = ((keys + np.uint32(1)) << shift).view(np.float32).astype(np.float64)
    upper[magnitude_keys == 0] = 0.0  # zero (and magnitudes < 2**-(126+bits)) is a point at 0
    return lower, upper


def signed_distribution(histogram: Histogram, channel: int = 0) -> Distribution:
    """The distribution of x for one channel, clipped to its exact [min, max]."""
    bits = histogram.mantissa_bits
    keys, counts = histogram.channel_bins(channel)
    negative = (keys >> (8 + bits)) == 1
    magnitude = keys & ((1 << (8 + bits)) - 1)
    lower, upper = _bin_edges(magnitude, bits)
    # Keys are sorted by magnitude within each sign: negative bins reversed come first in value.
    lo = np.concatenate([-upper[negative][::-1], lower[~negative]])
    hi = np.concatenate([-lower[negative][::-1], upper[~negative]])
    mass = np.concatenate([counts[negative][::-1], counts[~negative]]).astype(np.float64)
    low, high = float(histogram.min[channel]), float(histogram.max[channel])
    return Distribution(np.clip(lo, low, high), np.clip(hi, low, high), mass)


def abs_distribution(histogram: Histogram, channel: int = 0) -> Distribution:
    """The distribution of |x| for one channel, clipped to the exact extremes of |x|."""
    bits = histogram.mantissa_bits
    keys, counts = histogram.channel_bins(channel)
    magnitude = keys & ((1 << (8 + bits)) - 1)
    unique, where = np.unique(magnitude, return_inverse=True)
    mass = np.bincount(where, weights=counts.astype(np.float64), minlength=unique.size)
    lower, upper = _bin_edges(unique, bits)
    low, high = float(histogram.min[channel]), float(histogram.max[channel])
    top = max(-low, high)
    bottom = low if low >= 0 else (-high if high <= 0 else 0.0)
    return Distribution(np.clip(lower, bottom, top), np.clip(upper, bottom, top), mass)
