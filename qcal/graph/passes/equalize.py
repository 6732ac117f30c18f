"""Cross-layer equalization (Nagel et al. 2019): even out the per-channel weight ranges of
consecutive convolutions, a weights-only rewrite that keeps the float model's outputs.

For a Conv A whose output feeds only a Conv B, directly or through one positive-homogeneous
activation f (``f(x / s) = f(x) / s`` for ``s > 0``: Relu, LeakyRelu, PRelu with one slope),
dividing output channel i of A (its weight and bias) by ``s_i`` and multiplying the matching
input channel of B by ``s_i`` leaves B's output unchanged. With ``r1_i`` the largest magnitude
of A's output channel i and ``r2_i`` that of B's input channel i,

    s_i = sqrt(r1_i * r2_i) / r2_i

makes both ``sqrt(r1_i * r2_i)``: after the rewrite every channel of the pair has the same share
of its weight's range, which is what per-tensor weight quantization (one scale for all channels)
needs. B may be grouped (a depthwise Conv, or a pointwise Conv after a depthwise one): input
channel i is then column ``i mod (C / groups)`` of B's output channels in group
``i div (C / groups)``. BatchNormalization after a Conv is folded before this pass runs
(`qcal.graph.passes.fold_batchnorm`), so its scale is part of A's weight.

Clip (Relu6) is not positive-homogeneous (its bounds would have to move per channel): pairs
joined by it, or by anything else, are left alone. In a chain A -> B -> C, equalizing (B, C)
changes B's output ranges and (A, B) again: the sweeps repeat until no scale moves by more than
`_CONVERGED` (at most `_MAX_SWEEPS`). A dead channel (range under `_DEAD` of its weight's
largest) keeps s = 1: there is nothing to balance, and a vanishing s would inflate A's bias. Scales accumulate in float64 and each weight is rounded once
to its type at the end, so the float outputs agree with the original's to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, int_attribute

__all__ = ["EqualizeLayers", "EqualizedPair", "conv_parameters", "own_float_parameters"]

_MAX_SWEEPS = 20
_CONVERGED = 1e-4  # a sweep whose every scale is within this of 1 changes nothing that matters
_DEAD = 1e-6  # a channel below this fraction of its weight's largest range is dead: left as is
_HOMOGENEOUS = frozenset({"Relu", "LeakyRelu", "PRelu"})
_FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class EqualizedPair:
    """One equalized pair: its two Conv nodes and what the rewrite did to them.

    Attributes:
        first, second: the Conv nodes' names (A, whose output channels are divided; B).
        through: the activation between them, or "" when A feeds B directly.
        min_scale, max_scale: the extremes of the total per-channel scale ``s``.
        range_ratio_before, range_ratio_after: the largest over the smallest channel magnitude
            of A's weight (its output channels, dead ones aside), before and after; 1 is even.
    """

    first: str
    second: str
    through: str
    min_scale: float
    max_scale: float
    range_ratio_before: float
    range_ratio_after: float

    def to_json(self) -> dict[str, object]:
        return {
            "first": self.first, "second": self.second, "through": self.through,
            "min_scale": self.min_scale, "max_scale": self.max_scale,
            "range_ratio_before": self.range_ratio_before,
            "range_ratio_after": self.range_ratio_after,
        }


@dataclass
class _Pair:
    first: onnx.NodeProto
    second: onnx.NodeProto
    through: str
    scale: np.ndarray  # accumulated s, float64


class EqualizeLayers:
    """Equalize every Conv -> [Relu | LeakyRelu | PRelu] -> Conv pair of the main graph.

    A pair qualifies when: A's output (and the activation's) has one reader and is no graph
    output; both weights (and A's bias) are float32 initializers no graph input overrides and
    no other node reads; A's output channels are B's input channels. `pairs` holds what the last
    call did.
    """

    name: ClassVar[str] = "equalize"

    def __init__(self) -> None:
        self.pairs: tuple[EqualizedPair, ...] = ()

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        pairs = [p for p in (_pair_from(node, index) for node in graph.node) if p is not None]
        if not pairs:
            self.pairs = ()
            return StepResult(model, False)
        weights = {
            name: tensor_array(index.initializers[name]).astype(np.float64)
            for p in pairs for name in conv_parameters(p.first) + (p.second.input[1],)
        }
        before = {id(p): _range_ratio(_output_ranges(weights[p.first.input[1]])) for p in pairs}
        for _ in range(_MAX_SWEEPS):
            moved = 0.0
            for pair in pairs:
                groups = int_attribute(pair.second, "group", 1)
                step = _scales(_output_ranges(weights[pair.first.input[1]]),
                               _input_ranges(weights[pair.second.input[1]], groups))
                _apply(weights, pair, step)
                pair.scale *= step
                moved = max(moved, float(np.max(np.abs(step - 1.0), initial=0.0)))
            if moved <= _CONVERGED:
                break
        for name, array in weights.items():
            tensor = index.initializers[name]
            tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))
        self.pairs = tuple(
            EqualizedPair(
                first=p.first.name, second=p.second.name, through=p.through,
                min_scale=float(p.scale.min()), max_scale=float(p.scale.max()),
                range_ratio_before=before[id(p)],
                range_ratio_after=_range_ratio(_output_ranges(weights[p.first.input[1]])),
            )
            for p in pairs
        )
        count = len(pairs)
        return StepResult(model, True, f"equalized {count} Conv pair{'s' * (count != 1)}")


def _pair_from(first: onnx.NodeProto, index: UseIndex) -> _Pair | None:
    """The pair starting at `first`, when it qualifies."""
    if not _is_conv(first) or not own_float_parameters(first, index):
        return None
    value, through = first.output[0], ""
    reader = index.only_reader(value)
    if reader is not None and reader.op_type in _HOMOGENEOUS and reader.domain in DEFAULT_DOMAINS:
        if not _homogeneous(reader, index):
            return None
        through, value = reader.name or reader.op_type, reader.output[0]
        reader = index.only_reader(value)
    if reader is None or not _is_conv(reader) or reader.input[0] != value:
        return None
    if not own_float_parameters(reader, index, with_bias=False):
        return None
    first_weight = index.constant(first.input[1])
    second_weight = index.constant(reader.input[1])
    assert first_weight is not None and second_weight is not None
    if len(second_weight.dims) < 2:
        return None
    if first_weight.dims[0] != second_weight.dims[1] * int_attribute(reader, "group", 1):
        return None  # A's output channels are not B's input channels
    return _Pair(first, reader, through, np.ones(first_weight.dims[0], dtype=np.float64))


def _is_conv(node: onnx.NodeProto) -> bool:
    return node.op_type == "Conv" and node.domain in DEFAULT_DOMAINS and len(node.input) > 1


def _homogeneous(node: onnx.NodeProto, index: UseIndex) -> bool:
    """Relu and LeakyRelu always; PRelu when its slope is one constant value."""
    if node.op_type != "PRelu":
        return True
    slope = index.constant(node.input[1]) if len(node.input) > 1 else None
    return slope is not None and int(np.prod(slope.dims)) == 1


def conv_parameters(conv: onnx.NodeProto) -> tuple[str, ...]:
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    return (conv.input[1], conv.input[2]) if has_bias else (conv.input[1],)


def own_float_parameters(conv: onnx.NodeProto, index: UseIndex, *, with_bias: bool = True) -> bool:
    """Whether the Conv's weight (and bias) are float32 initializers read by it alone."""
    names = conv_parameters(conv) if with_bias else (conv.input[1],)
    for name in names:
        tensor = index.constant(name)
        if tensor is None or tensor.data_type != _FLOAT or not tensor.dims:
            return False
        if len(index.uses.get(name, ())) != 1 or name in index.graph_outputs:
            return False
    return True


def _output_ranges(weight: np.ndarray) -> np.ndarray:
    """Largest magnitude of each output channel (axis 0)."""
    ranges: np.ndarray = np.max(np.abs(weight.reshape(weight.shape[0], -1)), axis=1)
    return ranges


def _input_ranges(weight: np.ndarray, groups: int) -> np.ndarray:
    """Largest magnitude of each input channel of a (grouped) Conv weight (M, C/g, ...)."""
    per_group = weight.reshape(groups, weight.shape[0] // groups, weight.shape[1], -1)
    ranges: np.ndarray = np.max(np.abs(per_group), axis=(1, 3)).reshape(-1)
    return ranges


def _scales(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """s = sqrt(r1 r2) / r2 per channel; 1 where either side's channel is dead (nothing to
    balance, and dividing by a vanishing s would blow up A's bias)."""
    scale = np.ones_like(first)
    live = _live(first) & _live(second)
    scale[live] = np.sqrt(first[live] * second[live]) / second[live]
    return scale


def _live(ranges: np.ndarray) -> np.ndarray:
    """Channels whose range is at least `_DEAD` of the largest: the others carry nothing (their
    weights round to 0 in any 8-bit per-tensor grid many times over)."""
    finite = np.isfinite(ranges)
    largest = float(np.max(ranges[finite], initial=0.0))
    live: np.ndarray = finite & (ranges > 0) & (ranges >= largest * _DEAD)
    return live


def _apply(weights: dict[str, np.ndarray], pair: _Pair, scale: np.ndarray) -> None:
    first = weights[pair.first.input[1]]
    first /= scale.reshape((-1,) + (1,) * (first.ndim - 1))
    if len(pair.first.input) > 2 and pair.first.input[2]:
        weights[pair.first.input[2]] /= scale.reshape(weights[pair.first.input[2]].shape)
    second = weights[pair.second.input[1]]
    groups = int_attribute(pair.second, "group", 1)
    shaped = second.reshape(groups, second.shape[0] // groups, second.shape[1], -1)
    shaped *= scale.reshape(groups, 1, second.shape[1], 1)


def _range_ratio(ranges: np.ndarray) -> float:
    live = ranges[_live(ranges)]
    return float(live.max() / live.min()) if live.size else 1.0
