"""What a QuantizeLinear/DequantizeLinear pair can carry, and the integers stored for it: the
ONNX integer and float types, the opsets they need, checks of parameters and codes, when two
parameter sets quantize alike, and initializers of integer type (4-bit codes packed, int32 bias
codes). Shared by every part of the Q/DQ writer; knows nothing of graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.numerics.errors import ModelError

if TYPE_CHECKING:
    from qcal.numerics.onnx_mapping import OnnxQParams

# The pass's name (`InsertQDQ.name`), which starts its error messages.
_PASS_NAME = "InsertQDQ"

# ONNX integer type -> (numpy storage dtype, lowest code, highest code). 4-bit codes are held in
# int8/uint8 arrays and packed two per byte when written.
_INTEGER_TYPES: dict[int, tuple[type[np.integer], int, int]] = {
    TensorProto.INT8: (np.int8, -128, 127),
    TensorProto.UINT8: (np.uint8, 0, 255),
    TensorProto.INT16: (np.int16, -32768, 32767),
    TensorProto.UINT16: (np.uint16, 0, 65535),
    TensorProto.INT4: (np.int8, -8, 7),
    TensorProto.UINT4: (np.uint8, 0, 15),
}
_FOUR_BIT_TYPES = frozenset({TensorProto.INT4, TensorProto.UINT4})
_BYTE_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# Float types a QDQ pair can carry; the scale takes the tensor's type (from opset 19 it must).
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})

# Relative tolerance between a folded division's scale and the source scale divided by the
# constant: float32 rounding of the two ways of computing it.
_FOLD_SCALE_RTOL = 1e-6

_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist from opset 10
_CLIP_INPUTS_OPSET = 11  # Clip takes min/max as inputs (before: attributes)
_PER_AXIS_OPSET = 13  # the `axis` attribute of QuantizeLinear/DequantizeLinear
_HALF_FLOAT_OPSET = 19  # float16/bfloat16 inputs and scales of QuantizeLinear
_WIDE_TYPE_OPSET = 21  # int16/uint16/int4/uint4 codes


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight's integer codes and the parameters that dequantize them.

    Attributes:
        codes: integer codes, same shape as the float weight; ``(codes - zp) * scale``
            approximates it (int4/uint4 codes are held as int8/uint8).
        onnx: the DequantizeLinear parameters (``axis`` set for per-channel weights).
        bias_shift: per output channel, how much the codes move the mean of the reading
            node's output (bias correction); subtracted from that node's bias where it is
            stored as int32. None: no correction.
    """

    codes: np.ndarray
    onnx: OnnxQParams
    bias_shift: np.ndarray | None = None


def _same_qparams(a: OnnxQParams, b: OnnxQParams) -> bool:
    """Whether two parameter sets quantize alike (same type, scale, zero point, axis, clip)."""
    return _divided_qparams(a, b, 1.0, rtol=0.0)


def _divided_qparams(
    source: OnnxQParams, divided: OnnxQParams, divisor: float, *, rtol: float = _FOLD_SCALE_RTOL
) -> bool:
    """Whether `divided` is `source` for the values divided by `divisor`: per tensor, same type
    and zero point, scale and clip bounds divided by it (to `rtol`). The codes of a value then
    are the same under both, so `divided`'s DequantizeLinear can read `source`'s codes."""
    if source.dtype != divided.dtype or source.axis is not None or divided.axis is not None:
        return False
    if not np.array_equal(np.asarray(source.zero_point), np.asarray(divided.zero_point)):
        return False
    pairs: list[tuple[np.ndarray, np.ndarray]] = [(source.scale, divided.scale)]
    for a, b in ((source.clip_min, divided.clip_min), (source.clip_max, divided.clip_max)):
        if (a is None) != (b is None):
            return False
        if a is not None and b is not None:
            pairs.append((a, b))
    return all(
        np.allclose(
            np.asarray(b, np.float64) * divisor, np.asarray(a, np.float64), rtol=rtol, atol=0.0
        )
        for a, b in pairs
    )


