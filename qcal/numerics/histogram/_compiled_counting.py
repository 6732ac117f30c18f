"""Histogram counting by the compiled kernel, into the observer's own sorted sparse blocks.

The numpy path (:mod:`qcal.numerics.histogram._counting`) counts a batch into blocks of its own
and adds them to the observer's; the compiled kernel counts straight into the observer's blocks
in one pass, through a map from block id to where its row starts. A batch that reaches blocks not stored yet
(only the first batches, in practice) gets them added and is counted over again for those
blocks only. The blocks and counts are the same as the numpy path's, bit for bit: counts are
integers, so neither order nor grouping can change them.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from qcal.numerics.histogram._counting import _GROUPS

__all__ = ["NonFiniteValues", "block_offsets", "count_compiled"]

_SKIP = -2  # in block offsets: a block this pass leaves alone (see count_bins)


class NonFiniteValues(Exception):
    """The batch holds NaN or infinite values; nothing of it was counted."""


def block_offsets(groups: np.ndarray, channels: int, bits: int) -> np.ndarray:
    """int64 (channels * 512,): where each stored block's counts start in the flat count
    table (row * 2**bits), -1 where no block is stored."""
    offsets = np.full(channels * _GROUPS, -1, dtype=np.int64)
    offsets[groups] = np.arange(groups.size, dtype=np.int64) << bits
    return offsets


def count_compiled(
    kernels: ModuleType, patterns: np.ndarray, bits: int, groups: np.ndarray,
    counts: np.ndarray, offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add the bins of `patterns` to the sorted blocks (`groups`, `counts`), whose
    :func:`block_offsets` are `offsets`.

    Args:
        kernels: the compiled kernels module.
        patterns: uint32 (outer, channels, inner) C-contiguous float32 bit patterns.
        bits: mantissa bits per bin key.
        groups, counts, offsets: the stored blocks (see :class:`Histogram`) and their
            :func:`block_offsets`; `counts` is updated in place when no block is added.

    Returns:
        The blocks and their offsets after counting (new arrays when blocks were added).

    Raises:
        NonFiniteValues: a value is NaN or infinite (the counts are then as they were).
    """
    shift = 23 - bits
    missing = np.zeros(offsets.size, dtype=bool)
    if not kernels.count_bins(patterns, shift, bits, offsets, counts, missing, 1):
        return groups, counts, offsets
    new = np.flatnonzero(missing)
    if ((new % 256) == 255).any():  # exponent bits all set: NaN or infinity
        kernels.count_bins(patterns, shift, bits, offsets, counts, missing, -1)
        raise NonFiniteValues
    merged = np.union1d(groups, new)
    table = np.zeros((merged.size, counts.shape[1]), dtype=np.int64)
    table[np.searchsorted(merged, groups)] = counts
    only_new = np.full(offsets.size, _SKIP, dtype=np.int64)
    only_new[new] = np.searchsorted(merged, new).astype(np.int64) << bits
    kernels.count_bins(patterns, shift, bits, only_new, table, missing, 1)
    return merged, table, block_offsets(merged, offsets.size // _GROUPS, bits)
