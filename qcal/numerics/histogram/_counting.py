"""Counting kernels: float32 bit patterns of a batch into sparse blocks of bin counts.

A bin key is the float32 bit pattern shifted right, plus a channel offset; blocks of
``2**mantissa_bits`` bins are grouped by (channel, sign, exponent). Dense tables or sorts are
chosen by how full a channel's key space is, and chunks of channels bound their memory.
"""

from __future__ import annotations

import threading

import numpy as np

_GROUPS = 512  # sign bit x 8 exponent bits: one block of bins per group and channel
# Upper bound on the dense per-batch count table (int64 entries, 2 MiB): a table that stays in
# cache is filled fastest. Per-channel batches are counted a few channels at a time.
_MAX_DENSE_BINS = 1 << 18
# Below one value per _SORT_BELOW_FILL bins of a channel, sorting the keys beats filling and
# scanning a dense table; sorted chunks hold at most _MAX_SORTED keys.
_SORT_BELOW_FILL = 16
_MAX_SORTED = 1 << 20


def _count(bits_rows: np.ndarray, shift: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Occupied blocks of (C, L) uint32 patterns: (group ids, (G, 2**bits) int64 counts).

    Bin keys are the float32 bit patterns shifted right by ``shift`` (0 for patterns that are
    keys already), plus a channel offset. Many values per channel: one ``np.bincount`` into a
    dense table (cost ~ values + touched table); few: a sort of the keys (cost ~ values, no
    table). Channels are taken in chunks that bound the dense table or the sorted array.
    """
    channels, length = bits_rows.shape
    per_channel = _GROUPS << bits
    dense = length * _SORT_BELOW_FILL >= per_channel
    chunk = max(1, (_MAX_DENSE_BINS // per_channel) if dense else (_MAX_SORTED // length))
    chunk = min(chunk, (1 << 32) // per_channel)  # keys plus channel offsets fit in uint32
    found_groups: list[np.ndarray] = []
    found_counts: list[np.ndarray] = []
    for first in range(0, channels, chunk):
        keys = bits_rows[first : first + chunk]
        width = keys.shape[0]
        if shift:
            keys = keys >> np.uint32(shift)
        elif width > 1:
            keys = keys.copy()  # the channel offsets below must not touch the caller's array
        if width > 1:
            keys += (np.arange(width, dtype=np.uint32) * np.uint32(per_channel))[:, None]
        if dense:
            groups, counts = _count_dense(keys.ravel(), bits)
        else:
            groups, counts = _count_sorted(keys.ravel(), bits)
        found_groups.append(groups + first * _GROUPS)
        found_counts.append(counts)
    if len(found_groups) == 1:
        return found_groups[0], found_counts[0]
    return np.concatenate(found_groups), np.concatenate(found_counts)


def _count_dense(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    # The table ends at the largest key (np.bincount finds it anyway): activations rarely reach
    # the top exponents or, when not negative, the sign bit, so it is a fraction of the full
    # key space, and scanning it for occupied blocks costs less than a second pass over keys.
    table = np.bincount(keys.astype(np.intp, copy=False))
    width = 1 << bits
    table.resize(-(-table.size // width) * width, refcheck=False)  # zero-filled last block
    blocks = table.reshape(-1, width)
    present = np.flatnonzero(blocks.sum(axis=1))
    return present, blocks[present]


_SCRATCH = threading.local()
_SCRATCH_LIMIT = 1 << 22  # 32 MiB of intp keys per thread at most


def _scratch_keys(size: int) -> np.ndarray:
    """A reusable intp buffer of `size` for the bin keys of one batch, one per thread.

    Keys are written straight into intp, the type np.bincount counts, and into memory that
    stays mapped: a fresh array per batch makes the kernel supply (fault in and zero) new pages
    on every write, which cost 3x the count itself for a 100k-value tensor.
    """
    if size > _SCRATCH_LIMIT:
        return np.empty(size, dtype=np.intp)  # too large to keep between batches
    buffer: np.ndarray | None = getattr(_SCRATCH, "keys", None)
    if buffer is None or buffer.size < size:
        grown = max(size, 2 * (0 if buffer is None else buffer.size))
        buffer = np.empty(min(grown, _SCRATCH_LIMIT), dtype=np.intp)
        _SCRATCH.keys = buffer
    return buffer[:size]


def _count_sorted(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    ordered = np.sort(keys)
    starts = np.flatnonzero(_run_starts(ordered))
    unique = ordered[starts]
    counts = np.diff(np.append(starts, ordered.size))
    groups = unique >> np.uint32(bits)
    new_group = _run_starts(groups)
    blocks = np.zeros((int(np.count_nonzero(new_group)), 1 << bits), dtype=np.int64)
    blocks[np.cumsum(new_group) - 1, unique & np.uint32((1 << bits) - 1)] = counts
    return groups[new_group].astype(np.int64), blocks


def _run_starts(ordered: np.ndarray) -> np.ndarray:
    """Boolean mask of the first element of each run of equal values in a sorted array."""
    starts = np.empty(ordered.size, dtype=bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    return starts
