"""Pass: write a ConvTranspose as the Conv of its stride's phases and the shuffle that
interleaves them, which onnxruntime runs in integers.

onnxruntime's CPU provider has no integer ConvTranspose after QDQ fusion: it runs the node in
float on dequantized weights, so a decoder's upsampling layers stay float however they are
quantized (a deconvolution pose model's three ConvTranspose held 53 % of its multiply-adds, and
coverage stopped at 46 %). Along an axis of stride s, output position u = q·s + r (phase r)
gathers the input positions q − m through the taps r + s·m of the kernel; every phase is a
correlation of the input with its own taps, reversed. One Conv computes all s^d phases as
s^d times the channels, ``c·s^d + phase`` (the order DepthToSpace's CRD mode reads, which
keeps a group's channels together), with as many multiply-adds as the ConvTranspose; a
DepthToSpace (2-D) or a Reshape, Transpose and Reshape (1-D) interleaves them, and a Slice cuts
the pads. In float it computes the same sums in another order.

It pays where each output element sums enough products for the integer kernel to win back
the interleaving, which moves every output element once more: (input channels per group) x
(taps per phase) multiply-adds per output element, at least _MIN_MACS_PER_OUTPUT. Measured
with onnxruntime's CPU provider, each model in a session of its own without spinning threads,
median of 30 interleaved runs: a ConvTranspose between two quantized 3x3 Convs, its model
quantized with it rewritten against kept float, at one / two threads. 2-D (inputs 20-40 pixels
square, strides 2, 3 and 4, kernels 2-8, 32-128 input channels): 128 and more per output
element ran 0.32-0.63x / 0.45-0.68x float rewritten against 0.45-0.74x / 0.50-0.92x (a kernel
of 2 with 128 channels level at two threads, 0.51x against 0.50x); 64 went either way (kernel
4 with 16 channels 0.96x against 1.07x, kernel 3 with 16 1.11x against 1.07x, kernel 2 with 64
0.51x against 0.47x); 8-32 lost (0.74-1.44x against 0.59-1.12x at one thread). 1-D (200-1500
long), at strides of a power of two every size measured won: 16-256 channels, kernels 2-16, 32
to 512 per output element, 0.27-0.87x / 0.32-1.24x against 0.47-1.25x / 0.59-1.52x; at strides
3 and 5 a kernel as long as the stride lost at one thread (stride 5 with 32 and 64 channels
0.98x and 0.67x against 0.65x and 0.55x, stride 3 with 128 0.58x against 0.51x): onnxruntime
transposes an interleaving of 3 or 5 slowly, so 1-D takes strides of a power of two. A text
detector's kernel-2 upsamplers of 16 and 24 channels stay float (PP-OCRv4 det ran 0.54x float
at one thread with them rewritten, 0.47x without).

Only where placement serves onnxruntime's integer kernels (`prepare_model`'s `for_speed`): an
emulated target runs its own ConvTranspose, its weight quantized per output channel of the
ConvTranspose, not per phase. And only the forms this covers: a constant float weight, 1-D, or
2-D with one stride on both axes, no dilation, pads given or auto_pad SAME with an even
total (`_pads`), no output_shape, and a constant bias or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.files.large import is_external
from qcal.graph.names import NameAllocator, add_initializer
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    drop_unread_initializers,
    int_attribute,
    ints_attribute,
    string_attribute,
)

__all__ = ["ConvTransposeAsConv"]

# Multiply-adds per output element from which the rewrite pays, by spatial rank (module
# docstring).
_MIN_MACS_PER_OUTPUT = {1: 32, 2: 128}


@dataclass(frozen=True)
class _Axis:
    """One spatial axis of a ConvTranspose: stride, kernel taps, the taps of each phase (m),
    the Conv's pads before and after, and the Slice's start and how far before the end it
    stops."""

    stride: int
    kernel: int
    taps: int
    pad_before: int
    pad_after: int
    start: int
    short_of_end: int


class ConvTransposeAsConv:
    """Replace each ConvTranspose of the main graph of a form the module docstring lists by a
    Conv (named as the ConvTranspose was, so an exclusion by name still finds it), the shuffle
    of its phases and a Slice."""

    name: ClassVar[str] = "conv-transpose-as-conv"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        initializers = {t.name: t for t in graph.initializer}
        names = NameAllocator.from_model(model)
        nodes: list[onnx.NodeProto] = []
        replaced: list[str] = []
        count = 0
        for node in graph.node:
            form = _form(node, initializers)
            if form is None:
                nodes.append(node)
                continue
            weight, bias, axes, group = form
            nodes.extend(_as_conv(node, weight, bias, axes, group, graph, names))
            replaced.extend(node.input[1:])
            count += 1
        if not count:
            return StepResult(model, False)
        del graph.node[:]
        graph.node.extend(nodes)
        drop_unread_initializers(graph, set(replaced))
        return StepResult(model, True, f"wrote {count} ConvTranspose as a Conv of its stride's "
                                       "phases and their interleaving (onnxruntime has no "
                                       "integer ConvTranspose)")


def _form(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto],
          ) -> tuple[np.ndarray, np.ndarray | None, list[_Axis], int] | None:
    """The weight, bias, axes and group of a ConvTranspose this pass rewrites, else None."""
    if node.op_type != "ConvTranspose" or node.domain not in DEFAULT_DOMAINS:
        return None
    weight = _float_values(initializers.get(node.input[1])) if len(node.input) > 1 else None
    if weight is None:
        return None
    bias = None
    if len(node.input) > 2 and node.input[2]:
        bias = _float_values(initializers.get(node.input[2]))
        if bias is None:
            return None
    rank = weight.ndim - 2
    group = int_attribute(node, "group", 1)
    if rank not in (1, 2) or group < 1 or weight.shape[0] % group:
        return None
    if any(a.name == "output_shape" for a in node.attribute):
        return None
    kernel = list(weight.shape[2:])
    if ints_attribute(node, "kernel_shape", kernel) != kernel:
        return None
    strides = ints_attribute(node, "strides", [1] * rank)
    dilations = ints_attribute(node, "dilations", [1] * rank)
    extra = ints_attribute(node, "output_padding", [0] * rank)
    if len(strides) != rank or len(extra) != rank:
        return None
    pads = _pads(string_attribute(node, "auto_pad", "NOTSET"),
                 ints_attribute(node, "pads", [0] * 2 * rank), kernel, strides, extra)
    if (pads is None or len(pads) != 2 * rank
            or any(d != 1 for d in dilations) or min(strides) < 1 or min(pads) < 0
            or min(extra) < 0 or (rank == 2 and strides[0] != strides[1])):
        return None
    if bias is not None and bias.shape != (weight.shape[1] * group,):
        return None
    axes = [_axis(strides[d], kernel[d], pads[d], pads[rank + d], extra[d]) for d in range(rank)]
    if not _pays(weight.shape[0] // group, axes):
        return None
    return weight, bias, axes, group


def _pads(auto_pad: str, pads: list[int], kernel: list[int], strides: list[int],
          extra: list[int]) -> list[int] | None:
    """The pads a ConvTranspose's `auto_pad` makes (None where this pass does not cover them).
    SAME gives an output of input x stride, padded by kernel − stride + output padding in all,
    whatever the input's size (paddle2onnx writes Conv2DTranspose(padding="same") so); where
    that is odd, onnxruntime and the ONNX specification have put the extra one on different
    sides, so only even totals are written as Convs, half on each side."""
    if auto_pad == "NOTSET":
        return pads
    if auto_pad == "VALID":
        return [0] * 2 * len(kernel)
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        return None
    totals = [k - s + e for k, s, e in zip(kernel, strides, extra)]
    if any(t < 0 or t % 2 for t in totals):
        return None
    return [t // 2 for t in totals] * 2


def _pays(channels_per_group: int, axes: list[_Axis]) -> bool:
    """Whether the Conv of phases runs faster in integers than the ConvTranspose in float
    (module docstring): enough products per output element, and in 1-D a stride of a power
    of two."""
    per_output = channels_per_group * math.prod(a.taps for a in axes)
    stride = axes[0].stride
    return per_output >= _MIN_MACS_PER_OUTPUT[len(axes)] and (
        len(axes) > 1 or stride & (stride - 1) == 0)


def _float_values(tensor: onnx.TensorProto | None) -> np.ndarray | None:
    """The values of a float32 initializer the model holds (not in an external file)."""
    if tensor is None or tensor.data_type != onnx.TensorProto.FLOAT or is_external(tensor):
        return None
    return numpy_helper.to_array(tensor)


def _axis(stride: int, kernel: int, before: int, after: int, extra: int) -> _Axis:
    """How one axis is computed (module docstring). The full output z (no pads cut) is
    u = q·s + r; the Conv's output q' is phase position q' + q0, q0 = floor(pad before / s)
    (at most taps − 1: the Conv cannot pad less than nothing), so z' = z[q0·s:] and the output
    starts `pad before − q0·s` into it; what remains after its end does not depend on the
    input's length."""
    taps = math.ceil(kernel / stride)
    first = min(before // stride, taps - 1)
    pad_before = taps - 1 - first
    start = before - first * stride
    # z' is (L + pad_before + pad_after − taps + 1)·s long, the output
    # s·(L − 1) + extra + kernel − before − after from `start`: their difference less `start`
    rest = stride * (pad_before - taps + 1) + stride - extra - kernel + before + after - start
    pad_after = max(0, math.ceil(-rest / stride))
    return _Axis(stride, kernel, taps, pad_before, pad_after, start,
                 rest + stride * pad_after)


def _phase_weight(weight: np.ndarray, axes: list[_Axis], group: int) -> np.ndarray:
    """The Conv's weight ``[C_out·s^d, C_in/group, taps...]``: channel c·s^d + phase holds the
    taps r + s·m of each axis's phase r, reversed (m = taps − 1 − t), zero past the kernel."""
    rank = len(axes)
    padded_shape = [*weight.shape[:2], *(a.taps * a.stride for a in axes)]
    padded = np.zeros(padded_shape, dtype=weight.dtype)
    every: list[slice] = [slice(None), slice(None)]
    padded[tuple(every + [slice(0, a.kernel) for a in axes])] = weight
    index: list[np.ndarray] = []
    for d, a in enumerate(axes):
        phase = np.arange(a.stride)[:, None]
        reversed_tap = a.taps - 1 - np.arange(a.taps)[None, :]
        taps = phase + a.stride * reversed_tap  # [phase, t]
        index.append(taps.reshape([a.stride if k == d else 1 for k in range(rank)]
                                  + [a.taps if k == d else 1 for k in range(rank)]))
    # [C_in, C_out/g, s_1..s_d, t_1..t_d]
    where: list[slice | np.ndarray] = [*every, *index]
    gathered = padded[tuple(where)]
    c_in, c_out_g = weight.shape[:2]
    phases = math.prod(a.stride for a in axes)
    taps_shape = [a.taps for a in axes]
    gathered = gathered.reshape(group, c_in // group, c_out_g, phases, *taps_shape)
    # [group, C_out/g, phases, C_in/g, taps...] -> channel (G·C_out/g + c)·phases + phase
    order = (0, 2, 3, 1, *range(4, 4 + rank))
    return np.ascontiguousarray(gathered.transpose(order)).reshape(
        c_out_g * group * phases, c_in // group, *taps_shape)


def _as_conv(node: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray | None,
             axes: list[_Axis], group: int, graph: onnx.GraphProto, names: NameAllocator,
             ) -> list[onnx.NodeProto]:
    base = node.output[0]
    channels = weight.shape[1] * group
    phases = math.prod(a.stride for a in axes)
    inputs = [node.input[0], add_initializer(names, graph, f"{node.input[1]}_phases",
                                             _phase_weight(weight, axes, group))]
    if bias is not None:
        inputs.append(add_initializer(names, graph, f"{node.input[2]}_phases",
                                      np.repeat(bias, phases)))
    cut = any(a.start or a.short_of_end for a in axes)
    conv_out = names.allocate(f"{base}_phases") if phases > 1 or cut else base
    nodes = [helper.make_node(
        "Conv", inputs, [conv_out], name=node.name or names.allocate(f"{base}_conv"),
        kernel_shape=[a.taps for a in axes], group=group,
        pads=[a.pad_before for a in axes] + [a.pad_after for a in axes])]
    current = conv_out
    if phases > 1:
        shuffled = names.allocate(f"{base}_interleaved") if cut else base
        nodes += _interleave(current, shuffled, channels, axes, graph, names)
        current = shuffled
    if cut:
        end_values = [-a.short_of_end if a.short_of_end else np.iinfo(np.int64).max
                      for a in axes]
        starts = add_initializer(names, graph, f"{base}_starts",
                                 np.array([a.start for a in axes], np.int64))
        ends = add_initializer(names, graph, f"{base}_ends", np.array(end_values, np.int64))
        slice_axes = add_initializer(names, graph, f"{base}_axes",
                                     np.arange(2, 2 + len(axes), dtype=np.int64))
        nodes.append(helper.make_node("Slice", [current, starts, ends, slice_axes], [base],
                                      name=names.allocate(f"{base}_cut")))
    return nodes


def _interleave(source: str, target: str, channels: int, axes: list[_Axis],
                graph: onnx.GraphProto, names: NameAllocator) -> list[onnx.NodeProto]:
    """Channels c·s^d + phase of `source` to their places along the axes, in `target`."""
    if len(axes) == 2:
        return [helper.make_node("DepthToSpace", [source], [target], blocksize=axes[0].stride,
                                 mode="CRD", name=names.allocate(f"{target}_interleave"))]
    stride = axes[0].stride
    split = add_initializer(names, graph, f"{target}_split",
                            np.array([0, channels, stride, -1], np.int64))
    joined = add_initializer(names, graph, f"{target}_joined",
                             np.array([0, channels, -1], np.int64))
    by_phase = names.allocate(f"{target}_by_phase")
    by_position = names.allocate(f"{target}_by_position")
    return [
        helper.make_node("Reshape", [source, split], [by_phase],
                         name=names.allocate(f"{target}_phase_axis")),
        helper.make_node("Transpose", [by_phase], [by_position], perm=[0, 1, 3, 2],
                         name=names.allocate(f"{target}_interleave")),
        helper.make_node("Reshape", [by_position, joined], [target],
                         name=names.allocate(f"{target}_join")),
    ]

