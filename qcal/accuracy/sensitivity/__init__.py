"""Per-tensor sensitivity: how much the model outputs move when one tensor alone is quantized.

The method (switch model, screening, refinement, the figures kept) is described in `_measure`,
which runs it; `_blocks` measures blocks of tensors instead, halving the harmful ones; `_models`
builds the two models they run (probe and switch); `_results` holds the figures per tensor and
the sums they are computed from.
"""

from __future__ import annotations

from qcal.accuracy.sensitivity._blocks import BlockHarm, measure_blocks
from qcal.accuracy.sensitivity._measure import _NEGLIGIBLE as _NEGLIGIBLE
from qcal.accuracy.sensitivity._measure import SCREEN_FRACTION as SCREEN_FRACTION
from qcal.accuracy.sensitivity._measure import measure_sensitivity
from qcal.accuracy.sensitivity._models import _Models as _Models
from qcal.accuracy.sensitivity._results import (
    SensitivityResult,
    TensorSensitivity,
    noise_ratio_db,
)

__all__ = ["BlockHarm", "SensitivityResult", "TensorSensitivity", "measure_blocks",
           "measure_sensitivity", "noise_ratio_db"]
