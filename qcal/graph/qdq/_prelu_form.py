"""PRelu between its pair spelled in operators onnxruntime runs on integers.

onnxruntime's float kernel for PRelu is slow: a MediaPipe palm detector's 31 took half its
time (5.1 ms of 10 at one thread), and between integer Convs the pair around each costs more.
PRelu is ``relu(x) + slope min(x, 0)``, and both parts are Clips of the input's codes at its
zero point (integer Clips, exact). The positive part keeps the input's parameters. The negative
part, times the slopes, is a depthwise 1 x 1 Conv whose weights hold each channel's slope
exactly (the code 127 at a scale of |slope| / 127), quantized on the output's grid, where it is
the output itself (relu(x) is 0 there); the two are added into the output's QuantizeLinear.
onnxruntime runs the Clips on the codes, the Conv in its integer depthwise kernel and the Add as
a QLinearAdd, channels-last between integer Convs, and the output's codes are those of the float
PRelu between the same pair. Four PRelus between integer 1 x 1 Convs (32 channels of 96 x 96,
one thread) ran 0.59 ms against 4.0 ms in float between their pairs (a QLinearMul by 8-bit
slopes instead of the Conv: 0.82 ms, and each slope rounded).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator, add_initializer
from qcal.graph.qdq._codes import _INTEGER_TYPES
from qcal.graph.qdq._form_parts import (
    between_pair,
    code_initializer,
)
from qcal.graph.structure import UseIndex

__all__ = ["prelu_codes"]


def prelu_codes(
    node: onnx.NodeProto, index: UseIndex, names: NameAllocator, graph: onnx.GraphProto,
    opset: int, dims: Mapping[str, tuple[int | None, ...] | None],
) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]] | None:
    """A PRelu between its pair as ``relu(x) + slope min(x, 0)`` on the codes (module
    docstring), and the input's DequantizeLinear when nothing else reads it; None where the
    form does not apply (a slope that is not one finite float constant per channel or for all,
    a tensor of unknown rank or channels, an opset without integer Clip or per-axis weights)."""
    pair = between_pair(node, index, parameters=True)
    slope = index.constant(node.input[1]) if len(node.input) == 2 else None
    if pair is None or slope is None or slope.data_type != TensorProto.FLOAT or opset < 13:
        return None
    slopes = _channel_slopes(tensor_array(slope), dims.get(node.output[0]))
    if slopes is None:
        return None
    dequantize, quantize, _, x_zero, _, _, dtype = pair
    _, low, _ = _INTEGER_TYPES[dtype]
    codes, x_scale_name, x_zero_name = dequantize.input
    zero = code_initializer(names, graph, f"{node.name}_zero_code", x_zero, dtype)
    positive = names.allocate(f"{node.name}_positive_quantized")
    positive_values = names.allocate(f"{node.name}_positive")
    spelled = [
        helper.make_node("Clip", [codes, zero], [positive],
                         name=names.allocate(f"{node.name}_positive_Clip")),
        helper.make_node("DequantizeLinear", [positive, x_scale_name, x_zero_name],
                         [positive_values],
                         name=names.allocate(f"{node.name}_positive_DequantizeLinear"))]
    if x_zero != low and slopes.any():
        spelled += _negative_part(node.name, codes, zero, x_scale_name, x_zero_name, slopes,
                                  positive_values, quantize, names, graph)
    else:  # no negative part (x >= 0, or every slope 0): relu(x) alone
        quantize.input[0] = positive_values
    gone = [dequantize] if len(index.uses.get(dequantize.output[0], ())) == 1 else []
    return spelled, gone


def _negative_part(name: str, codes: str, zero: str, x_scale: str, x_zero: str,
                   slopes: np.ndarray, positive: str, quantize: onnx.NodeProto,
                   names: NameAllocator, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``slope min(x, 0)`` as a depthwise 1 x 1 Conv of the codes clipped at the zero point, on
    the output's grid, added to the `positive` part into `quantize` (edited in place). Each
    channel's weight is its slope held as the code 127 (or -127) at a scale of |slope| / 127:
    exact."""
    channels, spatial = slopes.shape[0], slopes.ndim - 1
    magnitudes = np.abs(slopes).reshape(channels)
    weight_scales = np.where(magnitudes > 0, magnitudes / 127, 1).astype(np.float32)
    weight_codes = np.sign(slopes).reshape(channels, 1, *[1] * spatial) * 127
    negative = names.allocate(f"{name}_negative_quantized")
    negative_values = names.allocate(f"{name}_negative")
    weight = names.allocate(f"{name}_slope_weight")
    product = names.allocate(f"{name}_product")
    product_codes = names.allocate(f"{name}_product_quantized")
    product_values = names.allocate(f"{name}_product_dequantized")
    total = names.allocate(f"{name}_sum")
    y_scale, y_zero = quantize.input[1], quantize.input[2]
    weight_inputs = [
        code_initializer(names, graph, f"{name}_slope_quantized", weight_codes, TensorProto.INT8),
        add_initializer(names, graph, f"{name}_slope_scale", weight_scales),
        code_initializer(names, graph, f"{name}_slope_zero_point", np.zeros(channels),
                         TensorProto.INT8)]
    nodes = [
        helper.make_node("Clip", [codes, "", zero], [negative],
                         name=names.allocate(f"{name}_negative_Clip")),
        helper.make_node("DequantizeLinear", [negative, x_scale, x_zero], [negative_values],
                         name=names.allocate(f"{name}_negative_DequantizeLinear")),
        helper.make_node("DequantizeLinear", weight_inputs, [weight], axis=0,
                         name=names.allocate(f"{name}_slope_DequantizeLinear")),
        helper.make_node("Conv", [negative_values, weight], [product], group=channels,
                         kernel_shape=[1] * spatial, name=names.allocate(f"{name}_slope_Conv")),
        # on the output's grid: where x < 0 the product is the output (relu(x) is 0 there)
        helper.make_node("QuantizeLinear", [product, y_scale, y_zero], [product_codes],
                         name=names.allocate(f"{name}_product_QuantizeLinear")),
        helper.make_node("DequantizeLinear", [product_codes, y_scale, y_zero], [product_values],
                         name=names.allocate(f"{name}_product_DequantizeLinear")),
        helper.make_node("Add", [positive, product_values], [total],
                         name=names.allocate(f"{name}_Add"))]
    quantize.input[0] = total
    return nodes


def _channel_slopes(slope: np.ndarray, dims: Sequence[int | None] | None) -> np.ndarray | None:
    """The slopes as a depthwise weight's shape (channels, 1, ...) for a tensor of `dims`
    (batch, channels, spatial...): None unless they are finite and one per channel (broadcast
    along axis 1) or one for all, with the channels known."""
    if dims is None or len(dims) < 3 or not np.isfinite(slope).all():
        return None
    rank, channels = len(dims), dims[1]
    axis = slope.ndim - rank + 1  # the slope's axis that broadcasts along the channels
    width = slope.shape[axis] if axis >= 0 else 1
    if (slope.ndim > rank or any(d != 1 for k, d in enumerate(slope.shape) if k != axis)
            or channels is None or width not in (1, channels)):
        return None
    return np.broadcast_to(slope.reshape(width), (channels,)).reshape(
        channels, *[1] * (rank - 2)).astype(np.float64)
