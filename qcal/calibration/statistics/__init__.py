"""Statistics as files: what a collection gathered, saved, read back, merged.

A statistics file holds, per observed tensor, the state of its observers (the preset's range
observer and a streaming histogram), with the model's SHA-256, the options that decide what is
observed (the plan), the sample count and an order-invariant fingerprint of the data. Its
layout is in `_format` (and the README), the fingerprint in `_fingerprint`, the per-tensor
observers in `_observers`, the value and its merge in `_statistics`; `_exchange` writes and
reads activation ranges in TensorRT's and onnxruntime's formats.
"""

from __future__ import annotations

from qcal.calibration.statistics._exchange import (
    FORMATS as RANGE_FORMATS,
)
from qcal.calibration.statistics._exchange import (
    format_ranges,
    ranges_of_tensors,
    read_ranges,
    write_ranges,
)
from qcal.calibration.statistics._fingerprint import Fingerprint, FingerprintedSource
from qcal.calibration.statistics._format import FORMAT, VERSION
from qcal.calibration.statistics._observers import HISTOGRAM, ObserverPair, observer_pair, split
from qcal.calibration.statistics._statistics import Statistics, merge_statistics, read_statistics

__all__ = [
    "FORMAT",
    "HISTOGRAM",
    "RANGE_FORMATS",
    "VERSION",
    "Fingerprint",
    "FingerprintedSource",
    "ObserverPair",
    "Statistics",
    "format_ranges",
    "merge_statistics",
    "observer_pair",
    "ranges_of_tensors",
    "read_ranges",
    "read_statistics",
    "split",
    "write_ranges",
]
