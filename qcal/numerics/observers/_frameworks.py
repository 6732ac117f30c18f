"""Observers that follow one framework's own range tracking: MindSpore and OneFlow.

Both keep an order-dependent running state with the framework's float32 rounding, bit for bit
(SEMANTICS.md §4.2 and §3.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.observers._base import (
    _F32,
    DataPolicy,
    Granularity,
    MinMaxStats,
    PerChannel,
    PerTensor,
    _decode_array,
    _decode_granularity,
    _encode_array,
    reduce_min_max,
)
from qcal.numerics.observers._range import _RangeObserver

__all__ = ["MindSporeObserver", "OneFlowMovingAverageObserver"]


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
