"""Accuracy: how good the quantized model is, and what to keep float when it is not.

Owns the float-vs-quantized comparison, per-tensor sensitivity, MAC coverage, the float
fallback search and the CI gates.

May import: `qcal.numerics`, `qcal.graph`, `qcal.calibration`.
"""
