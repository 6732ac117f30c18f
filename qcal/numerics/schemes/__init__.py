"""Quantization schemes, and the one function that turns statistics into scale and zero point.

A scheme is a frozen description of one API's integer grid and parameter rule; it never sees a
batch. :func:`compute_qparams` is pure and is the only place scale and zero point are computed
(calibration and the reference fake-quant both call it). Every step is float32, in the order
SEMANTICS.md gives, because float64 differs near rounding boundaries (§0).

Schemes (one per API convention, each citing its SEMANTICS.md section):

* :class:`TorchScheme` (§1.1, §1.3), :class:`HorizonScheme` (§5.1, §5.3),
* :class:`TFScheme` (§2.1, §2.3), :class:`OneFlowScheme` (§3.1, §3.3),
* :class:`MindSporeScheme` (§4.1, §4.3), :class:`LearnedScaleScheme` (§4.5).

``QParams.scale`` is always the step between adjacent codes (the ONNX meaning). Where an API
reports something else, it is in ``extras`` (OneFlow cambricon's shift exponent, TF's multiplier).
"""

from __future__ import annotations

from qcal.numerics.schemes._qparams import TORCH_EPS, QParams, Rounding, round_float32
from qcal.numerics.schemes._rules import LEARNED_SCALE_MIN_ALPHA, compute_qparams
from qcal.numerics.schemes._schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    Scheme,
    TFScheme,
    TorchScheme,
)

__all__ = [
    "LEARNED_SCALE_MIN_ALPHA",
    "TORCH_EPS",
    "HorizonScheme",
    "LearnedScaleScheme",
    "MindSporeScheme",
    "OneFlowScheme",
    "QParams",
    "Rounding",
    "Scheme",
    "TFScheme",
    "TorchScheme",
    "compute_qparams",
    "round_float32",
]
