"""The sums of a layer's input that bias correction needs, computed inside onnxruntime.

Bias correction needs, per Conv/MatMul/Gemm, the sum over every output position of each input
the layer multiplies (each channel at each kernel tap, with the Conv's zero padding), both as
the quantized model sees it (centred integer codes) and as the float model does (integer steps
of scale / FINE_STEPS). Taken in numpy, that means handing every layer input to Python and
passing over it there several times: on a detector with large feature maps, seven times the
cost of running the model. Here the graph computes them and only a few numbers per layer leave
onnxruntime.

The nodes give the integers `hessians` gives in numpy, value for value:

* codes: ``QuantizeLinear`` (float32 division by the scale, half to even, saturation: numpy's
  own steps), then ``DequantizeLinear`` with scale 1, which gives the centred codes as float32
  integers;
* fine steps: float32 ``Mul`` by FINE_STEPS / scale, ``Round``, ``Clip`` to +-FINE_LIMIT,
  ``Cast`` to int64;
* a Conv's tap sums, one spatial axis at a time. Along an axis of stride 1 a tap reads a
  contiguous run of positions: the sum of the whole axis less the few rows its padding and
  dilation leave out at either end (the padding itself holds zeros and adds nothing). Along a
  strided axis each tap's positions are a strided ``Slice``. A ``Concat`` of the taps, then a
  sum over the batch. A pointwise Conv (1x1, stride 1, no padding) has one tap: a sum over
  every axis but the channels'. A MatMul/Gemm input is summed over all but its last axis (a Gemm with
  transA: over its second).

Every sum is of integers and exact, so the order onnxruntime adds in does not matter. The codes
are summed along the first axis in float32 (onnxruntime's integer reductions are several times
slower), exact while 255 x that axis' length stays below 2^24; past that, or when the input
holds a NaN (a float32 sum of the whole input, also an output, shows it), `read_sums` declines
the batch and the caller takes it in numpy. Only 8-bit codes of float32 values of the main
graph, in models of opset 13 or later (``ReduceSum`` takes its axes as an input), are summed
here; `in_graph` says which.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.calibration.collect import expose_tensors
from qcal.calibration.runtime import create_session, run_feed
from qcal.graph.names import NameAllocator
from qcal.graph.structure import default_opset, element_types, insert_after

__all__ = [
    "FINE_LIMIT", "FINE_STEPS", "Retake", "SumOutputs", "add_sum_outputs", "in_graph", "read_sums",
]

# The float input's sums are kept in integer steps of scale / FINE_STEPS: exact and the same
# in any order, to within 1/FINE_STEPS of a code step (far below what a bias can hold).
FINE_STEPS = 1 << 16
# |x| / fine step at most this (2^15 code steps: far outside any range): the sums of a
# sample's values stay exact in float64 up to 2^22 values per channel, in int64 beyond.
FINE_LIMIT = float(1 << 31)
_MIN_OPSET = 13
_THROUGH_END = np.iinfo(np.int64).max
_EIGHT_BITS = {(0, 255): np.dtype(np.uint8), (-128, 127): np.dtype(np.int8)}
# Float32 sums of centred 8-bit codes (|code| <= 255) are exact along an axis up to this long.
_EXACT_LENGTH = (1 << 24) // 255


class Layer(Protocol):
    """What the sums need of a layer (a `hessians.HessianTarget`)."""

    @property
    def node(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def scale(self) -> float: ...
    @property
    def zero_point(self) -> int: ...
    @property
    def code_range(self) -> tuple[int, int]: ...
    @property
    def groups(self) -> int: ...
    @property
    def kernel(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def pads(self) -> tuple[int, ...]: ...
    @property
    def dilations(self) -> tuple[int, ...]: ...
    @property
    def transposed(self) -> bool: ...
    @property
    def inputs_per_group(self) -> int: ...


L = TypeVar("L", bound=Layer)


@dataclass(frozen=True)
class SumOutputs:
    """The outputs holding one layer's sums: codes and fine steps (int64, the weight's order of
    inputs), the input's shape and the float32 sum of the whole input (NaN shows there)."""

    codes: str
    fine: str
    shape: str
    total: str


def in_graph(model: onnx.ModelProto, layers: Sequence[L]) -> list[L]:
    """The layers whose sums onnxruntime can take (the others' are taken in numpy)."""
    if (default_opset(model) or 0) < _MIN_OPSET:
        return []
    graph = model.graph
    produced = {v for node in graph.node for v in node.output} | {v.name for v in graph.input}
    types = element_types(graph)
    return [layer for layer in layers
            if layer.tensor in produced and types.get(layer.tensor) == TensorProto.FLOAT
            and layer.code_range in _EIGHT_BITS]


