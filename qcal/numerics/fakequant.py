"""Reference fake-quantization (quantize then dequantize) in numpy, bit-exact per API.

Each function follows one API's formula and float32 operation order from SEMANTICS.md:
PyTorch §1.4, TensorFlow §2.4, OneFlow §3.2, MindSpore §4.4/§4.5 and Horizon §5.4. Parameters come
from :func:`qcal.numerics.schemes.compute_qparams`; nothing here computes a scale.

:func:`quantize` gives the integer codes of the ONNX QDQ representation (used to pre-quantize
weights): the API's own codes, re-expressed against the ONNX zero point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qcal.numerics.errors import DataError
from qcal.numerics.onnx_mapping import ONNX_CODE_LIMITS, OnnxQParams, degenerate_mask
from qcal.numerics.schemes import (
    LEARNED_SCALE_MIN_ALPHA,
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    QParams,
    Rounding,
    Scheme,
    TFScheme,
    TorchScheme,
    round_float32,
)

__all__ = ["fake_quantize", "quantize"]

_F32 = np.float32
_EXACT_F32_INT = 2**24  # integers up to this magnitude are exact in float32


def _along(values: np.ndarray, x: np.ndarray, axis: int | None) -> np.ndarray:
    """Reshape per-channel ``values`` (C,) to broadcast along ``axis`` of ``x``."""
    values = np.asarray(values)
    if values.ndim == 0:
        return values
    if axis is None:
        raise DataError("per-channel parameters have no channel axis")
    if not 0 <= axis < x.ndim or x.shape[axis] != values.shape[0]:
        raise DataError(
            f"per-channel parameters for {values.shape[0]} channels on axis {axis} "
            f"do not fit a tensor of shape {x.shape}"
        )
    shape = [1] * x.ndim
    shape[axis] = values.shape[0]
    return values.reshape(shape)


def _params(x: np.ndarray, qparams: QParams, name: str) -> np.ndarray:
    """A parameter array (``scale``, ``zero_point`` or an extra) shaped to broadcast against x."""
    fields = {"scale": qparams.scale, "zero_point": qparams.zero_point}
    return _along(fields[name] if name in fields else qparams.extras[name], x, qparams.axis)


def _clamp(q: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Clamp integral float32 codes; NaN propagates (``std::min/max`` and ``torch.clamp``)."""
    return np.asarray(np.clip(q, _F32(qmin), _F32(qmax)))


# ---------------------------------------------------------------------------------------------
# API codes: integral float32 codes q such that the API dequantizes from q


def _torch_codes(x: np.ndarray, qparams: QParams) -> np.ndarray:
    """§1.4: ``q = clamp(f32(f32(z) + rne(f32(x * f32(1/s)))), qmin, qmax)``; NaN -> qmin."""
    scale = _params(x, qparams, "scale")
    inverse = _F32(1.0) / scale
    shifted = _params(x, qparams, "zero_point").astype(_F32) + np.rint(x * inverse)
    qmin, qmax = qparams.quant_min, qparams.quant_max
    if max(-qmin, qmax) <= _EXACT_F32_INT:
        # fmax/fmin ignore NaN, so NaN lands on qmin as in the kernel's std::fmax(qval, qmin).
        return np.asarray(np.fmin(np.fmax(shifted, _F32(qmin)), _F32(qmax)))
    # qint32 limits are not float32 numbers: the kernel compares in double.
    wide = np.fmin(np.fmax(shifted.astype(np.float64), float(qmin)), float(qmax))
    return np.asarray(wide)  # float64 integral codes, converted by the caller


def _torch_fake_quantize(x: np.ndarray, qparams: QParams, scheme: TorchScheme) -> np.ndarray:
    codes = _torch_codes(x, qparams)
    zero_point = _params(x, qparams, "zero_point")
    # (qval - z) is an int64 difference converted to float32, then multiplied by s in float32.
    if codes.dtype == np.float64:
        difference = (codes.astype(np.int64) - zero_point).astype(_F32)
    else:
        difference = codes - zero_point.astype(_F32)
    return np.asarray(difference * _params(x, qparams, "scale"), dtype=_F32)


