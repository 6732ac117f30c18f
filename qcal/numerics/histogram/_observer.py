"""A streaming histogram of float32 values at a fixed relative resolution, mergeable exactly.

Bins are keyed on the high bits of the float32 bit pattern: the sign, the 8 exponent bits and the
top ``mantissa_bits`` mantissa bits. No range is needed up front and no bin edge ever moves, so a
batch only adds integer counts: the state after any sequence of batches is the same, bit for bit,
whatever the order of the samples, however they were batched, and however shards were merged.

A bin covers ``[v, v * (1 + 2**-mantissa_bits))`` in magnitude (its width is at most
``2**-mantissa_bits`` of the values in it). Bins are stored in blocks of ``2**mantissa_bits``, one
block per (channel, sign, exponent) that was seen, so memory is bounded by the bin count
(at most ``512 * 2**mantissa_bits`` counts per channel) and never grows with the number of samples.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from qcal.numerics import kernels
from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError
from qcal.numerics.histogram._compiled_counting import (
    NonFiniteValues,
    block_offsets,
    count_compiled,
)
from qcal.numerics.histogram._counting import _GROUPS, _count, _scratch_keys
from qcal.numerics.histogram._snapshot import Histogram
from qcal.numerics.observers import (
    Granularity,
    Observer,
    PerChannel,
    PerTensor,
    reduce_min_max,
)

__all__ = ["DEFAULT_MANTISSA_BITS", "HistogramObserver"]

logger = logging.getLogger(__name__)

DEFAULT_MANTISSA_BITS = 8
_MAX_MANTISSA_BITS = 12
_STATE_VERSION = 1
# Per-tensor batches smaller than this are buffered as bin keys (uint32) and counted together:
# a batch then costs a few microseconds instead of a full count. 128 KiB per observer that
# sees such batches; halving it makes counting on 1 ms models about 10 % slower.
_PENDING_KEYS = 1 << 15
# The compiled kernel maps every (channel, sign, exponent) block to its row: 4 KiB a channel.
# Past this many channels the numpy path, which counts a few channels at a time, is used.
_COMPILED_MAX_CHANNELS = 1 << 13


class HistogramObserver:
    """Streaming histogram observer; satisfies :class:`qcal.numerics.observers.Observer`.

    Each batch is counted and dropped: memory is bounded by the bin count. NaN and infinities are
    refused (a histogram has no bin for them); empty batches are ignored. The state is
    independent of sample order, batching and merging (bit for bit), see the module docstring.

    Args:
        granularity: PerTensor() or PerChannel(axis).
        mantissa_bits: mantissa bits per bin key (0..12); relative resolution 2**-mantissa_bits.
            The default 8 gives 0.39 %.

    Raises:
        ConfigError: unknown granularity or mantissa_bits out of range.
    """

    kind: ClassVar[str] = "histogram"
    is_order_dependent: ClassVar[bool] = False

    def __init__(
        self, granularity: Granularity, *, mantissa_bits: int = DEFAULT_MANTISSA_BITS
    ) -> None:
        if not isinstance(granularity, (PerTensor, PerChannel)):
            raise ConfigError(f"unknown granularity {granularity!r}")
        if (
            isinstance(mantissa_bits, bool)
            or not isinstance(mantissa_bits, int)
            or not (0 <= mantissa_bits <= _MAX_MANTISSA_BITS)
        ):
            raise ConfigError(
                f"histogram mantissa_bits={mantissa_bits!r}: expected an integer in "
                f"0..{_MAX_MANTISSA_BITS}"
            )
        self._granularity = granularity
        self._bits = mantissa_bits
        self._axis: int | None = None
        self._groups = np.empty(0, dtype=np.int64)
        self._counts = np.empty((0, 1 << mantissa_bits), dtype=np.int64)
        self._min: np.ndarray | None = None
        self._max: np.ndarray | None = None
        self._pending: np.ndarray | None = None  # buffered keys of small per-tensor batches
        self._pending_size = 0
        # block id -> where its counts start in _counts (flat), for the compiled kernel
        self._offsets: np.ndarray | None = None

    @property
    def granularity(self) -> Granularity:
        """Per tensor or per channel, as constructed."""
        return self._granularity

    @property
    def takes_batch_extremes(self) -> bool:
        """Whether :meth:`update` uses extremes computed elsewhere (per tensor only)."""
        return isinstance(self._granularity, PerTensor)

    @property
    def mantissa_bits(self) -> int:
        """Mantissa bits per bin key."""
        return self._bits

    @property
    def nbytes(self) -> int:
        """Memory held by the state (counts, block ids and extremes)."""
        extremes = 0 if self._min is None or self._max is None else self._min.nbytes * 2
        pending = 0 if self._pending is None else self._pending.nbytes
        return int(self._groups.nbytes + self._counts.nbytes + extremes + pending)

    def update(
        self, batch: np.ndarray, *, extremes: tuple[Any, Any] | None = None
    ) -> None:
        """Count one batch (any float dtype; counted as float32).

        Args:
            batch: the values.
            extremes: the batch's float32 (min, max), exactly as numpy gives them (NaN when a
                value is NaN), when they were already computed (onnxruntime computes them in
                the calibration graph); per-tensor observers then skip their own pass over
                the values. Per-channel observers ignore it.

        Raises:
            DataError: NaN or infinite values, a missing axis, or a channel count that differs
                from earlier batches.
        """
        x = np.asarray(batch)
        if x.dtype != np.float32:
            if x.dtype.kind not in "fiub":
                raise DataError(
                    f"cannot observe a tensor of dtype {x.dtype}: expected real numbers"
                )
            with np.errstate(over="ignore"):
                x = x.astype(np.float32)
        if x.size == 0:
            logger.debug("ignoring an empty batch of shape %s", x.shape)
            return
        if isinstance(self._granularity, PerTensor):
            self._update_tensor(x.reshape(-1), extremes)
            return
        lo, hi, axis = reduce_min_max(x, self._granularity)
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise DataError(_non_finite_message(x))
        if self._min is not None and self._min.shape != lo.shape:
            raise DataError(
                f"batch has {lo.shape[0]} channels on axis {axis}, "
                f"earlier batches had {self._min.shape[0]}"
            )
        assert axis is not None  # per channel
        self._axis = axis
        self._absorb_extremes(lo, hi)
        compiled = kernels.compiled()
        if compiled is not None and lo.shape[0] <= _COMPILED_MAX_CHANNELS:
            outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1 :])
            patterns = np.ascontiguousarray(x).view(np.uint32)
            self._count_compiled(compiled, patterns.reshape(outer, lo.shape[0], inner), x)
            return
        rows = np.moveaxis(x, axis, 0).reshape(lo.shape[0], -1)
        self._absorb(*_count(rows.view(np.uint32), 23 - self._bits, self._bits))

    def _update_tensor(self, flat: np.ndarray, extremes: tuple[Any, Any] | None) -> None:
        if extremes is None:
            lo, hi = flat.min(), flat.max()
        else:
            lo, hi = np.float32(extremes[0]), np.float32(extremes[1])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise DataError(_non_finite_message(flat))
        if self._min is None or self._max is None:
            self._absorb_extremes(lo.reshape(1), hi.reshape(1))
        else:  # scalar compares: cheaper than array ufuncs for the small batches buffered below
            if lo < self._min[0]:
                self._min[0] = lo + np.float32(0.0)  # +0.0 turns -0.0 into +0.0
            if hi > self._max[0]:
                self._max[0] = hi + np.float32(0.0)
        compiled = kernels.compiled()
        if compiled is not None:
            self._count_compiled(compiled, flat.view(np.uint32).reshape(1, 1, -1), flat)
            return
        if flat.size >= _PENDING_KEYS:
            keys = _scratch_keys(flat.size)
            np.right_shift(flat.view(np.uint32), np.uint32(23 - self._bits), out=keys)
            self._absorb(*_count(keys.reshape(1, -1), 0, self._bits))
            return
        keys = flat.view(np.uint32) >> np.uint32(23 - self._bits)
        if self._pending is None:
            self._pending = np.empty(_PENDING_KEYS, dtype=np.uint32)
        if self._pending_size + keys.size > _PENDING_KEYS:
            self._flush()
        self._pending[self._pending_size : self._pending_size + keys.size] = keys
        self._pending_size += keys.size

    def _count_compiled(self, compiled: Any, patterns: np.ndarray, x: np.ndarray) -> None:
        """Count (outer, channels, inner) float32 bit patterns with the compiled kernel."""
        self._flush()  # keys buffered by the numpy path, should the choice have changed
        channels = patterns.shape[1]
        offsets = self._offsets
        if offsets is None or offsets.size != channels * _GROUPS:
            offsets = block_offsets(self._groups, channels, self._bits)
        try:
            self._groups, self._counts, self._offsets = count_compiled(
                compiled, patterns, self._bits, self._groups, self._counts, offsets
            )
        except NonFiniteValues:
            raise DataError(_non_finite_message(x)) from None

    def _flush(self) -> None:
        """Count the buffered keys (the state does not depend on when this happens)."""
        if self._pending is not None and self._pending_size:
            keys = self._pending[: self._pending_size].reshape(1, -1)
            self._absorb(*_count(keys, 0, self._bits))
        self._pending_size = 0

    def merge(self, other: Observer) -> None:
        """Add another histogram observer's counts (exact: any split gives the same state).

        Raises:
            ConfigError: other is not a HistogramObserver of the same granularity and resolution,
                or its channel count differs.
        """
        if not isinstance(other, HistogramObserver):
            raise ConfigError(f"cannot merge a {type(other).__name__} into a HistogramObserver")
        if other._granularity != self._granularity or other._bits != self._bits:
            raise ConfigError(
                "cannot merge histogram observers with different granularity or mantissa_bits"
            )
        if other._min is None or other._max is None:
            return
        other._flush()
        if self._min is not None and self._min.shape != other._min.shape:
            raise ConfigError(
                f"cannot merge per-channel histograms of {self._min.shape[0]} and "
                f"{other._min.shape[0]} channels"
            )
        self._axis = other._axis if self._axis is None else self._axis
        self._absorb_extremes(other._min, other._max)
        self._absorb(other._groups, other._counts)

    def state(self) -> Histogram:
        """A snapshot of the counts (copies; later updates do not change it).

        Raises:
            EmptyStatisticsError: no non-empty batch was observed.
        """
        if self._min is None or self._max is None:
            raise EmptyStatisticsError("histogram observer received no data")
        self._flush()
        return Histogram(
            mantissa_bits=self._bits,
            axis=self._axis,
            groups=_frozen(self._groups),
            counts=_frozen(self._counts),
            min=_frozen(self._min),
            max=_frozen(self._max),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable, versioned state.

        Occupied bins are stored sparsely as parallel lists ``keys`` (``channel << (9 + m) |``
        the bin key of :meth:`Histogram.channel_bins`) and ``counts``; ``min``/``max`` as floats
        (float32 values round-trip exactly through JSON).
        """
        state: dict[str, Any] | None = None
        self._flush()
        if self._min is not None and self._max is not None:
            width = 1 << self._bits
            keys = (self._groups[:, None] * width + np.arange(width, dtype=np.int64)).ravel()
            counts = self._counts.ravel()
            occupied = counts > 0
            state = {
                "axis": self._axis,
                "min": [float(v) for v in self._min],
                "max": [float(v) for v in self._max],
                "keys": [int(k) for k in keys[occupied]],
                "counts": [int(c) for c in counts[occupied]],
            }
        return {
            "kind": self.kind,
            "version": _STATE_VERSION,
            "granularity": _encode_granularity(self._granularity),
            "mantissa_bits": self._bits,
            "state": state,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HistogramObserver:
        """Rebuild an observer from :meth:`to_dict` output.

        Raises:
            ConfigError: wrong kind or version, or a malformed or inconsistent state.
        """
        if data.get("kind") != cls.kind:
            raise ConfigError(f"saved observer kind {data.get('kind')!r} is not {cls.kind!r}")
        if data.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"saved histogram observer has version {data.get('version')!r}, "
                f"expected {_STATE_VERSION}"
            )
        try:
            observer = cls(
                _decode_granularity(data["granularity"]), mantissa_bits=data["mantissa_bits"]
            )
            if data["state"] is not None:
                observer._load(data["state"])
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise ConfigError(f"malformed saved histogram observer: {err!r}") from None
        return observer

    def _load(self, state: Mapping[str, Any]) -> None:
        lo = np.asarray([float(v) for v in state["min"]], dtype=np.float32)
        hi = np.asarray([float(v) for v in state["max"]], dtype=np.float32)
        keys = np.asarray(state["keys"], dtype=np.int64).reshape(-1)
        counts = np.asarray(state["counts"], dtype=np.int64).reshape(-1)
        axis = state["axis"]
        channels = lo.shape[0]
        per_channel = isinstance(self._granularity, PerChannel)
        if (
            hi.shape != lo.shape
            or channels == 0
            or (not per_channel and (channels != 1 or axis is not None))
            or (per_channel and not (isinstance(axis, int) and axis >= 0))
            or not (np.isfinite(lo).all() and np.isfinite(hi).all() and (lo <= hi).all())
        ):
            raise ValueError("inconsistent channels, axis or extremes")
        width = 1 << self._bits
        if (
            keys.shape != counts.shape
            or keys.size == 0
            or (counts <= 0).any()
            or (np.diff(keys) <= 0).any()
            or keys[0] < 0
            or keys[-1] >= channels * _GROUPS * width
            or ((keys // width) % 256 == 255).any()  # the NaN/inf exponent is never counted
        ):
            raise ValueError("bin keys must be sorted, unique and in range, counts positive")
        groups, where = np.unique(keys // width, return_inverse=True)
        dense = np.zeros((groups.size, width), dtype=np.int64)
        dense[where, keys % width] = counts
        self._axis = axis
        self._absorb_extremes(lo, hi)
        self._absorb(groups, dense)

    def _absorb_extremes(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Widen the (C,) extremes; +0.0 turns -0.0 into +0.0 so order cannot matter."""
        zero = np.float32(0.0)
        if self._min is None or self._max is None:
            self._min = np.asarray(lo, dtype=np.float32).reshape(-1) + zero
            self._max = np.asarray(hi, dtype=np.float32).reshape(-1) + zero
        else:
            self._min = np.minimum(self._min, lo) + zero
            self._max = np.maximum(self._max, hi) + zero

    def _absorb(self, groups: np.ndarray, counts: np.ndarray) -> None:
        """Add sparse blocks: sorted unique group ids and their (G, 2**bits) counts."""
        if groups.size == 0:
            return
        stored = self._groups
        pos = np.searchsorted(stored, groups)
        if stored.size and pos[-1] < stored.size and np.array_equal(stored[pos], groups):
            self._counts[pos] += counts  # common case once warm: every block already exists
            return
        merged = np.union1d(stored, groups)
        table = np.zeros((merged.size, counts.shape[1]), dtype=np.int64)
        table[np.searchsorted(merged, stored)] = self._counts
        table[np.searchsorted(merged, groups)] += counts
        self._groups, self._counts = merged, table
        self._offsets = None


def _non_finite_message(x: np.ndarray) -> str:
    nan = int(np.isnan(x).sum())
    pos_inf = int(np.isposinf(x).sum())
    neg_inf = int(np.isneginf(x).sum())
    parts = [f"{n} {what}" for n, what in ((nan, "NaN"), (pos_inf, "+inf"), (neg_inf, "-inf")) if n]
    return (
        f"calibration data contains {', '.join(parts)}: a histogram cannot hold non-finite values"
    )


def _frozen(values: np.ndarray) -> np.ndarray:
    copy: np.ndarray = values.copy()
    copy.flags.writeable = False
    return copy


def _encode_granularity(granularity: Granularity) -> dict[str, Any]:
    if isinstance(granularity, PerChannel):
        return {"per": "channel", "axis": granularity.axis}
    return {"per": "tensor"}


def _decode_granularity(data: Mapping[str, Any]) -> Granularity:
    if data.get("per") == "channel":
        axis = data["axis"]
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"per-channel axis {axis!r} is not an integer")
        return PerChannel(axis)
    if data.get("per") == "tensor":
        return PerTensor()
    raise ValueError(f"unknown granularity {data!r}")
