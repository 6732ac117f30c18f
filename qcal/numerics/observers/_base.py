"""Shared ground of the observers: granularity, statistics, data policy, protocol, reduction.

What every observer (and :mod:`qcal.numerics.histogram`) builds on: per-tensor/per-channel
granularity, :class:`MinMaxStats`, :class:`DataPolicy`, the :class:`Observer` protocol,
:func:`reduce_min_max` (float32 extremes of a batch without copies) and the JSON encoding of
saved states.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import numpy as np

from qcal.numerics.errors import ConfigError, DataError

__all__ = [
    "DataPolicy",
    "Granularity",
    "MinMaxStats",
    "Observer",
    "PerChannel",
    "PerTensor",
    "reduce_min_max",
]

_F32 = np.float32
_STATE_VERSION = 1
# Channel-last reductions over many rows are slow in numpy (short inner loop); folding rows
# into wide blocks first is about 4x faster. Only worth it for large, narrow tensors.
_FOLD_MIN_ELEMENTS = 1 << 16
_FOLD_MAX_CHANNELS = 512
_FOLD_BLOCK = 4096
# Large tensors are reduced block by block (1 MiB of float32 each): min and max then read each
# block from cache instead of streaming the whole tensor from memory twice (~25% faster).
_BLOCK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class PerTensor:
    """One set of statistics for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One set of statistics per index along ``axis``, reduced over all other axes.

    Attributes:
        axis: channel axis; may be negative, normalised against the batch rank at update time.
    """

    axis: int


Granularity = PerTensor | PerChannel


@dataclass(frozen=True, eq=False)
class MinMaxStats:
    """Range statistics: float32 ``min``/``max`` of shape () per tensor or (C,) per channel.

    Attributes:
        min: float32 minimum (per channel: one entry per channel).
        max: float32 maximum, same shape.
        axis: the normalised channel axis for per-channel statistics, None per tensor. It is
            carried so that the parameters computed from the statistics know their axis.
    """

    min: np.ndarray
    max: np.ndarray
    axis: int | None = None

    def __post_init__(self) -> None:
        lo = np.asarray(self.min, dtype=_F32)
        hi = np.asarray(self.max, dtype=_F32)
        if lo.shape != hi.shape or lo.ndim > 1:
            raise DataError(
                f"statistics min/max must share a shape () or (C,), got {lo.shape} and {hi.shape}"
            )
        if self.axis is not None and (lo.ndim != 1 or self.axis < 0):
            raise DataError(
                f"per-channel statistics need shape (C,) and axis >= 0, got {self.axis}"
            )
        object.__setattr__(self, "min", lo)
        object.__setattr__(self, "max", hi)

    @property
    def is_per_channel(self) -> bool:
        """True when the statistics have one entry per channel."""
        return self.min.ndim == 1


@dataclass(frozen=True)
class DataPolicy:
    """What an API does with batches that are empty or hold NaN / infinities (SEMANTICS.md §6).

    Attributes:
        empty: "ignore" skips an empty batch (PyTorch, Horizon, TensorFlow); "reject" raises
            DataError where the API's result is undefined (OneFlow, MindSpore).
        nan: "reject" raises DataError; "propagate" lets NaN reach the statistics (the API then
            produces NaN parameters, which the ONNX export replaces and reports).
        inf: same choice for +-inf.
    """

    empty: Literal["ignore", "reject"] = "ignore"
    nan: Literal["reject", "propagate"] = "reject"
    inf: Literal["reject", "propagate"] = "propagate"

    def __post_init__(self) -> None:
        if self.empty not in ("ignore", "reject"):
            raise ConfigError(f"data policy empty={self.empty!r}: expected 'ignore' or 'reject'")
        for name in ("nan", "inf"):
            if getattr(self, name) not in ("reject", "propagate"):
                raise ConfigError(
                    f"data policy {name}={getattr(self, name)!r}: expected 'reject' or 'propagate'"
                )

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"empty": self.empty, "nan": self.nan, "inf": self.inf}


@runtime_checkable
class Observer(Protocol):
    """Accumulates statistics from batches; see the module docstring for the conventions."""

    is_order_dependent: ClassVar[bool]

    def update(self, batch: np.ndarray) -> None:
        """Fold one batch into the statistics."""
        ...

    def merge(self, other: Observer) -> None:
        """Fold another observer's statistics in (exact; order-dependent observers refuse)."""
        ...

    def state(self) -> Any:
        """The statistics; raises EmptyStatisticsError when nothing was observed."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable, versioned state."""
        ...


# ---------------------------------------------------------------------------------------------
# batch reduction


