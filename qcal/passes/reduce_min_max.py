"""Pass: compute the min and max of observed tensors inside the calibration model, so that only
a few numbers per tensor and batch leave onnxruntime.

Only the calibration model is rewritten this way (it is never written out). For each value the
pass adds, right after the node producing it (so onnxruntime reduces it while it is in cache and
frees it as in plain inference):

* ``ReduceMin``, ``ReduceMax`` and ``ReduceSumSquare``: over all axes per tensor, over all axes
  but the channel axis per channel (``axes`` an attribute before opset 18, an input from 18).
  onnxruntime's ReduceMin/ReduceMax drop a NaN unless it comes first, but a sum of squares is NaN
  exactly when a value is NaN (infinities give +inf, never NaN), so the three together give what
  numpy's ``min``/``max`` give, NaN included.
* Per tensor, the three results (``keepdims=1``) of up to 16 values of one rank are joined by
  a ``Concat`` into one output, ``[min_0, max_0, sumsq_0, min_1, ...]``: a few small arrays
  cross into Python. Per channel, each result is an output of its own (shape (C,)).

An empty tensor reduces to min = +inf > max = -inf (ONNX from opset 18, and onnxruntime before),
which no non-empty tensor gives: :func:`read_min_max` reports it as empty.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.errors import ModelError
from qcal.names import NameAllocator
from qcal.passes._graph import default_opset

__all__ = ["MinMaxLayout", "add_min_max_outputs", "read_min_max", "value_ranks"]

_AXES_INPUT_OPSET = 18  # ReduceMin/ReduceMax/ReduceSumSquare take `axes` as an input from 18
_REDUCTIONS = ("ReduceMin", "ReduceMax", "ReduceSumSquare")
# Values per Concat: onnxruntime's session setup grows quadratically with a node's input count
# (a 1200-input Concat costs 0.3 s to set up, 25 Concats of 48 inputs 0.06 s).
_STACK_VALUES = 16


@dataclass(frozen=True)
class MinMaxLayout:
    """Where the extremes of each reduced value are among the rewritten model's outputs.

    Attributes:
        stacks: per-tensor statistics: (output name, the values it covers in order); the output
            holds ``3 * len(values)`` numbers, (min, max, sum of squares) per value.
        channels: per-channel statistics: value -> (min, max, sum-of-squares output names),
            each of shape (C,).
        axes: value -> its channel axis (None per tensor).
    """

    stacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    channels: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    axes: dict[str, int | None] = field(default_factory=dict)

    @property
    def output_names(self) -> list[str]:
        """Every output the statistics need, in a fixed order."""
        names = [name for name, _ in self.stacks]
        names += [name for outputs in self.channels.values() for name in outputs]
        return names


def value_ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """Ranks of the main graph's values known from value_info, inputs and outputs."""
    ranks: dict[str, int] = {}
    for info in (*graph.value_info, *graph.input, *graph.output):
        tensor_type = info.type.tensor_type
        if info.type.HasField("tensor_type") and tensor_type.HasField("shape"):
            ranks[info.name] = len(tensor_type.shape.dim)
    return ranks


