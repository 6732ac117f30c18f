"""The immutable state of a histogram observer: sparse fixed-resolution counts and extremes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qcal.numerics.histogram._counting import _GROUPS
from qcal.numerics.observers import MinMaxStats

__all__ = ["Histogram"]


@dataclass(frozen=True, eq=False)
class Histogram:
    """Immutable snapshot of a :class:`HistogramObserver`: sparse fixed-resolution counts.

    Attributes:
        mantissa_bits: mantissa bits kept in a bin key; relative bin width is 2**-mantissa_bits.
        axis: normalised channel axis for per-channel histograms, None per tensor.
        groups: int64 (G,), sorted: ``channel * 512 + sign * 256 + biased_exponent`` of each
            stored block.
        counts: int64 (G, 2**mantissa_bits): counts of the bins of each block, by top mantissa
            bits.
        min: float32 (C,) exact minimum per channel (C = 1 per tensor).
        max: float32 (C,) exact maximum per channel.
    """

    mantissa_bits: int
    axis: int | None
    groups: np.ndarray
    counts: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @property
    def is_per_channel(self) -> bool:
        """True when there is one histogram per channel."""
        return self.axis is not None

    @property
    def channels(self) -> int:
        """Number of channels (1 per tensor)."""
        return int(self.min.shape[0])

    @property
    def observed(self) -> MinMaxStats:
        """The exact extremes of the data, shaped () per tensor and (C,) per channel."""
        if self.axis is None:
            return MinMaxStats(self.min.reshape(()), self.max.reshape(()))
        return MinMaxStats(self.min.copy(), self.max.copy(), self.axis)

    @property
    def relative_resolution(self) -> float:
        """Upper bound of a bin's width relative to the magnitudes in it: 2**-mantissa_bits."""
        return float(2.0**-self.mantissa_bits)

    @property
    def nbytes(self) -> int:
        """Memory held by the counts and extremes."""
        return int(self.groups.nbytes + self.counts.nbytes + self.min.nbytes + self.max.nbytes)

    def channel_bins(self, channel: int) -> tuple[np.ndarray, np.ndarray]:
        """Occupied bins of one channel as (keys, counts).

        Args:
            channel: channel index (0 per tensor).

        Returns:
            int64 keys ``sign << (8 + m) | exponent << m | mantissa_top`` (m = mantissa_bits),
            i.e. the float32 bit pattern shifted right by ``23 - m``, sorted; and int64 counts > 0.
        """
        first = np.searchsorted(self.groups, channel * _GROUPS)
        last = np.searchsorted(self.groups, (channel + 1) * _GROUPS)
        local = self.groups[first:last] - channel * _GROUPS
        width = 1 << self.mantissa_bits
        keys = (local[:, None] << self.mantissa_bits) + np.arange(width, dtype=np.int64)
        counts = self.counts[first:last]
        occupied = counts > 0
        return keys[occupied], counts[occupied]

    def total(self) -> np.ndarray:
        """int64 (C,): number of values seen per channel."""
        totals = np.zeros(self.channels, dtype=np.int64)
        np.add.at(totals, self.groups // _GROUPS, self.counts.sum(axis=1))
        return totals
