"""Histogram calibration: a streaming, mergeable histogram observer and range selection.

* :class:`HistogramObserver` counts every batch into fixed-resolution bins keyed on the float32
  bit pattern (sign, exponent, top mantissa bits) and drops it. Memory is bounded by the bin
  count; the state is the same, bit for bit, for any sample order, batching or merge of shards.
  Calibration is a single pass over the data.
* :func:`percentile_range`, :func:`entropy_range` and :func:`mse_range` (or
  :func:`select_range` by name) choose a range from the histogram's state. Each returns a
  :class:`RangeSelection` whose ``stats`` feeds the preset's ``compute_qparams``.

Approximation: each value is known to within its bin, a relative width of
``2**-mantissa_bits`` (0.39 % by default). Methods that need a uniform histogram (entropy) or
bin masses (mse) spread each bin's count uniformly over its interval, clipped to the exact
observed extremes, so no value moves by more than its bin's width.
"""

from __future__ import annotations

from qcal.numerics.histogram._compact import (
    CANDIDATE_PERCENTILES,
    PLOT_BINS,
    CompactHistogram,
    compact_histogram,
)
from qcal.numerics.histogram._distribution import (
    Distribution,
    abs_distribution,
    signed_distribution,
)
from qcal.numerics.histogram._entropy import entropy_divergences, entropy_range
from qcal.numerics.histogram._mse import mse_range
from qcal.numerics.histogram._observer import DEFAULT_MANTISSA_BITS, HistogramObserver
from qcal.numerics.histogram._percentile import percentile_range
from qcal.numerics.histogram._result import QuantRecipe, RangeSelection
from qcal.numerics.histogram._select import RANGE_METHODS, select_range
from qcal.numerics.histogram._snapshot import Histogram

__all__ = [
    "CANDIDATE_PERCENTILES",
    "DEFAULT_MANTISSA_BITS",
    "PLOT_BINS",
    "RANGE_METHODS",
    "CompactHistogram",
    "Distribution",
    "Histogram",
    "HistogramObserver",
    "QuantRecipe",
    "RangeSelection",
    "abs_distribution",
    "compact_histogram",
    "entropy_divergences",
    "entropy_range",
    "mse_range",
    "percentile_range",
    "select_range",
    "signed_distribution",
]
