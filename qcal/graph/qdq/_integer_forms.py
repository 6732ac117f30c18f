"""HardSwish, HardSigmoid, PRelu and Pad spelled in operators onnxruntime runs on integers, and
AveragePool in one it runs faster.

onnxruntime has no integer kernel for either: between a DequantizeLinear and a QuantizeLinear
it runs them in float, and between integer Convs that also ends the channels-last layout it
gives integer chains (a Transpose each way). Both are an Add and a clip, and the clip is what
a QuantizeLinear does anyway when its range is the clip's, so after the writer has placed the
pairs, a node the plan names in `QuantPlan.integer_forms` that sits between its input's
DequantizeLinear ``x`` and its output's QuantizeLinear (parameters ``s``, ``z``) becomes:

* HardSigmoid ``clip(a x + b, 0, 1)`` = ``a clip(x + b / a, 0, 1 / a)``: an Add of ``b / a``
  whose QuantizeLinear has scale ``s / a`` and zero point ``z``. Its codes are the output's
  codes (``DQ(q, s / a, z) a = DQ(q, s, z)``), and its range is the clip's when the output's
  range is within [0, 1] from 0 (``z`` the lowest code): one QLinearAdd.
* HardSwish ``x clip(x + 3, 0, 6) / 6``: an Add of 3 quantized on [0, t] with
  t = min(6, 3 + the largest value x's codes hold) (the lowest code at 0, so the range clips as
  the formula does), then a Mul by x whose QuantizeLinear has scale ``6 s`` and zero point
  ``z``, which writes the output's codes: QLinearAdd and QLinearMul. The gate ``x + 3`` is held
  in 8 bits on its own range, the one rounding this form adds.

* PRelu: Clips of its input's codes and a depthwise 1 x 1 Conv of the slopes, added
  (`_prelu_form`).

* Pad: onnxruntime keeps a float Pad between its pair; with the same parameters on both sides
  (the plan gives its output its input's) it becomes a Pad of the input's codes, by the zero
  point's code in constant mode (the value 0, exactly), writing the output's codes.

* AveragePool: onnxruntime has an integer kernel for it (QLinearAveragePool), a plain loop
  many times its float kernel: between integer 1x1 Convs, one thread, 1.5 ms against 0.25 ms
  for the chain at 64 channels of 56 x 56 (3x3, stride 1), 3.5 ms against 1.6 ms at 288 of
  35 x 35 (an Inception's branch pool; 37 % of a quantized Inception v3's time). Where its
  divisor is the kernel's size everywhere (count_include_pad, or no padding; no ceil_mode or
  dilations) it is a depthwise Conv of weight 1 / k, written as one (the weight a code of 1
  at scale 1 / k, exactly the float divisor): onnxruntime runs it in its integer depthwise
  kernel, and the chains above took 0.24 and 1.1 ms. A pool that does not count its padding
  (Keras's and Paddle's "same" pools) divides by the taps inside the input: its Conv's output
  is quantized on the output's grid and multiplied by the constant map k / taps inside, held
  at a scale of 2^-m (so its 1s, every inner position, are exact and leave those codes as
  they are): 1.2 ms against 3.6 ms (QLinearAveragePool) and 1.7 ms (float) at 288 channels.
  The map needs the sizes stated; without them the pool stays as written.

The constant of each Add is an 8-bit code with a DequantizeLinear, as the integer Add needs.
Elsewhere (a graph output, a float reader, per-axis or float16 parameters, an output range
that does not start at 0) the node stays as written, in float between its pair. The planner
asks for these forms only with uint8 activations (`SelectionRules.integer_forms`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcal.graph.names import NameAllocator, add_initializer
from qcal.graph.qdq._codes import _INTEGER_TYPES
from qcal.graph.qdq._form_parts import (
    between_pair,
    code_initializer,
    constant_code,
    requantize,
)
from qcal.graph.qdq._prelu_form import prelu_codes
from qcal.graph.shapes import value_dims
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    all_graphs,
    default_opset,
    drop_unread_initializers,
    drop_value_info,
    float_attribute,
    int_attribute,
    ints_attribute,
    string_attribute,
)

__all__ = ["write_integer_forms"]

# An output range may end above 1 by float32 rounding of its scale (255 x (1 / 255)).
_ONE = 1.0 + 1e-6


def write_integer_forms(model: onnx.ModelProto, nodes: frozenset[str]) -> int:
    """Rewrite, in place, each node of `nodes` that sits between its pair (module docstring);
    returns how many were rewritten."""
    if not nodes:
        return 0
    names = NameAllocator.from_model(model)
    done = 0
    opset = default_opset(model) or 0
    for graph in all_graphs(model.graph):
        index, dims = UseIndex.build(graph), value_dims(graph)
        spellings: dict[int, list[onnx.NodeProto]] = {}  # id of a node -> its replacement
        scales: set[str] = set()  # the output scales the QuantizeLinears no longer read
        replaced: set[str] = set()  # the outputs of the nodes spelled out
        for node in graph.node:
            if node.name not in nodes or node.domain not in DEFAULT_DOMAINS:
                continue
            if node.op_type == "AveragePool":
                pooled = _pool_as_convolution(node, index, names, graph, dims)
                if pooled is not None:
                    spellings[id(node)] = pooled
                    replaced.add(node.output[0])
                continue
            if node.op_type == "PRelu":
                slopes = prelu_codes(node, index, names, graph, opset, dims)
                if slopes is not None:
                    spelled_nodes, gone = slopes
                    spellings[id(node)] = spelled_nodes
                    spellings.update((id(n), []) for n in gone)
                    replaced.add(node.output[0])
                continue
            if node.op_type == "Pad":
                padded = _pad_codes(node, index)
                if padded is not None:
                    pad, gone = padded
                    spellings[id(node)] = [pad]
                    spellings.update((id(n), []) for n in gone)
                    scales.update(v for n in gone for v in n.input[1:])
                    replaced.add(node.output[0])
                continue
            spelled = _spell(node, index, names, graph)
            if spelled is not None:
                spellings[id(node)], scale = spelled
                scales.add(scale)
                replaced.add(node.output[0])
        if spellings:
            kept = [new for node in graph.node for new in spellings.get(id(node), [node])]
            del graph.node[:]
            graph.node.extend(kept)
            drop_unread_initializers(graph, scales)
            drop_value_info(graph, replaced)
            done += len(replaced)
    return done


def _spell(
    node: onnx.NodeProto, index: UseIndex, names: NameAllocator, graph: onnx.GraphProto
) -> tuple[list[onnx.NodeProto], str] | None:
    """The nodes that replace `node` and the scale the QuantizeLinear after it read before it
    was edited in place (to quantize their output), or None."""
    pair = between_pair(node, index)
    if pair is None:
        return None
    dequantize, quantize, x_scale, x_zero, y_scale, y_zero, dtype = pair
    _, low, high = _INTEGER_TYPES[dtype]
    x, replaced = dequantize.output[0], quantize.input[1]
    if node.op_type == "HardSigmoid":
        alpha, beta = float_attribute(node, "alpha", 0.2), float_attribute(node, "beta", 0.5)
        clips = y_zero == low and (high - y_zero) * y_scale <= _ONE  # its range in [0, 1]
        if not (alpha > 0 and np.isfinite(beta) and clips):
            return None
        shift = constant_code(names, graph, node.name, beta / alpha, dtype)
        gate = names.allocate(f"{node.name}_shifted")
        add = helper.make_node("Add", [x, shift.output[0]], [gate],
                               name=names.allocate(f"{node.name}_Add"))
        requantize(quantize, gate, y_scale / alpha, names, graph)
        return [shift, add], replaced
    # HardSwish: x * clip(x + 3, 0, 6) / 6
    top = min(6.0, 3.0 + (high - x_zero) * x_scale)
    if top <= 0:
        return None  # x never above -3: the output is 0 (left as written)
    three = constant_code(names, graph, node.name, 3.0, dtype)
    shifted = names.allocate(f"{node.name}_shifted")
    add = helper.make_node("Add", [x, three.output[0]], [shifted],
                           name=names.allocate(f"{node.name}_Add"))
    gate_scale = add_initializer(names, graph, f"{node.name}_gate_scale",
                              np.asarray(top / (high - low), np.float32))
    gate_zero = code_initializer(names, graph, f"{node.name}_gate_zero_point", low, dtype)
    gate_codes = names.allocate(f"{node.name}_gate_quantized")
    gate = names.allocate(f"{node.name}_gate")
    quantize_gate = helper.make_node(
        "QuantizeLinear", [shifted, gate_scale, gate_zero], [gate_codes],
        name=names.allocate(f"{node.name}_gate_QuantizeLinear"))
    dequantize_gate = helper.make_node(
        "DequantizeLinear", [gate_codes, gate_scale, gate_zero], [gate],
        name=names.allocate(f"{node.name}_gate_DequantizeLinear"))
    product = names.allocate(f"{node.name}_product")
    mul = helper.make_node("Mul", [x, gate], [product], name=names.allocate(f"{node.name}_Mul"))
    requantize(quantize, product, y_scale * 6.0, names, graph)
    return [three, add, quantize_gate, dequantize_gate, mul], replaced


def _pad_codes(
    node: onnx.NodeProto, index: UseIndex
) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """A Pad between a DequantizeLinear and a QuantizeLinear of the same parameters, as a Pad of
    the input's codes (by the zero point's code, in constant mode: the value 0) that writes the
    output's codes; and the nodes it leaves unread (the QuantizeLinear, and the
    DequantizeLinear when nothing else reads it). onnxruntime keeps a float Pad between its
    pair, and runs this one on the integers, channels-last between integer Convs."""
    pair = between_pair(node, index, parameters=True)
    if pair is None:
        return None
    dequantize, quantize, x_scale, x_zero, y_scale, y_zero, _ = pair
    if (x_scale, x_zero) != (y_scale, y_zero):
        return None
    constant_mode = string_attribute(node, "mode", "constant") == "constant"
    inputs = [dequantize.input[0], node.input[1],
              dequantize.input[2] if constant_mode else "", *node.input[3:4]]
    while not inputs[-1]:
        inputs.pop()
    pad = helper.make_node("Pad", inputs, [quantize.output[0]], name=node.name)
    pad.attribute.extend(node.attribute)
    gone = [quantize]
    if len(index.uses.get(dequantize.output[0], ())) == 1:
        gone.append(dequantize)
    return pad, gone


def _pool_as_convolution(
    node: onnx.NodeProto, index: UseIndex, names: NameAllocator, graph: onnx.GraphProto,
    dims: Mapping[str, tuple[int | None, ...] | None],
) -> list[onnx.NodeProto] | None:
    """An AveragePool between its pair as the DequantizeLinear of a weight of ones (scale
    1 / k) and a depthwise Conv reading the input's DequantizeLinear; where the pool does not
    count its padding, the Conv's output quantized on the output's grid and multiplied by the
    constant map k / (taps inside the input) per position. None where the form does not apply
    (ceil_mode, dilations, unknown channels, or for a map, unknown sizes)."""
    pair = between_pair(node, index)
    if pair is None:
        return None
    dequantize, quantize, _, _, _, _, dtype = pair
    kernel = ints_attribute(node, "kernel_shape")
    spatial = len(kernel)
    pads = ints_attribute(node, "pads") or [0] * 2 * spatial
    strides = ints_attribute(node, "strides") or [1] * spatial
    auto_pad = string_attribute(node, "auto_pad", "NOTSET")
    if (not kernel or auto_pad not in ("NOTSET", "VALID") or int_attribute(node, "ceil_mode", 0)
            or any(d != 1 for d in ints_attribute(node, "dilations"))):
        return None
    if auto_pad == "VALID":
        pads = [0] * 2 * spatial
    output_dims = _dims(dims, node.output[0], spatial)
    if output_dims is None or output_dims[1] <= 0:
        return None
    channels = output_dims[1]
    taps = int(np.prod(kernel))
    ones = code_initializer(names, graph, f"{node.name}_weight_quantized",
                            np.ones((channels, 1, *kernel)), TensorProto.INT8)
    scale = add_initializer(names, graph, f"{node.name}_weight_scale",
                              np.asarray(1.0 / taps, np.float32))
    zero = code_initializer(names, graph, f"{node.name}_weight_zero_point", 0, TensorProto.INT8)
    weight = helper.make_node(
        "DequantizeLinear", [ones, scale, zero], [names.allocate(f"{node.name}_weight")],
        name=names.allocate(f"{node.name}_weight_DequantizeLinear"))
    attributes: dict[str, Any] = {"group": channels, "kernel_shape": kernel, "strides": strides,
                                  "pads": pads}
    if not any(pads) or int_attribute(node, "count_include_pad", 0):
        conv = helper.make_node("Conv", [dequantize.output[0], weight.output[0]],
                                [node.output[0]], name=node.name, **attributes)
        return [weight, conv]
    # The divisor is the count of taps inside the input: a map of k / count per position.
    source = index.producer.get(dequantize.input[0])  # the pool's input, quantized
    input_dims = (_dims(dims, source.input[0], spatial)
                  if source is not None and source.op_type == "QuantizeLinear" else None)
    if input_dims is None or any(d <= 0 for d in output_dims[2:] + input_dims[2:]):
        return None
    ratios = _uncounted_padding_map(kernel, strides, pads, input_dims[2:], output_dims[2:])
    high = _INTEGER_TYPES[dtype][2]
    # a scale of 2^-m: the map's 1s (every inner position) exact, the rest to 2^-(m + 1)
    steps = 2.0 ** np.floor(np.log2(high / float(ratios.max())))
    if steps < 1:  # a ratio over the largest code (a corner of one tap in a huge kernel)
        return None
    codes = code_initializer(names, graph, f"{node.name}_divisors_quantized", np.rint(ratios * steps),
                  dtype)
    map_zero = code_initializer(names, graph, f"{node.name}_divisors_zero_point", 0, dtype)
    map_scale = add_initializer(names, graph, f"{node.name}_divisors_scale",
                             np.asarray(1.0 / steps, np.float32))
    divisors = helper.make_node(
        "DequantizeLinear", [codes, map_scale, map_zero],
        [names.allocate(f"{node.name}_divisors")],
        name=names.allocate(f"{node.name}_divisors_DequantizeLinear"))
    summed = names.allocate(f"{node.name}_sum")
    conv = helper.make_node("Conv", [dequantize.output[0], weight.output[0]], [summed],
                            name=node.name, **attributes)
    # the Conv's output (the mean times count / k, within the output's range from 0) on the
    # output's grid: an inner position's codes pass the Mul by 1 unchanged
    y_scale, y_zero = quantize.input[1], quantize.input[2]
    sum_codes = names.allocate(f"{node.name}_sum_quantized")
    sum_values = names.allocate(f"{node.name}_sum_dequantized")
    return [weight, conv,
            helper.make_node("QuantizeLinear", [summed, y_scale, y_zero], [sum_codes],
                             name=names.allocate(f"{node.name}_sum_QuantizeLinear")),
            helper.make_node("DequantizeLinear", [sum_codes, y_scale, y_zero], [sum_values],
                             name=names.allocate(f"{node.name}_sum_DequantizeLinear")),
            divisors,
            helper.make_node("Mul", [sum_values, divisors.output[0]], [node.output[0]],
                             name=names.allocate(f"{node.name}_divisors_Mul"))]


def _uncounted_padding_map(kernel: list[int], strides: list[int], pads: list[int],
                           inputs: list[int], outputs: list[int]) -> np.ndarray:
    """k / (taps inside the input) at each output position, shaped (1, 1, *outputs)."""
    spatial = len(kernel)
    counts = np.ones((1, 1), np.float64)
    for axis in range(spatial):
        starts = np.arange(outputs[axis]) * strides[axis] - pads[axis]
        inside = np.clip(starts + kernel[axis], 0, inputs[axis]) - np.clip(starts, 0, inputs[axis])
        counts = np.multiply.outer(counts, inside.astype(np.float64))
    counts = counts.reshape(1, 1, *outputs)
    ratios: np.ndarray = float(np.prod(kernel)) / np.maximum(counts, 1.0)
    return ratios


def _dims(dims: Mapping[str, tuple[int | None, ...] | None], value: str,
          spatial: int) -> list[int] | None:
    """The dimensions of `value` (batch, channels, spatial...) as the graph states them
    (`value_dims`; 0 for one it does not), or None without a shape of that rank."""
    stated = dims.get(value)
    if stated is None or len(stated) != 2 + spatial:
        return None
    return [d or 0 for d in stated]
