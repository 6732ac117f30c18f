"""Map an API's quantization parameters onto ONNX QuantizeLinear/DequantizeLinear (SEMANTICS.md §7).

``QuantizeLinear`` computes ``saturate(rne(x / scale) + zero_point)`` over the *full* range of its
output type, and ``DequantizeLinear`` computes ``(q - zero_point) * scale``. A preset maps onto a
QDQ pair exactly when its codes span the whole type, it rounds half to even, divides by the scale
(or equivalent) and dequantizes as ``(q - zp) * s``. :func:`to_onnx_qparams` picks the type, the
float bounds that emulate a narrower integer range (``clip_min``/``clip_max``: clipping the input
to the dequantized limits gives the same codes as clamping the integers), and lists every way the
QDQ pair differs from the API's fake-quant.

Two near-equivalences count as exact, as the SEMANTICS.md §7 table does: PyTorch multiplies by
``f32(1/s)`` and TensorFlow by a multiplier that is not exactly ``1/step``, and OneFlow rounds
``x/s + zp`` as a whole. Each differs from ONNX by one code only within an ulp of a rounding
tie.

Type choice: int8/uint8 (plus clip bounds for narrower ranges) by default. The 4-bit and 16-bit
types need opset 21; they are used only when the caller passes ``opset >= 21``: int4/uint4 for
ranges that are exactly 4-bit, int16/uint16 for ranges wider than 8 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto

from qcal.numerics.errors import ConfigError
from qcal.numerics.schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    QParams,
    Rounding,
    Scheme,
    TFScheme,
    TorchScheme,
)

__all__ = [
    "DEFAULT_OPSET",
    "ONNX_CODE_LIMITS",
    "OnnxQParams",
    "degenerate_mask",
    "qdq_round_trip",
    "to_onnx_qparams",
]

_F32 = np.float32
DEFAULT_OPSET = 13
_SMALL_TYPES_OPSET = 21  # int4/uint4/int16/uint16 QuantizeLinear outputs

ONNX_CODE_LIMITS: Mapping[int, tuple[int, int]] = {
    TensorProto.INT4: (-8, 7),
    TensorProto.UINT4: (0, 15),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.UINT16: (0, 65535),
}
_ZERO_POINT_DTYPES: Mapping[int, type[np.integer[Any]]] = {
    TensorProto.INT4: np.int8,
    TensorProto.UINT4: np.uint8,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
}
_HALF_UP = "rounds half up; ONNX rounds half to even (codes differ at exact ties)"


@dataclass(frozen=True, eq=False)
class OnnxQParams:
    """What the QDQ writer emits for one tensor.

    Attributes:
        dtype: onnx.TensorProto.{INT8, UINT8, INT16, UINT16, INT4, UINT4}.
        scale: float32, shape () or (C,); finite and > 0.
        zero_point: numpy integer array of the type (int4/uint4 held as int8/uint8), scale's shape.
        axis: per-axis QuantizeLinear axis, None per tensor.
        clip_min: float32 lower bound emulating a narrower integer range, or None.
        clip_max: float32 upper bound, or None. Per channel these have shape (C,) and need a
            broadcasting Max/Min rather than Clip, whose bounds are scalars.
        exact: the QDQ pair reproduces the API's fake-quant bit for bit.
        deviations: why not exact, one short sentence each.
        replacement: what degenerate parameters were replaced (§7), or None.
        min_opset: 10 per-tensor 8-bit, 13 per-axis 8-bit, 21 for 4-bit and 16-bit types.
    """

    dtype: int
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    clip_min: np.ndarray | None
    clip_max: np.ndarray | None
    exact: bool
    deviations: tuple[str, ...]
    replacement: str | None
    min_opset: int


@dataclass(frozen=True)
class _Grid:
    """An API's integer grid in ONNX terms: codes [low, high] against ``zero_point``."""

    scale: np.ndarray
    zero_point: np.ndarray  # float64, integral where finite
    low: int
    high: int
    deviations: tuple[str, ...]