def _horizon_codes(x: np.ndarray, qparams: QParams, scheme: HorizonScheme) -> np.ndarray:
    """§5.4: ``q = clamp(R(f32(x / s)), qmin, qmax)``."""
    t = x / _params(x, qparams, "scale")
    return _clamp(round_float32(t, scheme.rounding), qparams.quant_min, qparams.quant_max)


def _horizon_fake_quantize(x: np.ndarray, qparams: QParams, scheme: HorizonScheme) -> np.ndarray:
    return np.asarray(_horizon_codes(x, qparams, scheme) * _params(x, qparams, "scale"), dtype=_F32)


def _tf_codes(x: np.ndarray, qparams: QParams, scheme: TFScheme) -> np.ndarray:
    """§2.4: ``R(f32(v * mult))``; v is x clamped to the adjusted range only when it was given."""
    if scheme.range_given:
        lo, hi = _params(x, qparams, "adjusted_min"), _params(x, qparams, "adjusted_max")
        x = np.maximum(np.minimum(x, hi), lo)
    return round_float32(x * _params(x, qparams, "multiplier"), scheme.rounding)


def _tf_fake_quantize(x: np.ndarray, qparams: QParams, scheme: TFScheme) -> np.ndarray:
    return np.asarray(_tf_codes(x, qparams, scheme) * _params(x, qparams, "scale"), dtype=_F32)


def _oneflow_codes(x: np.ndarray, qparams: QParams, scheme: OneFlowScheme) -> np.ndarray:
    """§3.2: symmetric/cambricon ``rne(f32(x/s))``; affine ``rne(f32(f32(x/s) + z))``, clamped."""
    t = x / _params(x, qparams, "scale")  # for cambricon, scale is already 2**int(shift)
    if not scheme.symmetric:
        t = t + _params(x, qparams, "zero_point")  # the float zero point enters before rounding
    return _clamp(np.rint(t), qparams.quant_min, qparams.quant_max)


def _oneflow_fake_quantize(x: np.ndarray, qparams: QParams, scheme: OneFlowScheme) -> np.ndarray:
    codes = _oneflow_codes(x, qparams, scheme)
    if not scheme.symmetric:
        codes = codes - _params(x, qparams, "zero_point")
    return np.asarray(codes * _params(x, qparams, "scale"), dtype=_F32)


def _mindspore_codes(x: np.ndarray, qparams: QParams, scheme: MindSporeScheme) -> np.ndarray:
    """§4.4: codes counted from the nudged minimum, ``q = rhu(f32(f32(xc - nudged_min) / s))``."""
    nudged_min = _params(x, qparams, "nudged_min")
    clamped = np.maximum(np.minimum(x, _params(x, qparams, "nudged_max")), nudged_min)
    return round_float32((clamped - nudged_min) / _params(x, qparams, "scale"), Rounding.HALF_UP)


def _mindspore_fake_quantize(
    x: np.ndarray, qparams: QParams, scheme: MindSporeScheme
) -> np.ndarray:
    scale = _params(x, qparams, "scale")
    out = _mindspore_codes(x, qparams, scheme) * scale + _params(x, qparams, "nudged_min")
    # scale 0 only for the range [0, 0]: the CUDA guard outputs 0 (§4.3).
    return np.asarray(np.where(scale == 0, _F32(0.0), out), dtype=_F32)


def _learned_alpha(x: np.ndarray, qparams: QParams) -> np.ndarray:
    alpha = _params(x, qparams, "alpha")
    return np.where(
        np.abs(alpha) < LEARNED_SCALE_MIN_ALPHA, LEARNED_SCALE_MIN_ALPHA, alpha
    ).astype(_F32)


def _learned_scale_codes(x: np.ndarray, qparams: QParams, scheme: LearnedScaleScheme) -> np.ndarray:
    """§4.5: ``q = rhu(f32(clamp(f32(x / alpha), lo, 1) * Qmax))``; lo 0 with neg_trunc, else -1."""
    ratio = x / _learned_alpha(x, qparams)
    lower = _F32(0.0) if scheme.neg_trunc else _F32(-1.0)
    clipped = np.minimum(np.maximum(ratio, lower), _F32(1.0))
    return round_float32(clipped * _F32(scheme.qmax_divisor), Rounding.HALF_UP)


def _learned_scale_fake_quantize(
    x: np.ndarray, qparams: QParams, scheme: LearnedScaleScheme
) -> np.ndarray:
    codes = _learned_scale_codes(x, qparams, scheme)
    return np.asarray((codes / _F32(scheme.qmax_divisor)) * _learned_alpha(x, qparams), dtype=_F32)


