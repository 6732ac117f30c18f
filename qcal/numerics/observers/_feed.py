"""Feeding many per-tensor observers at once from arrays of batch extremes.

Calibration reduces every tensor's batch in the onnxruntime graph; :class:`PerTensorExtremesFeed`
folds the extremes of all tensors with a few array operations instead of one call per observer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from qcal.numerics.errors import DataError, QcalError
from qcal.numerics.observers._base import _F32, DataPolicy, Observer, PerTensor
from qcal.numerics.observers._range import MinMaxObserver, MovingAverageMinMaxObserver

__all__ = ["PerTensorExtremesFeed"]


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
