"""Rebuilding any observer, histogram included, from its saved ``to_dict()`` state.

It sits above both :mod:`qcal.numerics.observers` and :mod:`qcal.numerics.histogram` (the
histogram observer builds on the observers), so that neither imports the other in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram import HistogramObserver
from qcal.numerics.observers import (
    FixedRangeObserver,
    MindSporeObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
    OneFlowMovingAverageObserver,
)
from qcal.numerics.observers._base import _STATE_VERSION

__all__ = ["observer_from_dict"]


_FROM_DICT: Mapping[str, Callable[[Mapping[str, Any]], Observer]] = {
    MinMaxObserver.kind: MinMaxObserver.from_dict,
    MovingAverageMinMaxObserver.kind: MovingAverageMinMaxObserver.from_dict,
    MindSporeObserver.kind: MindSporeObserver.from_dict,
    OneFlowMovingAverageObserver.kind: OneFlowMovingAverageObserver.from_dict,
    FixedRangeObserver.kind: FixedRangeObserver.from_dict,
}


def _histogram_from_dict(data: Mapping[str, Any]) -> Observer:
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
