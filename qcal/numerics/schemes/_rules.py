"""The parameter rules: statistics and a scheme in, :class:`QParams` out, float32 throughout.

One private rule per scheme type (each citing its SEMANTICS.md section) and
:func:`compute_qparams`, the single entry point that picks the rule by scheme type and lets
degenerate inputs give their IEEE result without warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qcal.numerics.errors import DataError
from qcal.numerics.observers import MinMaxStats
from qcal.numerics.schemes._qparams import _F32, QParams, Rounding, round_float32
from qcal.numerics.schemes._schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    Scheme,
    TFScheme,
    TorchScheme,
)

__all__ = ["LEARNED_SCALE_MIN_ALPHA", "compute_qparams"]

_FLT_MAX = _F32(np.finfo(np.float32).max)
LEARNED_SCALE_MIN_ALPHA = _F32(1e-6)  # Ascend replaces |alpha| < 1e-6 with 1e-6 (§4.5)


def _require_ordered(stats: MinMaxStats) -> None:
    if np.any(stats.min > stats.max):  # NaN compares false and passes through
        raise DataError("statistics have min > max")


def _int64(values: np.ndarray) -> np.ndarray:
    """Integral float32 values as int64; non-finite entries (undefined in the API) become 0."""
    finite = np.isfinite(values)
    return np.where(finite, values, _F32(0.0)).astype(np.int64)


def _torch_qparams(stats: MinMaxStats, scheme: TorchScheme) -> QParams:
    """§1.3: 0 added to the range; symmetric ``max(-mn, mx) / ((qmax-qmin)/2)``, affine
    ``(mx - mn) / (qmax - qmin)`` with ``zp = clamp(qmin - rne(mn / s))``; both at least eps."""
    if stats.min.ndim == 0 and stats.min == np.inf and stats.max == -np.inf:
        # §1.3: an observer that saw nothing reports scale 1.0 and zero point 0.
        return QParams(_F32(1.0), np.int64(0), scheme.quant_min, scheme.quant_max, stats.axis)
    _require_ordered(stats)
    zero, eps = _F32(0.0), _F32(scheme.eps)
    mn, mx = np.minimum(stats.min, zero), np.maximum(stats.max, zero)
    qmin, qmax = scheme.quant_min, scheme.quant_max
    if scheme.symmetric:
        scale = np.maximum(np.maximum(-mn, mx) / _F32((qmax - qmin) / 2), eps)
        zero_point = np.full(scale.shape, scheme.symmetric_zero_point, dtype=np.int64)
    else:
        scale = np.maximum((mx - mn) / _F32(qmax - qmin), eps)
        zero_point = np.clip(qmin - _int64(np.rint(mn / scale)), qmin, qmax)
    return QParams(scale, zero_point, qmin, qmax, stats.axis)


def _horizon_qparams(stats: MinMaxStats, scheme: HorizonScheme) -> QParams:
    """§5.3: ``max(f32(max(max(-min, max), 0) / f32((qmax - qmin) / 2)), eps)``, zero point 0."""
    _require_ordered(stats)
    zero = _F32(0.0)
    half_range = _F32((scheme.quant_max - scheme.quant_min) / 2)
    magnitude = np.maximum(np.maximum(-stats.min, stats.max), zero)
    scale = np.maximum(magnitude / half_range, _F32(scheme.eps))
    zero_point = np.zeros(scale.shape, dtype=np.int64)
    return QParams(scale, zero_point, scheme.quant_min, scheme.quant_max, stats.axis)


def _tf_qparams(stats: MinMaxStats, scheme: TFScheme) -> QParams:
    """§2.3: the side needing the smaller multiplier keeps its end; the other is widened so
    that 0 is exact. Scale is the step; the kernel multiplies by ``multiplier``."""
    _require_ordered(stats)
    mn, mx = stats.min, stats.max
    qlo, qhi = _F32(scheme.quant_min), _F32(scheme.quant_max)
    m_lo = np.where(qlo * mn > 0, qlo / mn, _FLT_MAX)
    m_hi = np.where(qhi * mx > 0, qhi / mx, _FLT_MAX)
    use_lo = m_lo < m_hi  # the side needing the smaller multiplier keeps its end (§2.3)
    multiplier = np.where(use_lo, m_lo, m_hi).astype(_F32)
    step = np.where(use_lo, mn / qlo, mx / qhi).astype(_F32)
    adjusted_min = np.where(use_lo, mn, qlo * step).astype(_F32)
    adjusted_max = np.where(use_lo, qhi * step, mx).astype(_F32)
    extras = {"multiplier": multiplier, "adjusted_min": adjusted_min, "adjusted_max": adjusted_max}
    zero_point = np.zeros(step.shape, dtype=np.int64)
    return QParams(step, zero_point, scheme.quant_min, scheme.quant_max, stats.axis, extras)


def _oneflow_qparams(stats: MinMaxStats, scheme: OneFlowScheme) -> QParams:
    """§3.1/§3.3: symmetric ``max|x| / (2^(b-1)-1)``; affine ``(mx-mn) / (2^b-1)`` with the
    unclamped float ``zp = -R(mn / s)``; cambricon step ``2^(floor(log2 max|x|) - (b-2))``."""
    _require_ordered(stats)
    mn, mx = stats.min, stats.max
    b = scheme.quantization_bit
    extras: dict[str, np.ndarray] = {}
    if scheme.formula == "cambricon":
        shift = np.floor(np.log2(np.maximum(np.abs(mx), np.abs(mn)))) - _F32(b - 2)
        scale = _power_of_two(shift)
        zero_point = np.zeros(scale.shape, dtype=_F32)
        extras["shift"] = np.asarray(shift, dtype=_F32)
    elif scheme.symmetric:
        scale = np.maximum(np.abs(mx), np.abs(mn)) / _F32(2 ** (b - 1) - 1)
        zero_point = np.zeros(scale.shape, dtype=_F32)
    else:
        scale = (mx - mn) / _F32(2**b - 1)
        zero_point = -round_float32(mn / scale, scheme.zero_point_rounding)
    return QParams(
        scale,
        np.asarray(zero_point, dtype=_F32),
        scheme.quant_min,
        scheme.quant_max,
        stats.axis,
        extras,
    )


def _power_of_two(shift: np.ndarray) -> np.ndarray:
    """2**shift as float32 for an integral float32 shift; -inf -> 0, +inf -> inf, NaN -> NaN."""
    finite = np.isfinite(shift)
    exponent = np.clip(np.where(finite, shift, 0), -200, 200).astype(np.int64)
    power = np.ldexp(_F32(1.0), exponent).astype(_F32)
    return np.asarray(np.where(finite, power, np.exp2(shift)), dtype=_F32)


def _mindspore_qparams(stats: MinMaxStats, scheme: MindSporeScheme) -> QParams:
    """§4.3: nudged zero point on the unsigned grid, ``zp = rhu(clamp(qmin - mn/s))``."""
    _require_ordered(stats)
    zero = _F32(0.0)
    mn, mx = np.minimum(stats.min, zero), np.maximum(stats.max, zero)
    if scheme.symmetric:
        mx = np.maximum(-mn, mx)
        mn = -mx
    qmin, qmax = _F32(scheme.unsigned_min), _F32(scheme.unsigned_max)
    scale = (mx - mn) / (qmax - qmin)
    zp_from_min = qmin - mn / scale
    zero_point = round_float32(np.clip(zp_from_min, qmin, qmax), Rounding.HALF_UP)
    degenerate = scale == 0  # range [0, 0]: the CUDA guard gives zp = qmin and outputs 0 (§4.3)
    zero_point = np.where(degenerate, qmin, zero_point).astype(_F32)
    nudged_min = np.where(degenerate, zero, (qmin - zero_point) * scale).astype(_F32)
    nudged_max = np.where(degenerate, zero, (qmax - zero_point) * scale).astype(_F32)
    unsigned = _int64(zero_point)
    extras = {"zero_point_unsigned": unsigned, "nudged_min": nudged_min, "nudged_max": nudged_max}
    return QParams(
        scale, unsigned - scheme.offset, scheme.quant_min, scheme.quant_max, stats.axis, extras
    )


def _learned_scale_qparams(stats: MinMaxStats, scheme: LearnedScaleScheme) -> QParams:
    """§4.5: ``alpha = maxq`` with ``|alpha| < 1e-6`` replaced by 1e-6 (as the Ascend kernel
    computes), exported as ``scale = alpha / Qmax``, zero point 0."""
    _require_ordered(stats)
    zero = _F32(0.0)
    if scheme.neg_trunc:
        alpha = np.maximum(stats.max, zero)
    else:
        alpha = np.maximum(-stats.min, stats.max)
    alpha = np.where(np.abs(alpha) < LEARNED_SCALE_MIN_ALPHA, LEARNED_SCALE_MIN_ALPHA, alpha)
    alpha = np.asarray(alpha, dtype=_F32)
    scale = alpha / _F32(scheme.qmax_divisor)
    zero_point = np.zeros(scale.shape, dtype=np.int64)
    extras = {"alpha": np.asarray(alpha, dtype=_F32)}
    return QParams(scale, zero_point, scheme.quant_min, scheme.quant_max, stats.axis, extras)


_RULES: Mapping[type, Callable[[MinMaxStats, Any], QParams]] = {
    TorchScheme: _torch_qparams,
    HorizonScheme: _horizon_qparams,
    TFScheme: _tf_qparams,
    OneFlowScheme: _oneflow_qparams,
    MindSporeScheme: _mindspore_qparams,
    LearnedScaleScheme: _learned_scale_qparams,
}


def compute_qparams(stats: MinMaxStats, scheme: Scheme) -> QParams:
    """Scale and zero point of ``scheme`` for ``stats``: pure, deterministic, float32 throughout.

    Degenerate inputs give the API's IEEE result (a zero or infinite scale, a NaN or infinite
    zero point) rather than an error; the ONNX export replaces and reports them (§7).

    Raises:
        DataError: ``min > max`` in the statistics.
    """
    rule = _RULES.get(type(scheme))
    if rule is None:
        raise TypeError(f"no parameter rule for scheme {type(scheme).__name__}")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        return rule(stats, scheme)