def qdq_round_trip(x: np.ndarray, scale: float, zero_point: int, low: int, high: int
                   ) -> np.ndarray:
    """``x`` through a per-tensor QuantizeLinear and its DequantizeLinear, as ONNX computes
    them in float32: ``x / scale`` rounded half to even, shifted by the zero point, saturated
    to the codes [low, high], then back."""
    x32 = np.asarray(x, dtype=_F32)
    codes: np.ndarray = np.clip(np.rint(x32 / _F32(scale)) + zero_point, low, high)
    values: np.ndarray = (codes - zero_point) * _F32(scale)
    return values


def degenerate_mask(qparams: QParams) -> np.ndarray:
    """True where the scale is not finite and positive or the zero point is not finite (§7)."""
    with np.errstate(invalid="ignore"):
        good = np.isfinite(qparams.scale) & (qparams.scale > 0) & np.isfinite(qparams.zero_point)
    return np.asarray(~good)


def _rounding_deviations(rounding: Rounding) -> tuple[str, ...]:
    return () if rounding is Rounding.HALF_TO_EVEN else (_HALF_UP,)


def _torch_grid(qparams: QParams, scheme: TorchScheme) -> _Grid:
    if scheme.dtype == "qint32":
        raise ConfigError(
            "PyTorch qint32 has no QuantizeLinear output type; keep the tensor in float"
        )
    zero_point = qparams.zero_point.astype(np.float64)
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, ())


def _horizon_grid(qparams: QParams, scheme: HorizonScheme) -> _Grid:
    zero_point = qparams.zero_point.astype(np.float64)
    deviations = _rounding_deviations(scheme.rounding)
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, deviations)


def _tf_grid(qparams: QParams, scheme: TFScheme) -> _Grid:
    deviations = list(_rounding_deviations(scheme.rounding))
    if not scheme.signed_input and not scheme.range_given:
        deviations.append(
            "TensorFlow leaves negative inputs unclamped without a given range; "
            "QuantizeLinear clamps them to 0"
        )
    zero_point = qparams.zero_point.astype(np.float64)
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, tuple(deviations))


def _oneflow_grid(qparams: QParams, scheme: OneFlowScheme) -> _Grid:
    zero_point = qparams.zero_point.astype(np.float64)
    deviations: tuple[str, ...] = ()
    if not scheme.symmetric:
        finite = np.isfinite(zero_point)
        clamped = np.where(
            finite, np.clip(zero_point, qparams.quant_min, qparams.quant_max), zero_point
        )
        outside = finite & (clamped != zero_point)
        if outside.any():
            values = ", ".join(
                f"{v:g}" for v in np.atleast_1d(zero_point)[np.atleast_1d(outside)][:4]
            )
            deviations = (
                (
                    f"zero point {values} lies outside [{qparams.quant_min}, {qparams.quant_max}] "
                    "(data excludes 0) and was clamped into it"
                ),
            )
        zero_point = clamped
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, deviations)


def _mindspore_grid(qparams: QParams, scheme: MindSporeScheme) -> _Grid:
    zero_point = qparams.zero_point.astype(np.float64)
    deviations = (
        _HALF_UP,
        "dequantizes as q*scale + nudged_min, not (q - zp)*scale (float32 ulps apart)",
    )
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, deviations)


def _learned_scale_grid(qparams: QParams, scheme: LearnedScaleScheme) -> _Grid:
    zero_point = qparams.zero_point.astype(np.float64)
    deviations = (
        _HALF_UP,
        "quantizes x/maxq*Qmax and dequantizes as (q/Qmax)*maxq, not with the exported scale",
    )
    return _Grid(qparams.scale, zero_point, qparams.quant_min, qparams.quant_max, deviations)


_GRIDS: Mapping[type, Callable[[QParams, Any], _Grid]] = {
    TorchScheme: _torch_grid,
    HorizonScheme: _horizon_grid,
    TFScheme: _tf_grid,
    OneFlowScheme: _oneflow_grid,
    MindSporeScheme: _mindspore_grid,
    LearnedScaleScheme: _learned_scale_grid,
}


