"""Even out the channel ranges of a depthwise convolution's input, from the data: the graph side.

A depthwise Conv reads each input channel alone, but its input is quantized with one scale for
all channels. After BatchNormalization is folded, a MobileNet-style block often feeds it
channels whose ranges differ by 100-1000x (a MediaPipe pose model's first block: one channel up
to 0.022 beside others up to 6, with a depthwise weight of 504 on it). The small channels then
hold a few codes, and the large weight multiplies their error: 20 dB after that one layer.

For a Conv A whose output reaches only depthwise Convs, directly or through one activation f
with ``f(s x) = s f(x)`` on the data (Relu, LeakyRelu, PRelu, a Clip whose bounds the scaled
channel does not reach), multiplying output channel c of A (weight and bias) by ``s_c > 0`` and
dividing the depthwise weights that read channel c by ``s_c`` leaves the depthwise outputs
unchanged. With weights quantized per output channel, neither weight's codes change (each
channel's scale moves with it); only the activations' ranges do. With r_c channel c's largest
magnitude on the calibration data and R the largest of all,

    s_c = min(R / (2 r_c), 1000), and at least 1

brings every narrower channel to half the whole range: in effect, per-channel steps for an
activation the integer kernel reads per tensor, with room left for values up to twice those of
the calibration data (which a small calibration set misses), and at most 1000x (`_MAX_SCALE`).
Cross-layer equalization (`qcal.graph.passes.equalize`) balances the weights instead, which is
what per-tensor weights need; this is what per-channel weights need.

A Clip is positive-homogeneous only inside its bounds: ``Clip(lo, hi)(s x) = s x`` needs
``s x`` inside them wherever ``x`` is. So where the data comes within a factor of a bound, the
scale stops there (``s_c <= hi / max_c``), and a channel that the Clip saturates on the data
keeps ``s_c = 1``: the float outputs stay the same on the calibration data. A value beyond
``hi / s_c`` (larger than any the data held) is then clipped there. A channel below `_DEAD` of
the largest is left alone (nothing to spread; its scale would blow up A's bias).

This module finds the targets and applies the scales; `qcal._transforms` measures the ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.passes.equalize import conv_parameters, own_float_parameters
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, float_attribute, int_attribute

__all__ = [
    "DepthwiseInput", "apply_depthwise_scales", "depthwise_scales", "find_depthwise_inputs",
    "input_magnitudes", "range_ratio",
]

_DEAD = 1e-6  # a channel below this fraction of the largest range: left alone
# A stretched channel reaches 1/_HEADROOM of the largest range on the calibration data: values
# up to twice its largest seen still fit (a channel stretched to the full range would clip any
# value past its calibration maximum; PP-OCR's direction classifier, calibrated on 4 images,
# lost 12 dB that way).
_HEADROOM = 2.0
# At most this much: past it a channel held under a thousandth of a code step, and the depthwise
# bias, stored as int32 in steps of (input scale x weight scale / s), would grow towards the
# int32 limit.
_MAX_SCALE = 1000.0
_HOMOGENEOUS = frozenset({"Relu", "LeakyRelu", "PRelu"})
_FUSED = frozenset({"Relu", "Clip"})  # onnxruntime fuses them into the Conv's integer kernel


@dataclass(frozen=True)
class DepthwiseInput:
    """One Conv whose output only depthwise Convs read.

    Attributes:
        first: the Conv A whose output channels are scaled.
        through: the activation between A and the depthwise Convs ("" when none).
        depthwise: the depthwise Convs (their weights are divided).
        values: the tensors whose channel ranges are measured: A's output, then the
            activation's (the depthwise input), each NCHW with the channels on axis 1.
        bounds: the activation's (low, high) clip bounds, or None when it is unbounded.
        channels: A's output channels.
        activation: the activation's op type ("" when none).
        scaled: A's weight (and bias): multiplied by the scales.
        divided: the depthwise Convs' weights: divided by them.
    """

    first: str
    through: str
    depthwise: tuple[str, ...]
    values: tuple[str, ...]
    bounds: tuple[float, float] | None
    channels: int
    activation: str
    scaled: tuple[str, ...]
    divided: tuple[str, ...]


def find_depthwise_inputs(model: onnx.ModelProto) -> list[DepthwiseInput]:
    """Every Conv -> [activation] -> depthwise Conv(s) of the main graph that can be scaled: A's
    output and the activation's each read only on that way and no graph output; A's weight and
    bias and each depthwise weight float32 initializers read by that node alone."""
    index = UseIndex.build(model.graph)
    targets = []
    for node in model.graph.node:
        target = _target_from(node, index)
        if target is not None:
            targets.append(target)
    return targets


def _target_from(first: onnx.NodeProto, index: UseIndex) -> DepthwiseInput | None:
    if not _is_conv(first) or not own_float_parameters(first, index):
        return None
    weight = index.constant(first.input[1])
    assert weight is not None
    channels = int(weight.dims[0])
    value, through, bounds, activation_op = first.output[0], "", None, ""
    values = [value]
    readers = index.readers(value) if value not in index.graph_outputs else []
    if len(readers) == 1 and readers[0].op_type in (*_HOMOGENEOUS, "Clip") \
            and readers[0].domain in DEFAULT_DOMAINS and readers[0].input[0] == value:
        activation = readers[0]
        if activation.op_type == "Clip":
            bounds = _clip_bounds(activation, index)
            if bounds is None:
                return None
        elif activation.op_type == "PRelu" and (len(activation.input) < 2
                                                or index.constant(activation.input[1]) is None):
            return None
        through, value = activation.name or activation.op_type, activation.output[0]
        activation_op = activation.op_type
        values.append(value)
        readers = index.readers(value) if value not in index.graph_outputs else []
    if not readers or any(not _depthwise_of(r, value, channels, index) for r in readers):
        return None
    return DepthwiseInput(first.name, through, tuple(r.name for r in readers), tuple(values),
                          bounds, channels, activation_op, conv_parameters(first),
                          tuple(r.input[1] for r in readers))


def _is_conv(node: onnx.NodeProto) -> bool:
    return (node.op_type == "Conv" and node.domain in DEFAULT_DOMAINS and len(node.input) > 1
            and bool(node.name))


def _depthwise_of(node: onnx.NodeProto, value: str, channels: int, index: UseIndex) -> bool:
    """Whether `node` is a depthwise Conv of `value` (one input channel per group)."""
    if not _is_conv(node) or node.input[0] != value:
        return False
    if not own_float_parameters(node, index, with_bias=False):
        return False
    weight = index.constant(node.input[1])
    assert weight is not None
    return (len(weight.dims) >= 3 and int(weight.dims[1]) == 1
            and int_attribute(node, "group", 1) == channels
            and int(weight.dims[0]) % channels == 0)


def _clip_bounds(node: onnx.NodeProto, index: UseIndex) -> tuple[float, float] | None:
    """A Clip's (low, high), from its attributes (opset < 11) or its constant inputs; None when
    a bound is not one constant, or the Clip is not homogeneous near 0 (low > 0 or high < 0)."""
    bounds = [float_attribute(node, "min", -np.inf), float_attribute(node, "max", np.inf)]
    for slot in (1, 2):
        if len(node.input) > slot and node.input[slot]:
            tensor = index.constant(node.input[slot])
            if tensor is None or int(np.prod(tensor.dims)) != 1:
                return None
            bounds[slot - 1] = float(tensor_array(tensor).reshape(()))
    low, high = bounds
    return (low, high) if low <= 0 <= high else None


def depthwise_scales(target: DepthwiseInput, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """s per channel (float64, >= 1). `low`/`high` are (len(values), C): each value's channel
    extremes on the data, in the order of `target.values`.

    The ranges evened out are those of the values the model quantizes: after a Relu or Clip,
    only the activation's output (onnxruntime fuses them into the Conv, whose integer output is
    the activation's); otherwise every value on the way (A's output is quantized on its own)."""
    fused = target.activation in _FUSED
    measured = slice(1, None) if fused else slice(None)
    magnitude = np.max(np.maximum(np.abs(low[measured]), np.abs(high[measured])), axis=0)
    magnitude = magnitude.astype(np.float64)
    largest = float(np.max(magnitude[np.isfinite(magnitude)], initial=0.0))
    live = _live(magnitude)
    scale = np.ones(target.channels, dtype=np.float64)
    scale[live] = np.minimum(largest / (_HEADROOM * magnitude[live]), _MAX_SCALE)
    if target.bounds is not None:  # the Clip's input must stay inside its bounds
        bound_low, bound_high = target.bounds
        scale = np.minimum(scale, _room(high[0].astype(np.float64), bound_high))
        scale = np.minimum(scale, _room(-low[0].astype(np.float64), -bound_low))
    return np.maximum(scale, 1.0)


def input_magnitudes(target: DepthwiseInput, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The depthwise input's largest magnitude per channel (float64), from the extremes
    `depthwise_scales` takes."""
    last = len(target.values) - 1
    magnitude: np.ndarray = np.maximum(np.abs(low[last]), np.abs(high[last]))
    return magnitude.astype(np.float64)