def _check_qparams(qparams: OnnxQParams, what: str) -> None:
    """Parameters a QuantizeLinear/DequantizeLinear pair can carry."""

    def fail(message: str) -> ModelError:
        return ModelError(f"{_PASS_NAME}: {what}: {message}")

    if qparams.dtype not in _INTEGER_TYPES:
        raise fail(f"unsupported ONNX type {qparams.dtype}")
    scale = np.asarray(qparams.scale)
    if scale.dtype != np.float32 or not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
        raise fail("scale must be finite, positive float32")
    expected_ndim = 0 if qparams.axis is None else 1
    if scale.ndim != expected_ndim or np.shape(qparams.zero_point) != scale.shape:
        raise fail(f"scale and zero point must have {expected_ndim} dimension(s) and equal shapes")
    _checked_codes(np.asarray(qparams.zero_point), qparams.dtype, scale.shape, what)
    for bound in (qparams.clip_min, qparams.clip_max):
        if bound is not None and np.shape(bound) != scale.shape:
            raise fail("clip bounds must have the scale's shape")


def _checked_codes(codes: np.ndarray, dtype: int, shape: tuple[int, ...], what: str) -> np.ndarray:
    """`codes` in the storage dtype of ONNX type `dtype`, after checking shape and range."""
    storage, low, high = _INTEGER_TYPES[dtype]
    codes = np.asarray(codes)
    prefix = f"{_PASS_NAME}: {what}:"
    if codes.shape != shape:
        raise ModelError(f"{prefix} codes of shape {list(codes.shape)}, expected {list(shape)}")
    if codes.dtype.kind not in "iuf" or (
        codes.dtype.kind == "f" and not np.array_equal(codes, np.rint(codes))
    ):
        raise ModelError(f"{prefix} codes are not integers")
    if codes.size and (codes.min() < low or codes.max() > high):
        name = TensorProto.DataType.Name(dtype)
        raise ModelError(f"{prefix} codes outside the {name} range [{low}, {high}]")
    return codes.astype(storage)


def _check_axis_length(qparams: OnnxQParams, shape: tuple[int, ...], what: str) -> None:
    assert qparams.axis is not None
    prefix = f"{_PASS_NAME}: {what}:"
    if not -len(shape) <= qparams.axis < len(shape):
        raise ModelError(f"{prefix} axis {qparams.axis} out of range for shape {list(shape)}")
    channels = np.asarray(qparams.scale).size
    if shape[qparams.axis] != channels:
        raise ModelError(
            f"{prefix} {channels} scales for {shape[qparams.axis]} channels on axis {qparams.axis}"
        )


def _quantize_bias_codes(values: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    """``saturate_int32(rne(b / scale))``, divided in float64 so the saturation bound is exact."""
    if axis is not None:
        shape = [1] * values.ndim
        shape[axis] = scale.size
        scale = scale.reshape(shape)
    ratio = values.astype(np.float64) / scale.astype(np.float64)
    return np.clip(np.rint(ratio), _INT32_MIN, _INT32_MAX).astype(np.int32)


def integer_tensor(name: str, codes: np.ndarray, dtype: int) -> onnx.TensorProto:
    """An initializer of ONNX integer type `dtype` (4-bit types packed two codes per byte)."""
    if dtype in _FOUR_BIT_TYPES:
        packed = codes.astype(helper.tensor_dtype_to_np_dtype(dtype))
        return helper.make_tensor(name, dtype, codes.shape, packed, raw=True)
    storage = np.int32 if dtype == TensorProto.INT32 else _INTEGER_TYPES[dtype][0]
    return numpy_helper.from_array(codes.astype(storage), name)


def _numpy_float(float_type: int) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(float_type)


def _float_array(values: np.ndarray, float_type: int) -> np.ndarray:
    """`values` in the float type of the tensor they apply to (float32 unless half precision)."""
    return np.asarray(values, dtype=np.float32).astype(_numpy_float(float_type))