def _choose_dtype(low: int, high: int, opset: int) -> int:
    """Smallest QuantizeLinear type holding [low, high]; 4/16-bit types only from opset 21."""
    signed = low < 0
    small_types_allowed = opset >= _SMALL_TYPES_OPSET
    if small_types_allowed:
        four_bit = TensorProto.INT4 if signed else TensorProto.UINT4
        if ONNX_CODE_LIMITS[four_bit] == (low, high):
            return four_bit
    candidates = [TensorProto.INT8 if signed else TensorProto.UINT8]
    if small_types_allowed:
        candidates.append(TensorProto.INT16 if signed else TensorProto.UINT16)
    for dtype in candidates:
        lo, hi = ONNX_CODE_LIMITS[dtype]
        if lo <= low and high <= hi:
            return dtype
    if not small_types_allowed and -32768 <= low and high <= 65535:
        raise ConfigError(
            f"integer range [{low}, {high}] needs a 16-bit QuantizeLinear, which needs opset "
            f"{_SMALL_TYPES_OPSET} (got opset {opset})"
        )
    raise ConfigError(f"integer range [{low}, {high}] does not fit any QuantizeLinear output type")


def _replace_degenerate(grid: _Grid, qparams: QParams) -> tuple[np.ndarray, np.ndarray, str | None]:
    bad = degenerate_mask(qparams)
    if not bad.any():
        return grid.scale, grid.zero_point, None
    # §7: scale 1.0 and the zero point that maps 0.0 to itself (every range here contains 0).
    scale = np.where(bad, _F32(1.0), grid.scale).astype(_F32)
    zero_point = np.where(bad, 0.0, grid.zero_point)
    old = ", ".join(f"{s:g}" for s in np.atleast_1d(qparams.scale)[np.atleast_1d(bad)][:4])
    where = "" if bad.ndim == 0 else f" in {int(bad.sum())} of {bad.size} channels"
    return scale, zero_point, f"degenerate scale {old}{where} replaced by scale 1.0, zero point 0"


def to_onnx_qparams(qparams: QParams, scheme: Scheme, *, opset: int = DEFAULT_OPSET) -> OnnxQParams:
    """ONNX QuantizeLinear parameters for ``qparams`` computed with ``scheme`` (§7).

    Args:
        qparams: parameters from :func:`qcal.numerics.schemes.compute_qparams`.
        scheme: the scheme they were computed with.
        opset: the opset the QDQ model will use. int4/uint4/int16/uint16 are chosen only when it
            is at least 21; otherwise narrower ranges use int8/uint8 with clip bounds.

    Raises:
        ConfigError: not representable (PyTorch qint32; a range wider than 8 bits below opset
            21), or per-channel parameters without an axis.
    """
    rule = _GRIDS.get(type(scheme))
    if rule is None:
        raise TypeError(f"no ONNX mapping for scheme {type(scheme).__name__}")
    if qparams.is_per_channel and qparams.axis is None:
        raise ConfigError("per-channel parameters need a channel axis for QuantizeLinear")
    grid = rule(qparams, scheme)
    dtype = _choose_dtype(grid.low, grid.high, opset)
    scale, zero_point, replacement = _replace_degenerate(grid, qparams)
    type_low, type_high = ONNX_CODE_LIMITS[dtype]
    clip_min = clip_max = None
    if (grid.low, grid.high) != (type_low, type_high):
        # A bound past the float32 range (a range near its maximum) is infinite: no clipping
        # on that side, as float32 arithmetic gives.
        with np.errstate(over="ignore"):
            clip_min = np.asarray(np.asarray(grid.low - zero_point, dtype=_F32) * scale,
                                  dtype=_F32)
            clip_max = np.asarray(np.asarray(grid.high - zero_point, dtype=_F32) * scale,
                                  dtype=_F32)
    deviations = grid.deviations + ((replacement,) if replacement else ())
    if dtype in (TensorProto.INT8, TensorProto.UINT8):
        min_opset = 13 if qparams.axis is not None else 10
    else:
        min_opset = _SMALL_TYPES_OPSET
    return OnnxQParams(
        dtype=dtype,
        scale=np.asarray(scale, dtype=_F32),
        zero_point=np.asarray(zero_point).astype(_ZERO_POINT_DTYPES[dtype]),
        axis=qparams.axis,
        clip_min=clip_min,
        clip_max=clip_max,
        exact=not deviations,
        deviations=deviations,
        replacement=replacement,
        min_opset=min_opset,
    )