_FAKE_QUANT: Mapping[type, Callable[[np.ndarray, QParams, Any], np.ndarray]] = {
    TorchScheme: _torch_fake_quantize,
    HorizonScheme: _horizon_fake_quantize,
    TFScheme: _tf_fake_quantize,
    OneFlowScheme: _oneflow_fake_quantize,
    MindSporeScheme: _mindspore_fake_quantize,
    LearnedScaleScheme: _learned_scale_fake_quantize,
}


def _torch_codes_for(x: np.ndarray, qparams: QParams, scheme: TorchScheme) -> np.ndarray:
    return _torch_codes(x, qparams)


def _mindspore_signed_codes(x: np.ndarray, qparams: QParams, scheme: MindSporeScheme) -> np.ndarray:
    # Counted from qmin (unsigned), so the signed code is q + quant_min; it dequantizes against
    # the signed zero point: (q + qmin_s - zp_s) * s = (q + qmin_u - zp_u) * s.
    return np.asarray(_mindspore_codes(x, qparams, scheme) + _F32(qparams.quant_min))


# Codes in the QParams convention: the API output is (about) (code - zero_point) * scale.
_CODES: Mapping[type, Callable[[np.ndarray, QParams, Any], np.ndarray]] = {
    TorchScheme: _torch_codes_for,
    HorizonScheme: _horizon_codes,
    TFScheme: _tf_codes,
    OneFlowScheme: _oneflow_codes,
    MindSporeScheme: _mindspore_signed_codes,
    LearnedScaleScheme: _learned_scale_codes,
}


def _as_float32(x: np.ndarray) -> np.ndarray:
    array = np.asarray(x)
    if array.dtype.kind not in "fiub":
        raise DataError(f"cannot fake-quantize a tensor of dtype {array.dtype}")
    return np.asarray(array, dtype=_F32)


def fake_quantize(x: np.ndarray, qparams: QParams, scheme: Scheme) -> np.ndarray:
    """Quantize then dequantize ``x`` exactly as ``scheme``'s API does, in float32.

    Per-channel parameters broadcast along ``qparams.axis``.

    Raises:
        DataError: per-channel parameters do not fit the tensor.
    """
    rule = _FAKE_QUANT.get(type(scheme))
    if rule is None:
        raise TypeError(f"no fake-quant rule for scheme {type(scheme).__name__}")
    data = _as_float32(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        return rule(data, qparams, scheme)


def quantize(
    x: np.ndarray, qparams: QParams, scheme: Scheme, onnx_qparams: OnnxQParams
) -> np.ndarray:
    """Integer codes of ``x`` for the ONNX representation ``onnx_qparams`` of ``qparams``.

    The codes are the API's own (its rounding and clamping), shifted from the API's zero point to
    the ONNX zero point, so ``DequantizeLinear`` gives ``(code - onnx_zp) * onnx_scale``, equal to
    (or, where the mapping is not exact, close to) :func:`fake_quantize`. Where a degenerate
    scale was replaced (§7) every code is the ONNX zero point, which dequantizes to 0.

    Returns:
        An array of the ONNX type's numpy dtype (int4/uint4 held in int8/uint8).
    """
    rule = _CODES.get(type(scheme))
    if rule is None:
        raise TypeError(f"no quantize rule for scheme {type(scheme).__name__}")
    data = _as_float32(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        codes = np.asarray(rule(data, qparams, scheme), dtype=np.float64)
    api_zero_point = _along(np.asarray(qparams.zero_point, dtype=np.float64), data, qparams.axis)
    onnx_zero_point = _along(onnx_qparams.zero_point.astype(np.float64), data, qparams.axis)
    shifted = codes - api_zero_point + onnx_zero_point
    lo, hi = ONNX_CODE_LIMITS[onnx_qparams.dtype]
    shifted = np.where(np.isnan(shifted), onnx_zero_point, shifted)
    degenerate = _along(degenerate_mask(qparams), data, qparams.axis)
    shifted = np.where(degenerate, onnx_zero_point, shifted)
    return np.asarray(np.clip(shifted, lo, hi).astype(onnx_qparams.zero_point.dtype))
