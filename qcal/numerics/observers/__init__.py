"""Observers: turn calibration batches into min/max statistics.

An observer only accumulates statistics; it knows nothing about integer types, scales or zero
points (those belong to :mod:`qcal.numerics.schemes`). Each observer follows one API's
range-tracking convention of SEMANTICS.md:

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

Saved states are rebuilt by :func:`qcal.numerics.observer_state.observer_from_dict`.
"""

from __future__ import annotations

from qcal.numerics.observers._base import (
    DataPolicy,
    Granularity,
    MinMaxStats,
    Observer,
    PerChannel,
    PerTensor,
    reduce_min_max,
)
from qcal.numerics.observers._feed import PerTensorExtremesFeed
from qcal.numerics.observers._frameworks import MindSporeObserver, OneFlowMovingAverageObserver
from qcal.numerics.observers._range import (
    FixedRangeObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
)

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
    "reduce_min_max",
]
