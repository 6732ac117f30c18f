"""The compiled kernel (numba, ``nogil``), imported only by :mod:`qcal.numerics.kernels`.

It takes a batch as a C-contiguous 3-D array ``(outer, channels, inner)``: the channel
axis in the middle, everything before it folded into ``outer`` and everything after it into
``inner`` (per tensor: ``(1, 1, size)``), so one loop serves every layout without a transpose.

Min/max reductions are not among them: numpy's vectorised min and max beat a compiled loop that
keeps numpy's NaN semantics 3-15x (measured on weight and activation layouts), and calibration
computes the activations' extremes inside onnxruntime anyway.

Compiled code is cached on disk (``cache=True``: beside this file when that is writable, else
numba's user cache folder, or ``NUMBA_CACHE_DIR``); where no cache folder can be written, the
kernels are compiled in each process instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

__all__ = ["count_bins", "warm_up"]

_F = TypeVar("_F", bound=Callable[..., Any])
_GROUPS = 512  # sign bit x 8 exponent bits: one block of bins per group and channel


def _jit(function: _F) -> _F:
    try:
        return cast(_F, numba.njit(nogil=True, cache=True)(function))
    except RuntimeError:  # no cache folder can be written (a read-only install, no home)
        return cast(_F, numba.njit(nogil=True)(function))


@_jit
def count_bins(
    patterns: np.ndarray, shift: int, bits: int, offsets: np.ndarray, counts: np.ndarray,
    missing: np.ndarray, step: int,
) -> int:
    """Add `step` to the bin of every value whose block is stored; mark the blocks that are not.

    Args:
        patterns: uint32 (outer, channels, inner): float32 bit patterns.
        shift: bin key = pattern >> shift (23 - mantissa bits).
        bits: mantissa bits of a key; a key's block is ``channel * 512 + key >> bits``.
        offsets: int64 (channels * 512,): where each block's row starts in `counts` (flat:
            row * 2**bits); -1 for a block not stored (the value is skipped and its block
            marked in `missing`), -2 for a block to skip without marking.
        counts: int64 C-contiguous (rows, 2**bits): bin counts, updated in place.
        missing: bool (channels * 512,): set where a value met a block marked -1.
        step: 1 to count, -1 to take back an earlier count of the same values.

    Returns:
        The number of values skipped for want of a row (marked in `missing`).
    """
    outer, channels, inner = patterns.shape
    table = counts.reshape(-1)  # rows of 2**bits counts, end to end
    # uint32 shifts and precomputed row offsets: widening each pattern to int64 and multiplying
    # row by width in the loop cost about 25 % of it.
    key_shift = np.uint32(shift)
    group_shift = np.uint32(shift + bits)
    mask = np.uint32((1 << bits) - 1)
    skipped = 0
    for o in range(outer):
        for c in range(channels):
            base = c * _GROUPS
            line = patterns[o, c]
            for i in range(inner):
                pattern = line[i]
                group = base + (pattern >> group_shift)
                offset = offsets[group]
                if offset >= 0:
                    table[offset + ((pattern >> key_shift) & mask)] += step
                elif offset == -1:
                    missing[group] = True
                    skipped += 1
    return skipped


def warm_up() -> None:
    """Load (or compile) the kernels for the types calibration gives them."""
    patterns = np.zeros((1, 1, 1), dtype=np.uint32)
    offsets = np.full(_GROUPS, -1, dtype=np.int64)
    count_bins(patterns, 15, 8, offsets, np.zeros((0, 256), dtype=np.int64), offsets < 0, 1)
    patterns.flags.writeable = False  # read-only batches are another type to numba
    count_bins(patterns, 15, 8, offsets, np.zeros((0, 256), dtype=np.int64), offsets < 0, 1)
