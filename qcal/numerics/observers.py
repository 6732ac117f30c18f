"""Observers: turn calibration batches into min/max statistics.

An observer only accumulates statistics; it knows nothing about integer types, scales or zero
points (those belong to :mod:`qcal.numerics.schemes`). Each observer follows one API's range-tracking
convention of SEMANTICS.md:

* :class:`MinMaxObserver`: running extreme over all batches (§1.2 ``MinMaxObserver``; also the
  "min/max of the calibration data" of TensorFlow §2.2, OneFlow §3.1 and MindSpore §4.2, whose
  0-forcing is applied when parameters are computed). Order-independent, ``merge`` is exact.
* :class:`MovingAverageMinMaxObserver`: PyTorch/Horizon EMA (§1.2, §5.2): the first batch
  initialises, ``averaging_constant`` weights the new batch.
* :class:`MindSporeObserver`: MindSpore (§4.2): starts from ``min_init``/``max_init``,
  ``ema_decay`` weights the old value, 0 is forced into the stored range; ``ema=False`` keeps the
  current batch only.
* :class:`OneFlowMovingAverageObserver`: OneFlow ``MovingAverageMinMaxObserver`` (§3.3).
* :class:`FixedRangeObserver`: a range given by the user (TensorFlow ``range_given``, §2.2).

What an API does with empty tensors, NaN and infinities (§6) is a :class:`DataPolicy` chosen by
the preset. Statistics are float32, reduced without transposes or float64 copies of the batch.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import numpy as np

from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError, QcalError

__all__ = [
    "DataPolicy",
    "FixedRangeObserver",
    "Granularity",
    "MinMaxObserver",
    "MinMaxStats",
    "MindSporeObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "OneFlowMovingAverageObserver",
    "PerChannel",
    "PerTensor",
    "PerTensorExtremesFeed",
    "observer_from_dict",
    "reduce_min_max",
]

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------------
# observers


class _RangeObserver:
    """Shared machinery: granularity, data policy, float32 min/max state and serialisation."""

    kind: ClassVar[str] = ""
    is_order_dependent: ClassVar[bool] = False

    def __init__(self, granularity: Granularity, policy: DataPolicy) -> None:
        if not isinstance(granularity, (PerTensor, PerChannel)):
            raise ConfigError(f"unknown granularity {granularity!r}")
        self._granularity = granularity
        self._policy = policy
        self._min: np.ndarray | None = None
        self._max: np.ndarray | None = None
        self._axis: int | None = None

    @property
    def granularity(self) -> Granularity:
        """Per tensor or per channel, as constructed."""
        return self._granularity

    @property
    def policy(self) -> DataPolicy:
        """Empty / NaN / inf handling."""
        return self._policy

    def update(self, batch: np.ndarray) -> None:
        """Fold one batch into the statistics (see the class docstring for the rule)."""
        x = np.asarray(batch)
        if x.size == 0:
            if self._policy.empty == "reject":
                raise DataError(f"empty tensor (shape {x.shape}): this API's result is undefined")
            logger.debug("ignoring an empty batch of shape %s", x.shape)
            return
        lo, hi, axis = self._reduce(x)
        self._fold(lo, hi, axis)

    def channel_axis(self, ndim: int) -> int | None:
        """The axis a rank-`ndim` batch is reduced per channel on (None: per tensor).

        Raises:
            DataError: the per-channel axis does not exist at that rank.
        """
        if isinstance(self._granularity, PerChannel):
            return _normalise_axis(self._granularity.axis, ndim)
        return None

    def update_min_max(self, lo: np.ndarray, hi: np.ndarray, axis: int | None = None) -> None:
        """Fold one non-empty batch given by its extremes, as if :meth:`update` had reduced it.

        For callers that reduce elsewhere (inside the onnxruntime graph during calibration):
        ``lo``/``hi`` are the batch's min and max, shape () per tensor or (C,) per channel on
        ``axis`` (= :meth:`channel_axis`), NaN where the batch (channel) holds a NaN. They take
        the path of :meth:`update` from there (float32, signed zeros made +0.0, the data policy,
        the channel check), so the statistics are bit-identical to updating with the batch.
        """
        zero = _F32(0.0)
        self._fold(np.asarray(lo, dtype=_F32) + zero, np.asarray(hi, dtype=_F32) + zero, axis)

    def _fold(self, lo: np.ndarray, hi: np.ndarray, axis: int | None) -> None:
        _check_values(lo, hi, self._policy)
        if self._min is not None and self._min.shape != lo.shape:
            raise DataError(
                f"batch has {lo.shape[0] if lo.ndim else 1} channels on axis {axis}, "
                f"earlier batches had {self._min.shape[0] if self._min.ndim else 1}"
            )
        self._axis = axis
        self._absorb(lo, hi)

    def _reduce(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int | None]:
        return reduce_min_max(x, self._granularity)

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        raise NotImplementedError

    def state(self) -> MinMaxStats:
        """The statistics; raises EmptyStatisticsError when no non-empty batch was seen."""
        if self._min is None or self._max is None:
            raise EmptyStatisticsError(f"{self.kind} observer received no data")
        return MinMaxStats(self._min.copy(), self._max.copy(), self._axis)

    def merge(self, other: Observer) -> None:
        """Order-dependent observers cannot merge: their result depends on batch order."""
        raise ConfigError(
            f"{self.kind} observer is order-dependent and cannot merge statistics; "
            "feed all batches to one observer in data order"
        )

    def _check_mergeable(self, other: Observer) -> _RangeObserver:
        if type(other) is not type(self):
            raise ConfigError(f"cannot merge a {type(other).__name__} into a {type(self).__name__}")
        assert isinstance(other, _RangeObserver)
        if other._granularity != self._granularity or other._policy != self._policy:
            raise ConfigError("cannot merge observers with different granularity or data policy")
        return other

    def _config_dict(self) -> dict[str, Any]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: kind, version, granularity, policy, settings and state."""
        state = None
        if self._min is not None and self._max is not None:
            state = {
                "min": _encode_array(self._min),
                "max": _encode_array(self._max),
                "axis": self._axis,
            }
        return {
            "kind": self.kind,
            "version": _STATE_VERSION,
            "granularity": _encode_granularity(self._granularity),
            "policy": self._policy.to_dict(),
            **self._config_dict(),
            "state": state,
        }

    def _load_state(self, data: Mapping[str, Any] | None) -> None:
        if data is not None:
            self._min = _decode_array(data["min"])
            self._max = _decode_array(data["max"])
            self._axis = data.get("axis")