def add_sum_outputs(
    model: onnx.ModelProto, layers: Sequence[Layer]
) -> tuple[onnx.ModelProto, dict[str, SumOutputs]]:
    """A copy of `model` whose outputs also carry each layer's sums (every layer `in_graph`),
    by layer node name."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = NameAllocator.from_model(out)
    position = {v: i for i, node in enumerate(graph.node) for v in node.output if v}
    after: defaultdict[int, list[onnx.NodeProto]] = defaultdict(list)
    found: dict[str, SumOutputs] = {}
    # per tensor (its quantization is the same for every layer reading it): codes, fine, shape
    # and total, built once
    shared: dict[str, tuple[str, str, str, str]] = {}
    for layer in layers:
        build = _Builder(after[position.get(layer.tensor, -1)], names, graph)
        if layer.tensor not in shared:
            shared[layer.tensor] = (build.codes(layer), build.fine(layer),
                                    build.node("Shape", [layer.tensor]),
                                    build.node("ReduceSum", [layer.tensor], keepdims=0))
        codes, fine, shape, total = shared[layer.tensor]
        found[layer.node] = SumOutputs(build.sums(codes, layer, exact_below=True),
                                       build.sums(fine, layer, exact_below=False), shape, total)
    outputs = {name: TensorProto.INT64 for o in found.values() for name in (o.codes, o.fine)}
    for o in found.values():
        outputs.update({o.shape: TensorProto.INT64, o.total: TensorProto.FLOAT})
    graph.output.extend(helper.make_tensor_value_info(name, dtype, None)
                        for name, dtype in outputs.items())
    insert_after(graph, after)
    return out, found


def read_sums(layer: Layer, outputs: SumOutputs, values: Mapping[str, np.ndarray]
              ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """One batch's code sums and fine sums, (groups, inputs per group) int64, and the positions
    they cover; None when they may not be exact (the input holds a NaN, or the first axis
    summed is too long for float32): the caller takes that batch in numpy."""
    shape = [int(v) for v in values[outputs.shape]]
    if np.isnan(values[outputs.total]):
        return None
    if layer.kernel:
        spatial = len(layer.kernel)
        out = [(shape[2 + a] + layer.pads[a] + layer.pads[spatial + a]
                - layer.dilations[a] * (layer.kernel[a] - 1) - 1) // layer.strides[a] + 1
               for a in range(spatial)]
        positions = shape[0] * int(np.prod(out)) if min(out) > 0 else 0
        first = shape[2]
    else:
        positions = shape[1] if layer.transposed else int(np.prod(shape[:-1]))
        first = positions
    if first > _EXACT_LENGTH:
        return None
    codes = np.asarray(values[outputs.codes], np.int64).reshape(layer.groups, -1)
    fine = np.asarray(values[outputs.fine], np.int64).reshape(layer.groups, -1)
    return codes, fine, positions


class _Builder:
    """Appends one layer's nodes to `where`, right after the node producing its input."""

    def __init__(self, where: list[onnx.NodeProto], names: NameAllocator,
                 graph: onnx.GraphProto) -> None:
        self.where, self.names, self.graph = where, names, graph

    def node(self, op_type: str, inputs: Sequence[str], **attributes: Any) -> str:
        output = self.names.allocate(f"qcal_layer_sum_{op_type}")
        self.where.append(helper.make_node(op_type, list(inputs), [output],
                                           name=self.names.allocate(f"{output}_node"),
                                           **attributes))
        return output

    def constant(self, value: np.ndarray | np.generic) -> str:
        name = self.names.allocate("qcal_layer_sum_const")
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def codes(self, layer: Layer) -> str:
        """The centred codes, float32 integers."""
        zero = self.constant(np.array(layer.zero_point, _EIGHT_BITS[layer.code_range]))
        quantized = self.node("QuantizeLinear", [
            layer.tensor, self.constant(np.float32(layer.scale)), zero])
        return self.node("DequantizeLinear", [quantized, self.constant(np.float32(1.0)), zero])

    def fine(self, layer: Layer) -> str:
        steps = self.node("Round", [self.node("Mul", [layer.tensor, self.constant(
            np.float32(FINE_STEPS / layer.scale))])])
        clipped = self.node("Clip", [steps, self.constant(np.float32(-FINE_LIMIT)),
                                     self.constant(np.float32(FINE_LIMIT))])
        return self.node("Cast", [clipped], to=TensorProto.INT64)

    def sums(self, value: str, layer: Layer, *, exact_below: bool) -> str:
        """The int64 sums of `value` per input of the layer: (channels, taps...) for a Conv,
        (inputs,) for a MatMul/Gemm. With `exact_below`, `value` is float32 and its sums are
        exact along the first axis summed only (_EXACT_LENGTH): they go on in int64."""
        def wide(summed: str) -> str:
            return self.node("Cast", [summed], to=TensorProto.INT64) if exact_below else summed

        if not layer.kernel:
            if layer.transposed:  # a Gemm's (K, M) input
                return wide(self._sum(value, 1, keepdims=0))
            rows = self.node("Reshape", [value, self.constant(
                np.array([-1, layer.inputs_per_group], np.int64))])
            return wide(self._sum(rows, 0, keepdims=0))
        spatial = list(range(2, 2 + len(layer.kernel)))
        if not any(layer.pads) and all(k == 1 for k in (*layer.kernel, *layer.strides)):
            # a pointwise Conv: every position, each channel's one tap
            first = wide(self._sum(value, 2)) if exact_below else value
            return self._sum(first, 0, *spatial, keepdims=0)
        for a in range(len(layer.kernel)):
            taps = self._taps(value, layer, a)
            value = taps[0] if len(taps) == 1 else self.node("Concat", taps, axis=2 + a)
            if a == 0:
                value = wide(value)
        return self._sum(value, 0, keepdims=0)

    def _taps(self, value: str, layer: Layer, a: int) -> list[str]:
        """Per kernel tap, the sum over axis 2 + a of the positions it reads (keepdims)."""
        spatial, axis = len(layer.kernel), 2 + a
        begin, end_pad = layer.pads[a], layer.pads[spatial + a]
        step, dilation, kernel = layer.strides[a], layer.dilations[a], layer.kernel[a]
        runs = []
        for tap in range(kernel):
            # In padded coordinates the tap reads tap * dilation + j * step, up to (exclusive)
            # padded size - dilation * (kernel - 1 - tap); in the input's, less the begin pad.
            start = tap * dilation - begin
            if start < 0:
                start -= (start // step) * step  # the first position inside the input
            runs.append((start, end_pad - dilation * (kernel - 1 - tap)))  # end: from the end
        if step > 1:
            return [self._sum(self._slice(value, axis, start,
                                          end if end < 0 else _THROUGH_END, step), axis)
                    for start, end in runs]
        whole = self._sum(value, axis)
        # Stride 1: the whole axis less the rows before `start` and from `end` on. The two
        # never overlap in a Conv onnxruntime runs (its output would be empty).
        taps = []
        for start, end in runs:
            total = whole
            if start > 0:
                total = self.node("Sub", [total, self._sum(
                    self._slice(value, axis, 0, start, 1), axis)])
            if end < 0:
                total = self.node("Sub", [total, self._sum(
                    self._slice(value, axis, end, _THROUGH_END, 1), axis)])
            taps.append(total)
        return taps

    def _slice(self, value: str, axis: int, start: int, end: int, step: int) -> str:
        return self.node("Slice", [value, *(self.constant(np.array([v], np.int64))
                                            for v in (start, end, axis, step))])

    def _sum(self, value: str, *axes: int, keepdims: int = 1) -> str:
        return self.node("ReduceSum", [value, self.constant(np.array(axes, np.int64))],
                         keepdims=keepdims)


class Retake:
    """The inputs of the layers summed in onnxruntime, for the rare batch whose sums are not
    exact there (see `read_sums`): a session exposing them, opened on first need."""

    def __init__(self, model: onnx.ModelProto, layers: Sequence[Layer],
                 providers: tuple[str, ...], threads: int) -> None:
        self.model, self.providers, self.threads = model, providers, threads
        self.tensors = sorted({t.tensor for t in layers})
        self.session: Any = None
        self.values: dict[str, np.ndarray] | None = None

    def tensor(self, name: str, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        if self.session is None:
            self.session = create_session(
                expose_tensors(self.model, self.tensors), providers=self.providers,
                threads=self.threads, what="layer-input model", node_order=True)
        if self.values is None:
            self.values = run_feed(self.session, self.tensors, feed,
                                   what="layer-input pass (GPTQ, bias correction)")
        return self.values[name]

    def forget(self) -> None:
        """Drop the batch's inputs (the next batch is a new feed)."""
        self.values = None
