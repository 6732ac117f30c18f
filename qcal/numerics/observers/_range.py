"""The min/max-tracking observers: running extreme, moving average and a given range.

:class:`_RangeObserver` holds what they share (granularity, data policy, float32 min/max state,
serialisation); :class:`MinMaxObserver`, :class:`MovingAverageMinMaxObserver` and
:class:`FixedRangeObserver` differ only in how a batch's extremes are folded in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError
from qcal.numerics.observers._base import (
    _F32,
    _STATE_VERSION,
    DataPolicy,
    Granularity,
    MinMaxStats,
    Observer,
    PerChannel,
    PerTensor,
    _check_values,
    _decode_array,
    _decode_granularity,
    _encode_array,
    _encode_granularity,
    _normalise_axis,
    reduce_min_max,
)

__all__ = ["FixedRangeObserver", "MinMaxObserver", "MovingAverageMinMaxObserver"]

logger = logging.getLogger(__name__)


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