class MinMaxObserver(_RangeObserver):
    """Running extreme over all batches: ``min = min(min, min(X))``, ``max = max(max, max(X))``.

    SEMANTICS.md §1.2 (PyTorch ``MinMaxObserver``/``PerChannelMinMaxObserver``). The stored range
    does not include 0; schemes add it where their API does. ``merge`` is exact: any split of the
    data gives bit-identical statistics.
    """

    kind = "minmax"
    is_order_dependent = False

    def __init__(
        self, granularity: Granularity | None = None, *, policy: DataPolicy | None = None
    ) -> None:
        super().__init__(granularity or PerTensor(), policy or DataPolicy())

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if self._min is None or self._max is None:
            self._min, self._max = lo, hi
        else:
            self._min = np.minimum(self._min, lo)
            self._max = np.maximum(self._max, hi)

    def merge(self, other: Observer) -> None:
        """Fold in another MinMaxObserver's range (exact)."""
        peer = self._check_mergeable(other)
        if peer._min is None or peer._max is None:
            return
        if self._min is not None and self._min.shape != peer._min.shape:
            raise DataError("cannot merge per-channel statistics with different channel counts")
        self._axis = peer._axis if self._axis is None else self._axis
        self._absorb(peer._min, peer._max)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MinMaxObserver:
        """Rebuild from :meth:`to_dict` output."""
        observer = cls(
            _decode_granularity(data["granularity"]), policy=DataPolicy(**data["policy"])
        )
        observer._load_state(data["state"])
        return observer