def reduce_min_max(
    batch: np.ndarray, granularity: Granularity
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Float32 min and max of a non-empty batch, per tensor or per channel.

    Reduction happens in the batch's own dtype and only the reduced values are converted:
    rounding to float32 is monotone, so ``f32(min(x)) == min(f32(x))`` and no float32 copy of the
    batch is needed. Per channel, the other axes are reduced in place (no transpose). Signed
    zeros are normalised to +0.0 so that results do not depend on how the data was split.

    Args:
        batch: a non-empty real-valued array.
        granularity: PerTensor or PerChannel(axis).

    Returns:
        (min, max, axis): float32 arrays of shape () or (C,), and the normalised axis.

    Raises:
        DataError: the batch is not real-valued or the axis does not fit its rank.
    """
    x = np.asarray(batch)
    if x.dtype.kind not in "fiub":
        raise DataError(f"cannot observe a tensor of dtype {x.dtype}: expected real numbers")
    axis = (
        _normalise_axis(granularity.axis, x.ndim) if isinstance(granularity, PerChannel) else None
    )
    lo, hi = _blocked_min_max(x, axis)
    zero = _F32(0.0)
    # +0.0 turns -0.0 into +0.0 so that min(-0.0, 0.0) cannot depend on data order.
    return np.asarray(lo, dtype=_F32) + zero, np.asarray(hi, dtype=_F32) + zero, axis


def _normalise_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise DataError(f"per-channel axis {axis} does not exist in a rank-{ndim} tensor")
    return axis + ndim if axis < 0 else axis


def _blocked_min_max(x: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Min and max in one sweep over memory: contiguous blocks along the leading axis of size > 1."""
    split = next((i for i, n in enumerate(x.shape) if n > 1), None)
    if split is None or x.size < 4 * _BLOCK_ELEMENTS or not x.flags.c_contiguous:
        return _min_max(x, axis)
    if axis is None:
        flat = x.reshape(-1)
        parts = [
            _min_max(flat[i : i + _BLOCK_ELEMENTS], None)
            for i in range(0, flat.size, _BLOCK_ELEMENTS)
        ]
        return np.min([p[0] for p in parts]), np.max([p[1] for p in parts])
    step = max(1, _BLOCK_ELEMENTS * x.shape[split] // x.size)
    lead = (slice(None),) * split
    parts = [
        _min_max(x[lead + (slice(i, i + step),)], axis) for i in range(0, x.shape[split], step)
    ]
    lows, highs = [p[0] for p in parts], [p[1] for p in parts]
    if split == axis:  # blocks hold different channels
        return np.concatenate(lows), np.concatenate(highs)
    return np.minimum.reduce(lows), np.maximum.reduce(highs)


def _min_max(x: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    if axis is None:
        return np.asarray(np.min(x)), np.asarray(np.max(x))
    channels = x.shape[axis]
    if (
        axis == x.ndim - 1
        and x.ndim > 1
        and x.flags.c_contiguous
        and channels <= _FOLD_MAX_CHANNELS
        and x.size >= _FOLD_MIN_ELEMENTS
    ):
        rows = x.size // channels
        fold = max(1, _FOLD_BLOCK // channels)
        while rows % fold:
            fold -= 1
        wide = x.reshape(rows // fold, fold * channels)
        lo = wide.min(axis=0).reshape(fold, channels).min(axis=0)
        hi = wide.max(axis=0).reshape(fold, channels).max(axis=0)
        return lo, hi
    others = tuple(i for i in range(x.ndim) if i != axis)
    return np.min(x, axis=others), np.max(x, axis=others)


def _check_values(lo: np.ndarray, hi: np.ndarray, policy: DataPolicy) -> None:
    """Reject NaN/inf as the policy says, looking only at the reduced values (cheap)."""
    if lo.ndim == 0 and hi.ndim == 0:  # per tensor: scalar tests, ~10x cheaper than ufuncs
        low, high = float(lo), float(hi)
        if policy.nan == "reject" and (math.isnan(low) or math.isnan(high)):
            raise DataError("calibration data contains NaN")
        if policy.inf == "reject" and (math.isinf(low) or math.isinf(high)):
            raise DataError("calibration data contains an infinite value")
        return
    if policy.nan == "reject" and (np.isnan(lo).any() or np.isnan(hi).any()):
        raise DataError("calibration data contains NaN")
    if policy.inf == "reject" and (np.isinf(lo).any() or np.isinf(hi).any()):
        raise DataError("calibration data contains an infinite value")


# ---------------------------------------------------------------------------------------------
# JSON encoding


def _encode_array(values: np.ndarray) -> dict[str, Any]:
    flat = [_encode_float(float(v)) for v in np.asarray(values, dtype=_F32).ravel()]
    return {"shape": list(np.shape(values)), "values": flat}


def _encode_float(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _decode_array(data: Mapping[str, Any]) -> np.ndarray:
    values = [float(v) for v in data["values"]]  # float("NaN"/"Infinity") parses the strings
    return np.asarray(values, dtype=_F32).reshape(tuple(data["shape"]))


def _encode_granularity(granularity: Granularity) -> dict[str, Any]:
    if isinstance(granularity, PerChannel):
        return {"per": "channel", "axis": granularity.axis}
    return {"per": "tensor"}


def _decode_granularity(data: Mapping[str, Any]) -> Granularity:
    if data.get("per") == "channel":
        return PerChannel(int(data["axis"]))
    if data.get("per") == "tensor":
        return PerTensor()
    raise ConfigError(f"unknown granularity in saved observer: {data!r}")