def add_min_max_outputs(
    model: onnx.ModelProto, values: Mapping[str, int | None]
) -> tuple[onnx.ModelProto, MinMaxLayout]:
    """A copy of `model` whose outputs carry the min, max and sum of squares of `values`.

    Args:
        model: the calibration model; every value must be a float32 value of its main graph.
        values: value -> channel axis (>= 0, the value's rank must then be known) or None.

    Raises:
        ModelError: a value is not produced in the main graph, or a channel axis does not fit.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not values:
        return out, MinMaxLayout()
    graph = out.graph
    names = NameAllocator.from_model(out)
    ranks = value_ranks(graph)
    opset = default_opset(out) or 1
    position = {v: i for i, node in enumerate(graph.node) for v in node.output if v}
    known = position.keys() | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    after: defaultdict[int, list[onnx.NodeProto]] = defaultdict(list)  # -1: graph start
    by_rank: defaultdict[int, list[tuple[str, list[str]]]] = defaultdict(list)
    channels: dict[str, tuple[str, str, str]] = {}
    flat_shape = ""
    for value in sorted(values):
        if value not in known:
            raise ModelError(f"tensor {value!r} to reduce is not a value of the main graph")
        axis = values[value]
        where = after[position.get(value, -1)]
        if axis is not None:
            rank = ranks.get(value)
            if rank is None or not 0 <= axis < rank:
                raise ModelError(f"tensor {value!r}: cannot reduce per channel on axis {axis}")
            kept = [a for a in range(rank) if a != axis]
            channels[value] = tuple(  # type: ignore[assignment]
                _reduce(where, names, op, value, kept, opset, keepdims=0) for op in _REDUCTIONS
            )
            continue
        rank = ranks.get(value, 0)
        reduced = [_reduce(where, names, op, value, None, opset, keepdims=1) for op in _REDUCTIONS]
        if rank == 0:  # a scalar, or rank unknown: one-element 1-D results instead
            if not flat_shape:
                flat_shape = names.allocate("qcal_stats_shape")
                graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), flat_shape))
            reduced = [_reshape(where, names, r, flat_shape) for r in reduced]
            rank = 1
        by_rank[rank].append((value, reduced))
    stacks = []
    for rank in sorted(by_rank):
        group = by_rank[rank]
        for first in range(0, len(group), _STACK_VALUES):
            chunk = group[first : first + _STACK_VALUES]
            name = names.allocate(f"qcal_stats_rank{rank}")
            inputs = [r for _, reduced in chunk for r in reduced]
            after[len(graph.node)].append(
                helper.make_node(
                    "Concat", inputs, [name], name=names.allocate(f"{name}_Concat"), axis=0
                )
            )
            graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
            stacks.append((name, tuple(v for v, _ in chunk)))
    for outputs in channels.values():
        graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs)
    _insert(graph, after)
    return out, MinMaxLayout(tuple(stacks), channels, dict(values))


def read_min_max(
    reduced: MinMaxLayout, arrays: Mapping[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray, np.ndarray] | tuple[str, None, None]]:
    """(value, min, max) per reduced value from one run's outputs; (value, None, None) when the
    value was empty in that run. Min and max are NaN where the value (channel) held a NaN."""
    for name, covered in reduced.stacks:
        stats = np.asarray(arrays[name], dtype=np.float32).reshape(len(covered), 3)
        lows, highs, squares = stats[:, 0], stats[:, 1], stats[:, 2]
        empty = (lows > highs).tolist()
        nan = np.isnan(squares)
        if nan.any():
            lows, highs = np.where(nan, np.float32(np.nan), lows), np.where(nan, np.float32(np.nan), highs)
        for value, lo, hi, is_empty in zip(covered, lows, highs, empty):
            if is_empty:
                yield value, None, None
            else:
                yield value, lo, hi
    for value, (lo_name, hi_name, sq_name) in reduced.channels.items():
        lo = np.asarray(arrays[lo_name], dtype=np.float32).reshape(-1)
        hi = np.asarray(arrays[hi_name], dtype=np.float32).reshape(-1)
        if lo.size and bool((lo > hi).all()):
            yield value, None, None
            continue
        nan = np.isnan(np.asarray(arrays[sq_name]).reshape(-1))
        if nan.any():
            lo, hi = np.where(nan, np.float32(np.nan), lo), np.where(nan, np.float32(np.nan), hi)
        yield value, lo, hi


def _reduce(
    where: list[onnx.NodeProto],
    names: NameAllocator,
    op_type: str,
    value: str,
    axes: list[int] | None,
    opset: int,
    *,
    keepdims: int,
) -> str:
    output = names.allocate(f"{value}_{op_type}")
    inputs = [value]
    attributes: dict[str, object] = {"keepdims": keepdims}
    if axes is not None and opset >= _AXES_INPUT_OPSET:
        axes_name = names.allocate(f"{value}_{op_type}_axes")
        where.append(
            helper.make_node(
                "Constant", [], [axes_name], name=names.allocate(f"{axes_name}_Constant"),
                value=numpy_helper.from_array(np.array(axes, np.int64)),
            )
        )
        inputs.append(axes_name)
    elif axes is not None:
        attributes["axes"] = axes
    where.append(
        helper.make_node(op_type, inputs, [output], name=names.allocate(output), **attributes)
    )
    return output


def _reshape(where: list[onnx.NodeProto], names: NameAllocator, value: str, shape: str) -> str:
    output = names.allocate(f"{value}_flat")
    where.append(
        helper.make_node("Reshape", [value, shape], [output], name=names.allocate(f"{output}_Reshape"))
    )
    return output


def _insert(graph: onnx.GraphProto, after: Mapping[int, list[onnx.NodeProto]]) -> None:
    """Put the new nodes right after the nodes they follow (position -1: before every node)."""
    ordered: list[onnx.NodeProto] = list(after.get(-1, ()))
    for position, node in enumerate(graph.node):
        ordered.append(node)
        ordered.extend(after.get(position, ()))
    ordered.extend(after.get(len(graph.node), ()))
    copies = [onnx.NodeProto() for _ in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