class MovingAverageMinMaxObserver(_RangeObserver):
    """PyTorch/Horizon moving average (SEMANTICS.md §1.2, §5.2).

    The first non-empty batch sets the state; each later batch does, in float32,
    ``min = f32(min + f32(c32 * f32(min(X) - min)))`` with ``c32 = f32(averaging_constant)``
    (and the same for max). That is algebraically ``(1-c)·old + c·new`` but only this order
    reproduces the frameworks bit for bit. Order-dependent: ``merge`` raises ConfigError.
    """

    kind = "moving-average"
    is_order_dependent = True

    def __init__(
        self,
        granularity: Granularity | None = None,
        *,
        averaging_constant: float = 0.01,
        policy: DataPolicy | None = None,
    ) -> None:
        super().__init__(granularity or PerTensor(), policy or DataPolicy())
        if not 0.0 < averaging_constant <= 1.0:
            raise ConfigError(
                f"averaging_constant={averaging_constant}: expected a value in (0, 1]"
            )
        self.averaging_constant = float(averaging_constant)
        self._c32 = _F32(averaging_constant)

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if self._min is None or self._max is None:
            self._min, self._max = lo, hi
            return
        with np.errstate(invalid="ignore", over="ignore"):
            self._min = self._min + self._c32 * (lo - self._min)
            self._max = self._max + self._c32 * (hi - self._max)

    def _config_dict(self) -> dict[str, Any]:
        return {"averaging_constant": self.averaging_constant}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MovingAverageMinMaxObserver:
        """Rebuild from :meth:`to_dict` output."""
        observer = cls(
            _decode_granularity(data["granularity"]),
            averaging_constant=float(data["averaging_constant"]),
            policy=DataPolicy(**data["policy"]),
        )
        observer._load_state(data["state"])
        return observer


