"""Numerics: statistics in, quantization parameters out; nothing here knows about graphs.

Owns the observers (min/max, moving averages, the framework-specific ones), the histogram
observer and range selection (percentile, entropy, MSE), the schemes that turn ranges into scale
and zero-point, the framework presets, the reference fake-quant, the mapping of parameters onto
ONNX types and rounding, and the error hierarchy every wing raises.

May import: numpy and the standard library only (no other qcal wing).
"""
