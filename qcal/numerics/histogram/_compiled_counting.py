"""Histogram counting by the compiled kernel, into the observer's own sorted sparse blocks.

The numpy path (:mod:`qcal.numerics.histogram._counting`) counts a batch into blocks of its own
and adds them to the observer's; the compiled kernel counts straight into the observer's blocks
in one pass, through a map from block id to row. A batch that reaches blocks not stored yet
(only the first batches, in practice) gets them added and is counted over again for those
blocks only. The blocks and counts are the same as the numpy path's, bit for bit: counts are
integers, so neither order nor grouping can change them.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from qcal.numerics.histogram._counting import _GROUPS

__all__ = ["NonFiniteValues", "count_compiled", "row_map"]

_SKIP = -2  # in a row map: a block this pass leaves alone (see count_bins)


class NonFiniteValues(Exception):
    """The batch holds NaN or infinite values; nothing of it was counted."""


def row_map(groups: np.ndarray, channels: int) -> np.ndarray:
    """int32 (channels * 512,): the row of each stored block, -1 where there is none."""
    rows = np.full(channels * _GROUPS, -1, dtype=np.int32)
    rows[groups] = np.arange(groups.size, dtype=np.int32)
    return rows


def count_compiled(
    kernels: ModuleType, patterns: np.ndarray, bits: int, groups: np.ndarray,
    counts: np.ndarray, rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add the bins of `patterns` to the sorted blocks (`groups`, `counts`) and their `rows`.

    Args:
        kernels: the compiled kernels module.
        patterns: uint32 (outer, channels, inner) C-contiguous float32 bit patterns.
        bits: mantissa bits per bin key.
        groups, counts, rows: the stored blocks (see :class:`Histogram`) and their
            :func:`row_map`; `counts` is updated in place when no block is added.

    Returns:
        The blocks and row map after counting (new arrays when blocks were added).

    Raises:
        NonFiniteValues: a value is NaN or infinite (the counts are then as they were).
    """
    shift = 23 - bits
    missing = np.zeros(rows.size, dtype=bool)
    if not kernels.count_bins(patterns, shift, bits, rows, counts, missing, 1):
        return groups, counts, rows
    new = np.flatnonzero(missing)
    if ((new % 256) == 255).any():  # exponent bits all set: NaN or infinity
        kernels.count_bins(patterns, shift, bits, rows, counts, missing, -1)
        raise NonFiniteValues
    merged = np.union1d(groups, new)
    table = np.zeros((merged.size, counts.shape[1]), dtype=np.int64)
    table[np.searchsorted(merged, groups)] = counts
    only_new = np.full(rows.size, _SKIP, dtype=np.int32)
    only_new[new] = np.searchsorted(merged, new).astype(np.int32)
    kernels.count_bins(patterns, shift, bits, only_new, table, missing, 1)
    return merged, table, row_map(merged, rows.size // _GROUPS)