class MindSporeObserver(_RangeObserver):
    """MindSpore ``FakeQuantWithMinMaxObserver`` range tracking (SEMANTICS.md §4.2, Ascend).

    The state starts at ``min_init``/``max_init`` (one value per channel when per channel).

    * ``ema=True``: ``min = min(f32(f32(min*f32(c)) + f32(min(X)*f32(1-c))), 0)`` with
      ``c = ema_decay`` weighting the *old* value (``1-c`` evaluated in double, then rounded);
      max likewise with ``max(..., 0)``.
    * ``ema=False``: ``min = min(min(X), 0)``, ``max = max(max(X), 0)``: the current batch only.

    A 1-D batch is reduced per element along axis 0 when per channel, as MindSpore does.
    Order-dependent either way (the last batch wins without EMA): ``merge`` raises ConfigError.
    ``state()`` raises EmptyStatisticsError until a batch was observed; the initial range is
    :meth:`initial_state`.
    """

    kind = "mindspore"
    is_order_dependent = True

    def __init__(
        self,
        granularity: Granularity | None = None,
        *,
        ema: bool = False,
        ema_decay: float = 0.999,
        min_init: float | Sequence[float] = -6.0,
        max_init: float | Sequence[float] = 6.0,
        policy: DataPolicy | None = None,
    ) -> None:
        super().__init__(
            granularity or PerTensor(), policy or DataPolicy("reject", "reject", "reject")
        )
        if not 0.0 <= ema_decay <= 1.0:
            raise ConfigError(f"ema_decay={ema_decay}: expected a value in [0, 1]")
        self.ema = bool(ema)
        self.ema_decay = float(ema_decay)
        self._init_min = np.asarray(min_init, dtype=_F32)
        self._init_max = np.asarray(max_init, dtype=_F32)
        if self._init_min.ndim > 1 or self._init_max.ndim > 1:
            raise ConfigError("min_init/max_init must be numbers or flat lists")
        if isinstance(self._granularity, PerTensor) and (
            self._init_min.size != 1 or self._init_max.size != 1
        ):
            raise ConfigError("per-tensor min_init/max_init must be single numbers")
        if not np.all(self._init_max > self._init_min):
            raise ConfigError(
                f"max_init must be greater than min_init (got {min_init} and {max_init})"
            )
        self._decay32 = _F32(ema_decay)
        self._keep32 = _F32(1.0 - self.ema_decay)  # 1-c in double, then float32 (Ascend kernel)

    def initial_state(self, channels: int | None = None) -> MinMaxStats:
        """The stored range before any training step (what an eval-mode cell uses)."""
        lo, hi = self._init_min, self._init_max
        if isinstance(self._granularity, PerTensor):
            return MinMaxStats(lo.reshape(()), hi.reshape(()))
        count = channels if channels is not None else max(lo.size, hi.size)
        axis = self._granularity.axis
        return MinMaxStats(
            self._broadcast(lo, count), self._broadcast(hi, count), axis if axis >= 0 else None
        )

    @staticmethod
    def _broadcast(values: np.ndarray, channels: int) -> np.ndarray:
        if values.size not in (1, channels):
            raise DataError(f"min_init/max_init have {values.size} values for {channels} channels")
        return np.broadcast_to(values.reshape(-1), (channels,)).astype(_F32)

    def _reduce(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int | None]:
        granularity = self._granularity
        if isinstance(granularity, PerChannel) and x.ndim == 1:
            granularity = PerChannel(0)
        return reduce_min_max(x, granularity)

    def channel_axis(self, ndim: int) -> int | None:
        """As the base class, but a 1-D batch is reduced per element (axis 0)."""
        if isinstance(self._granularity, PerChannel) and ndim == 1:
            return 0
        return super().channel_axis(ndim)

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        zero = _F32(0.0)
        if self.ema:
            if self._min is None or self._max is None:
                channels = lo.shape[0] if lo.ndim else None
                start = self.initial_state(channels)
                self._min, self._max = start.min, start.max
            with np.errstate(invalid="ignore", over="ignore"):
                lo = self._min * self._decay32 + lo * self._keep32
                hi = self._max * self._decay32 + hi * self._keep32
        self._min = np.minimum(lo, zero) + zero
        self._max = np.maximum(hi, zero) + zero

    def _config_dict(self) -> dict[str, Any]:
        return {
            "ema": self.ema,
            "ema_decay": self.ema_decay,
            "min_init": _encode_array(self._init_min),
            "max_init": _encode_array(self._init_max),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MindSporeObserver:
        """Rebuild from :meth:`to_dict` output."""
        observer = cls(
            _decode_granularity(data["granularity"]),
            ema=bool(data["ema"]),
            ema_decay=float(data["ema_decay"]),
            min_init=_decode_array(data["min_init"]).tolist(),
            max_init=_decode_array(data["max_init"]).tolist(),
            policy=DataPolicy(**data["policy"]),
        )
        observer._load_state(data["state"])
        return observer


class OneFlowMovingAverageObserver(_RangeObserver):
    """OneFlow ``MovingAverageMinMaxObserver`` in training mode (SEMANTICS.md §3.3). Per tensor.

    State ``moving_max``/``moving_min`` starts at 0; an entry whose stored value is exactly 0 is
    re-initialised from the batch, otherwise ``new = f32(f32(old*m) + f32(cur*f32(1-m)))`` with
    ``m = momentum`` (the batch gets ``1-m``). With ``symmetric=True`` (schemes "symmetric" and
    the cambricon formula) ``cur = max(|max(X)|, |min(X)|)`` and ``moving_min := moving_max``.
    """

    kind = "oneflow-moving-average"
    is_order_dependent = True

    def __init__(
        self,
        granularity: Granularity | None = None,
        *,
        momentum: float = 0.95,
        symmetric: bool = True,
        policy: DataPolicy | None = None,
    ) -> None:
        granularity = granularity or PerTensor()
        if not isinstance(granularity, PerTensor):
            raise ConfigError(
                "OneFlow's moving-average observer is per-layer only (no per-channel)"
            )
        super().__init__(granularity, policy or DataPolicy("reject", "propagate", "propagate"))
        if not 0.0 <= momentum <= 1.0:
            raise ConfigError(f"momentum={momentum}: expected a value in [0, 1]")
        self.momentum = float(momentum)
        self.symmetric = bool(symmetric)
        self._m32 = _F32(momentum)
        self._keep32 = _F32(1.0) - self._m32  # `1 - momentum` is float arithmetic in the kernel

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        zero = _F32(0.0)
        old_min = self._min if self._min is not None else zero
        old_max = self._max if self._max is not None else zero
        if self.symmetric:
            hi = np.maximum(np.abs(hi), np.abs(lo))
            new_max = self._blend(old_max, hi)
            self._min, self._max = new_max, new_max
        else:
            self._min, self._max = self._blend(old_min, lo), self._blend(old_max, hi)

    def _blend(self, old: np.ndarray, cur: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            mixed = old * self._m32 + cur * self._keep32
        return np.asarray(np.where(old == 0, cur, mixed), dtype=_F32)

    def _config_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "symmetric": self.symmetric}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OneFlowMovingAverageObserver:
        """Rebuild from :meth:`to_dict` output."""
        observer = cls(
            _decode_granularity(data["granularity"]),
            momentum=float(data["momentum"]),
            symmetric=bool(data["symmetric"]),
            policy=DataPolicy(**data["policy"]),
        )
        observer._load_state(data["state"])
        return observer


class FixedRangeObserver(_RangeObserver):
    """A range given up front (TensorFlow ``range_given=True`` with ``input_min``/``input_max``).

    Batches are not inspected; ``state()`` is the given range from the start. Per channel, the
    range has one entry per channel and ``axis`` is the channel axis (>= 0).
    """

    kind = "fixed-range"
    is_order_dependent = False

    def __init__(
        self,
        min_value: float | Sequence[float],
        max_value: float | Sequence[float],
        granularity: Granularity | None = None,
    ) -> None:
        super().__init__(granularity or PerTensor(), DataPolicy())
        lo = np.asarray(min_value, dtype=_F32)
        hi = np.asarray(max_value, dtype=_F32)
        per_channel = isinstance(self._granularity, PerChannel)
        if lo.shape != hi.shape or lo.ndim != (1 if per_channel else 0):
            raise ConfigError(
                "input_min/input_max must be numbers per tensor, or equal-length lists per channel"
            )
        if not np.all(lo <= hi):
            raise ConfigError(
                f"input_min must not exceed input_max (got {min_value} and {max_value})"
            )
        self._min, self._max = lo, hi
        if isinstance(self._granularity, PerChannel) and self._granularity.axis >= 0:
            self._axis = self._granularity.axis

    def update(self, batch: np.ndarray) -> None:
        """The range is given: a batch only fixes a negative axis and must fit the channel count."""
        if not isinstance(self._granularity, PerChannel):
            return
        x = np.asarray(batch)
        axis = _normalise_axis(self._granularity.axis, x.ndim)
        assert self._min is not None
        if x.shape[axis] != self._min.shape[0]:
            raise DataError(
                f"given range has {self._min.shape[0]} channels, "
                f"the tensor has {x.shape[axis]} on axis {axis}"
            )
        self._axis = axis

    def update_min_max(self, lo: np.ndarray, hi: np.ndarray, axis: int | None = None) -> None:
        """As :meth:`update`: only the channel count and axis of the batch are checked."""
        if not isinstance(self._granularity, PerChannel):
            return
        assert self._min is not None
        channels = int(np.asarray(lo).size)
        if channels != self._min.shape[0]:
            raise DataError(
                f"given range has {self._min.shape[0]} channels, "
                f"the tensor has {channels} on axis {axis}"
            )
        self._axis = axis

    def state(self) -> MinMaxStats:
        """The given range."""
        if isinstance(self._granularity, PerChannel) and self._axis is None:
            raise EmptyStatisticsError(
                "a given per-channel range with a negative axis needs a batch to fix the axis"
            )
        return super().state()

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:  # pragma: no cover - never called
        raise AssertionError("FixedRangeObserver does not absorb batches")

    def merge(self, other: Observer) -> None:
        """Merging two observers of the same given range is a no-op."""
        peer = self._check_mergeable(other)
        assert self._min is not None and peer._min is not None and self._max is not None
        assert peer._max is not None
        if not (np.array_equal(self._min, peer._min) and np.array_equal(self._max, peer._max)):
            raise ConfigError("cannot merge observers with different given ranges")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedRangeObserver:
        """Rebuild from :meth:`to_dict` output."""
        state = data["state"]
        return cls(
            _decode_array(state["min"]).tolist(),
            _decode_array(state["max"]).tolist(),
            _decode_granularity(data["granularity"]),
        )


class PerTensorExtremesFeed:
    """Feeds many per-tensor observers the extremes of each batch at once, as arrays.

    The same as calling ``update_min_max(lows[i], highs[i])`` on observer ``i`` for every batch
    in data order (state bit for bit, and the first failing observer's error), at the cost of a
    few array operations per batch. :class:`MinMaxObserver` and
    :class:`MovingAverageMinMaxObserver` keep their running state here (elementwise float32
    operations round as the observers' own); it reaches the observers at :meth:`close`, and
    they must not be used before. Other observers (and one given twice) are updated one by one
    at each batch. Errors name the tensor (``tensor 'x': ...``); after one, the states are
    those of a failed calibration (unspecified).
    """

    def __init__(self, observers: Sequence[Observer], tensors: Sequence[str]) -> None:
        """Take over the running state of `observers` (per tensor), named `tensors` in errors."""
        self._observers = list(observers)
        self._tensors = list(tensors)
        n = len(self._observers)
        kinds = [_kept_kind(o) for o in self._observers]
        uses = Counter(id(o) for o in self._observers)
        shared = {i for i, count in uses.items() if count > 1}
        kinds = [None if id(o) in shared else k for o, k in zip(self._observers, kinds)]
        self._ema = np.array([k == "ema" for k in kinds], dtype=bool)
        self._kept = np.array([k is not None for k in kinds], dtype=bool)
        self._others = [i for i, k in enumerate(kinds) if k is None]
        policies = [getattr(o, "policy", DataPolicy()) for o in self._observers]
        self._nan_reject = np.array([p.nan == "reject" for p in policies], dtype=bool) & self._kept
        self._inf_reject = np.array([p.inf == "reject" for p in policies], dtype=bool) & self._kept
        self._rate = np.array(
            [o._c32 if k == "ema" else 0.0 for o, k in zip(self._observers, kinds)],  # type: ignore[attr-defined]
            dtype=_F32,
        )
        self._min = np.zeros(n, dtype=_F32)
        self._max = np.zeros(n, dtype=_F32)
        self._seen = np.zeros(n, dtype=bool)
        for i, observer in enumerate(self._observers):
            if kinds[i] is not None and observer._min is not None:  # type: ignore[attr-defined]
                self._min[i] = observer._min  # type: ignore[attr-defined]
                self._max[i] = observer._max  # type: ignore[attr-defined]
                self._seen[i] = True
        self._dirty = False

    def update(self, lows: np.ndarray, highs: np.ndarray, present: np.ndarray) -> None:
        """Fold one batch: float32 extremes per observer, `present` False where it was empty.

        Raises:
            QcalError: as the observer's ``update_min_max`` raises it, for the first observer
                (in order) that fails, with the tensor's name.
        """
        zero = _F32(0.0)
        lo = np.asarray(lows, dtype=_F32) + zero  # +0.0: signed zeros as update_min_max
        hi = np.asarray(highs, dtype=_F32) + zero
        present = np.asarray(present, dtype=bool)
        nan = (np.isnan(lo) | np.isnan(hi)) & self._nan_reject & present
        inf = (np.isinf(lo) | np.isinf(hi)) & self._inf_reject & present
        failing = np.flatnonzero(nan | inf)
        first = int(failing[0]) if failing.size else len(self._observers)
        for i in self._others:
            if i >= first:
                break
            if present[i]:
                try:
                    self._observers[i].update_min_max(lo[i], hi[i])  # type: ignore[attr-defined]
                except QcalError as err:
                    raise type(err)(f"tensor {self._tensors[i]!r}: {err}") from None
        if first < len(self._observers):
            problem = "NaN" if nan[first] else "an infinite value"
            raise DataError(
                f"tensor {self._tensors[first]!r}: calibration data contains {problem}"
            )
        take = present & self._kept
        fresh = take & ~self._seen
        running = take & self._seen
        with np.errstate(invalid="ignore", over="ignore"):
            ema = running & self._ema
            plain = running & ~self._ema
            self._min = np.where(plain, np.minimum(self._min, lo), self._min)
            self._max = np.where(plain, np.maximum(self._max, hi), self._max)
            self._min = np.where(ema, self._min + self._rate * (lo - self._min), self._min)
            self._max = np.where(ema, self._max + self._rate * (hi - self._max), self._max)
        self._min = np.where(fresh, lo, self._min)
        self._max = np.where(fresh, hi, self._max)
        self._seen |= take
        self._dirty = True

    def close(self) -> None:
        """Hand the running state over to the observers."""
        if not self._dirty:
            return
        for i in np.flatnonzero(self._seen & self._kept).tolist():
            observer = self._observers[i]
            observer._min, observer._max = self._min[i], self._max[i]
            observer._axis = None
        self._dirty = False


def _kept_kind(observer: Observer) -> str | None:
    """"min" or "ema" when :class:`PerTensorExtremesFeed` can keep the observer's state."""
    if not isinstance(getattr(observer, "granularity", None), PerTensor):
        return None
    state = getattr(observer, "_min", None)
    if state is not None and np.ndim(state) != 0:
        return None  # the observer's own update reports the shape mismatch
    if type(observer) is MinMaxObserver:
        return "min"
    if type(observer) is MovingAverageMinMaxObserver:
        return "ema"
    return None


_FROM_DICT: Mapping[str, Callable[[Mapping[str, Any]], Observer]] = {
    MinMaxObserver.kind: MinMaxObserver.from_dict,
    MovingAverageMinMaxObserver.kind: MovingAverageMinMaxObserver.from_dict,
    MindSporeObserver.kind: MindSporeObserver.from_dict,
    OneFlowMovingAverageObserver.kind: OneFlowMovingAverageObserver.from_dict,
    FixedRangeObserver.kind: FixedRangeObserver.from_dict,
}


def _histogram_from_dict(data: Mapping[str, Any]) -> Observer:
    # qcal.numerics.histogram builds on this module, so it is imported only when a histogram is loaded.
    from qcal.numerics.histogram import HistogramObserver

    return HistogramObserver.from_dict(data)


def observer_from_dict(data: Mapping[str, Any]) -> Observer:
    """Rebuild an observer saved with ``to_dict()``.

    Raises:
        ConfigError: unknown kind or unsupported version.
    """
    kind = data.get("kind")
    if kind == "histogram":
        return _histogram_from_dict(data)
    if kind not in _FROM_DICT:
        raise ConfigError(f"unknown observer kind {kind!r} in saved statistics")
    if data.get("version") != _STATE_VERSION:
        raise ConfigError(
            f"saved {kind} observer has version {data.get('version')!r}, expected {_STATE_VERSION}"
        )
    try:
        return _FROM_DICT[str(kind)](data)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"malformed saved {kind} observer: {err}") from None