def range_ratio(magnitude: np.ndarray) -> float:
    """The largest over the smallest channel magnitude, dead channels aside (1 is even)."""
    live = magnitude[_live(magnitude)]
    return float(live.max() / live.min()) if live.size else 1.0


def _live(magnitude: np.ndarray) -> np.ndarray:
    """Channels with values, at least `_DEAD` of the largest."""
    finite = np.isfinite(magnitude)
    largest = float(np.max(magnitude[finite], initial=0.0))
    live: np.ndarray = finite & (magnitude > 0) & (magnitude >= largest * _DEAD)
    return live


def _room(extreme: np.ndarray, bound: float) -> np.ndarray:
    """How far each channel's `extreme` may be multiplied before it passes `bound` (a positive
    bound: inf for none, or where the channel holds no positive values; 1 where the data reaches
    the bound already). A bound of 0 (a Relu6's low) holds whatever the scale: no limit."""
    room = np.full(extreme.shape, np.inf)
    if not np.isfinite(bound) or bound <= 0:
        return room
    positive = extreme > 0
    room[positive] = np.where(extreme[positive] < bound, bound / extreme[positive], 1.0)
    return room


def apply_depthwise_scales(initializers: Mapping[str, onnx.TensorProto],
                           target: DepthwiseInput, scale: np.ndarray) -> None:
    """Multiply A's output channels by `scale` and divide the depthwise weights reading them
    (`initializers`: the model's, by name)."""
    for name in target.scaled:  # the weight's rows (axis 0), or the bias
        _rewrite(initializers[name], lambda w: w * scale.reshape((-1,) + (1,) * (w.ndim - 1)))
    for name in target.divided:
        # a channel multiplier m: output channels c*m .. c*m+m-1 read input channel c
        _rewrite(initializers[name], lambda w: w / np.repeat(
            scale, w.shape[0] // target.channels).reshape((-1,) + (1,) * (w.ndim - 1)))


def _rewrite(tensor: onnx.TensorProto, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Change a float32 initializer in float64, rounding once to float32."""
    array = change(tensor_array(tensor).astype(np.float64))
    tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float32), tensor.name))
