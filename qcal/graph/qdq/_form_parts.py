"""What the integer forms of `_integer_forms` share: the pair a node sits between, and the
8-bit constants and scales they add."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator, add_initializer
from qcal.graph.qdq._codes import _BYTE_TYPES, _INTEGER_TYPES, integer_tensor
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex

__all__ = ["between_pair", "code_initializer", "constant_code", "requantize",
           "scalar_params"]


def between_pair(
    node: onnx.NodeProto, index: UseIndex, *, parameters: bool = False
) -> tuple[onnx.NodeProto, onnx.NodeProto, float, int, float, int, int] | None:
    """(DequantizeLinear of the input, QuantizeLinear of the output, their scales and zero
    points, the 8-bit type) when `node` reads a per-tensor DequantizeLinear and its output
    goes to one per-tensor QuantizeLinear alone, all with float32 scales. With `parameters`,
    inputs after the first (a Pad's pads) are allowed: they are not data."""
    if (not parameters and len(node.input) != 1) or len(node.output) != 1:
        return None
    output = node.output[0]
    dequantize = index.producer.get(node.input[0])
    readers = index.readers(output)
    if (dequantize is None or dequantize.op_type != "DequantizeLinear"
            or output in index.graph_outputs or len(readers) != 1
            or len(index.uses.get(output, ())) != 1 or readers[0].op_type != "QuantizeLinear"):
        return None
    quantize = readers[0]
    x_params = scalar_params(dequantize, index)
    y_params = scalar_params(quantize, index)
    if x_params is None or y_params is None or x_params[2] != y_params[2]:
        return None
    return dequantize, quantize, x_params[0], x_params[1], y_params[0], y_params[1], x_params[2]


def scalar_params(node: onnx.NodeProto, index: UseIndex) -> tuple[float, int, int] | None:
    """(scale, zero point, its 8-bit type) of a Q/DQ node with per-tensor float32 constants."""
    if node.domain not in DEFAULT_DOMAINS or len(node.input) != 3:
        return None
    scale, zero = index.constant(node.input[1]), index.constant(node.input[2])
    if (scale is None or zero is None or scale.data_type != TensorProto.FLOAT
            or zero.data_type not in _BYTE_TYPES):
        return None
    scales, zeros = tensor_array(scale), tensor_array(zero)
    if scales.size != 1 or zeros.size != 1:
        return None
    return float(scales.reshape(())), int(zeros.reshape(())), zero.data_type


def requantize(quantize: onnx.NodeProto, value: str, scale: float, names: NameAllocator,
                graph: onnx.GraphProto) -> None:
    """Make the output's QuantizeLinear quantize `value` with `scale` (its zero point kept)."""
    quantize.input[0] = value
    quantize.input[1] = add_initializer(names, graph, f"{value}_scale", np.asarray(scale, np.float32))


def constant_code(names: NameAllocator, graph: onnx.GraphProto, node: str, value: float,
                  dtype: int) -> onnx.NodeProto:
    """The DequantizeLinear of `value` as one 8-bit code (the extreme code of its sign)."""
    _, low, high = _INTEGER_TYPES[dtype]
    code, zero = (high, low) if value > 0 else (low, high) if value < 0 else (low, low)
    scale = abs(value) / (high - low) if value else 1.0
    codes = code_initializer(names, graph, f"{node}_constant_quantized", code, dtype)
    zero_point = code_initializer(names, graph, f"{node}_constant_zero_point", zero, dtype)
    scale_name = add_initializer(names, graph, f"{node}_constant_scale", np.asarray(scale, np.float32))
    return helper.make_node(
        "DequantizeLinear", [codes, scale_name, zero_point], [names.allocate(f"{node}_constant")],
        name=names.allocate(f"{node}_constant_DequantizeLinear"))


def code_initializer(names: NameAllocator, graph: onnx.GraphProto, base: str,
                     value: int | np.ndarray, dtype: int) -> str:
    name = names.allocate(base)
    graph.initializer.append(integer_tensor(name, np.asarray(value), dtype))
    return name


