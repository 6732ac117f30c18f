"""What a statistics file holds per tensor: observers by the range methods they serve.

A collection keeps, per observed tensor, the preset's range observer (``minmax`` or
``moving-average``) and, unless told not to, a streaming histogram (which serves ``percentile``,
``entropy`` and ``mse``). :class:`ObserverPair` feeds both from one pass; their states are saved
with ``to_dict`` and rebuilt with ``observer_from_dict``, the histograms' bin keys and counts as
int64 arrays beside the JSON header.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from qcal.numerics.errors import ConfigError, DataError, StatisticsError
from qcal.numerics.histogram import HistogramObserver
from qcal.numerics.observer_state import observer_from_dict
from qcal.numerics.observers import Observer

__all__ = ["HISTOGRAM", "ObserverPair", "decode_observers", "encode_observers", "merge_observers", "observer_pair", "split"]

HISTOGRAM = "histogram"  # the key of a tensor's histogram; range observers are keyed by method
_KEYS = (HISTOGRAM, "minmax", "moving-average")


class ObserverPair:
    """A range observer and a histogram of the same tensor, fed by one pass over the data.

    To the collection loop it is a whole-array observer that takes the batch's extremes computed
    in the graph: the range observer gets those extremes (as it would alone, through
    ``update_min_max``), the histogram the array and the extremes.
    """

    takes_batch_extremes = True
    is_order_dependent: ClassVar[bool] = False

    def __init__(self, range_observer: Observer, histogram: HistogramObserver) -> None:
        self.range_observer, self.histogram = range_observer, histogram

    def update(self, batch: np.ndarray, *, extremes: tuple[Any, Any] | None = None) -> None:
        if extremes is None:
            self.range_observer.update(batch)
            self.histogram.update(batch)
        else:
            self.range_observer.update_min_max(*extremes)  # type: ignore[attr-defined]
            self.histogram.update(batch, extremes=extremes)

    def merge(self, other: Observer) -> None:  # pragma: no cover - files merge their parts
        raise ConfigError("observer pairs are merged through their parts")

    def state(self) -> Any:
        return self.range_observer.state()

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - files save their parts
        raise ConfigError("observer pairs are saved through their parts")


class _OrderedObserverPair(ObserverPair):
    """A pair whose range observer depends on the order of the batches (a moving average)."""

    is_order_dependent: ClassVar[bool] = True


def observer_pair(range_observer: Observer, histogram: HistogramObserver) -> ObserverPair:
    """The pair of `range_observer` and `histogram`, order-dependent as its range observer."""
    if range_observer.is_order_dependent:
        return _OrderedObserverPair(range_observer, histogram)
    return ObserverPair(range_observer, histogram)


def split(observer: Observer, method: str) -> dict[str, Observer]:
    """A collected tensor's observers keyed as in the file."""
    if isinstance(observer, ObserverPair):
        return {method: observer.range_observer, HISTOGRAM: observer.histogram}
    if isinstance(observer, HistogramObserver):
        return {HISTOGRAM: observer}
    return {method: observer}


def encode_observers(
    prefix: str, observers: Mapping[str, Observer], arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
    """JSON states of `observers`; their integer lists go to `arrays` as ``<prefix>.<key>.<field>``."""
    encoded: dict[str, Any] = {}
    for key in sorted(observers):
        data = observers[key].to_dict()
        state = data.get("state")
        if isinstance(state, dict):
            state = dict(state)
            for name, value in sorted(state.items()):
                if isinstance(value, list) and value and all(
                        isinstance(v, int) and not isinstance(v, bool) for v in value):
                    ref = f"{prefix}.{key}.{name}"
                    arrays[ref] = np.asarray(value, dtype="<i8")
                    state[name] = {"array": ref}
            data["state"] = state
        encoded[key] = data
    return encoded


def decode_observers(
    entry: Mapping[str, Any], arrays: Mapping[str, np.ndarray], origin: str
) -> dict[str, Observer]:
    """The observers of one tensor entry of a file."""
    found: dict[str, Observer] = {}
    for key, data in sorted(entry.items()):
        if not isinstance(data, dict):
            raise StatisticsError(f"{origin}: malformed {key} observer")
        state = data.get("state")
        if isinstance(state, dict):
            state = dict(state)
            for name, value in state.items():
                if isinstance(value, dict) and set(value) == {"array"}:
                    array = arrays.get(str(value["array"]))
                    if array is None or array.dtype.kind not in "iu" or array.ndim != 1:
                        raise StatisticsError(f"{origin}: array {value['array']!r} is missing "
                                              "or not a vector of integers")
                    state[name] = array.astype(np.int64)
            data = {**data, "state": state}
        if key not in _KEYS:
            raise StatisticsError(f"{origin}: unknown observer key {key!r}")
        try:
            observer = observer_from_dict(data)
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError, IndexError,
                OverflowError) as err:  # what observer_from_dict meets in a damaged state
            raise StatisticsError(f"{origin}: malformed {key} observer ({err})") from None
        if isinstance(observer, HistogramObserver) != (key == HISTOGRAM):
            raise StatisticsError(f"{origin}: the {key} observer is a {type(observer).__name__}")
        found[key] = observer
    return found


def merge_observers(into: Mapping[str, Observer], other: Mapping[str, Observer], where: str) -> None:
    """Fold `other`'s observers into `into`'s (same keys), exactly; order-dependent ones refuse."""
    if set(into) != set(other):
        raise StatisticsError(f"{where}: the files hold different observers "
                              f"({', '.join(sorted(into))} / {', '.join(sorted(other))})")
    for key, observer in into.items():
        if observer.is_order_dependent:
            raise StatisticsError(
                f"{where}: {key} statistics ({type(observer).__name__}) depend on the order of "
                "the batches and cannot be merged; collect them in one run, or collect "
                "--method minmax (with histograms) for shards")
        try:
            observer.merge(other[key])
        except (ConfigError, DataError) as err:
            raise StatisticsError(f"{where}: {err}") from None
