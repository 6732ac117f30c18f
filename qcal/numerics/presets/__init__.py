"""Named presets: one framework's quantization semantics, configured with that API's own knobs.

A preset is data: a description, its knobs (API names, defaults and checks) and a small builder
that turns resolved knobs into two :class:`TensorRecipe` objects, one for activations and one for
weights (SEMANTICS.md §8). A recipe holds the scheme, the observers the API offers and the axes
on which it allows per-channel parameters; it computes parameters, fake-quantizes and maps to
ONNX by calling :mod:`qcal.numerics.schemes`, :mod:`qcal.numerics.fakequant` and
:mod:`qcal.numerics.onnx_mapping`.

Observer methods: ``"minmax"`` is the running extreme over all calibration data (0-forcing, if the
API has it, happens when parameters are computed); ``"moving-average"`` is the API's EMA
convention fed in data order. Each preset also says which of the two its API does natively.
Besides the knobs of §8, PyTorch, Horizon and OneFlow presets accept ``observer``, the API's
observer class name, which selects the native method (and, for OneFlow, the zero-point rounding
of ``MovingAverageMinMaxObserver``).
"""

from __future__ import annotations

from qcal.numerics.presets._registry import PRESETS, build_preset
from qcal.numerics.presets._types import METHODS, Knob, Preset, PresetSpec, TensorRecipe

__all__ = [
    "METHODS",
    "PRESETS",
    "Knob",
    "Preset",
    "PresetSpec",
    "TensorRecipe",
    "build_preset",
]
