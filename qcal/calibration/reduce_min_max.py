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

A value computed from another reduced value by a chain of Relu, Clip (constant bounds), and Add,
Sub, Mul or Div with a finite scalar constant (nonzero for the last two, the divisor for Div) is
not reduced at all: each of these float32 operations is correctly rounded (or exact) and
monotone, so its extremes are the chain applied to the source's extremes (swapped where it
decreases), bit for bit, with NaN exactly where the source has NaN (onnxruntime's Relu and Clip
keep NaN). On PP-OCR models that covers well over half of the observed values (hard-swish's
clip and division by 6, the scalar scale-and-shift after each activation).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.names import NameAllocator
from qcal.graph.structure import default_opset
from qcal.numerics.errors import ModelError

__all__ = [
    "MinMaxLayout",
    "PerTensorExtremes",
    "add_min_max_outputs",
    "read_min_max",
    "read_per_channel",
    "read_per_tensor",
    "value_ranks",
]

Extreme = np.ndarray | np.floating[Any]  # () per tensor, (C,) per channel
_AXES_INPUT_OPSET = 18  # ReduceMin/ReduceMax/ReduceSumSquare take `axes` as an input from 18
_REDUCTIONS = ("ReduceMin", "ReduceMax", "ReduceSumSquare")
# Values per Concat: onnxruntime's session setup grows quadratically with a node's input count
# (a 1200-input Concat costs 0.3 s to set up, 25 Concats of 48 inputs 0.06 s).
_STACK_VALUES = 16


@dataclass(frozen=True)
class _Derived:
    """``value = source <op> constant`` (``constant <op> source`` when `constant_first`); for
    Clip, ``constant``/``upper`` are the bounds; Relu has none. `observed`: a value of the
    layout, else an intermediate that observed values are derived through."""

    value: str
    source: str
    op_type: str
    constant: np.float32 | None
    upper: np.float32 | None
    constant_first: bool
    decreasing: bool
    observed: bool


@dataclass(frozen=True)
class MinMaxLayout:
    """Where the extremes of each reduced value are among the rewritten model's outputs.

    Attributes:
        stacks: per-tensor statistics: (output name, the values it covers in order); the output
            holds ``3 * len(values)`` numbers, (min, max, sum of squares) per value.
        channels: per-channel statistics: value -> (min, max, sum-of-squares output names),
            each of shape (C,).
        axes: value -> its channel axis (None per tensor).
        derived: per-tensor values whose extremes follow from another value's, in an order
            where each source comes first.
    """

    stacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    channels: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    axes: dict[str, int | None] = field(default_factory=dict)
    derived: tuple[_Derived, ...] = ()

    @property
    def output_names(self) -> list[str]:
        """Every output the statistics need, in a fixed order."""
        names = [name for name, _ in self.stacks]
        names += [name for outputs in self.channels.values() for name in outputs]
        return names

    @property
    def per_tensor_values(self) -> tuple[str, ...]:
        """The per-tensor values, in the order :func:`read_per_tensor` gives them."""
        return self._program.values

    @cached_property
    def _program(self) -> _Program:
        return _Program.build(self)


@dataclass(frozen=True)
class PerTensorExtremes:
    """The per-tensor extremes of one run, one entry per value, as arrays.

    Attributes:
        values: the layout's per-tensor values (intermediates of derivations left out), in the
            order :func:`read_min_max` yields them.
        lows: float32 minima, NaN where the value held a NaN; meaningless where `empty`.
        highs: float32 maxima, likewise.
        empty: bool, True where the value had no elements in that run.
    """

    values: tuple[str, ...]
    lows: np.ndarray
    highs: np.ndarray
    empty: np.ndarray


@dataclass(frozen=True)
class _Step:
    """One derivation operation applied to several values at once (all sources computed)."""

    op_type: str  # "Clip" (Relu included: bounds 0 and +inf), "Add", "Sub", "Mul" or "Div"
    constant_first: bool
    sources: np.ndarray  # int64 slots
    targets: np.ndarray  # int64 slots
    constants: np.ndarray  # float32; Clip: the lower bounds (-inf: none)
    uppers: np.ndarray  # float32 Clip upper bounds (+inf: none)
    decreasing: np.ndarray  # bool


@dataclass(frozen=True)
class _Program:
    """How :func:`read_per_tensor` computes every per-tensor value of a layout with a few array
    operations: the stacked results fill the first slots, then derivations run level by level.

    The operations are those of :meth:`_Derived.apply`, elementwise on float32 arrays (numpy's
    array and scalar loops round alike; ``maximum``/``minimum`` pick the same operand, signed
    zeros and NaN included); a Clip bound that is missing is +-inf, which selects the operand
    unchanged.
    """

    stacks: tuple[str, ...]
    stacked: int  # slots filled from the stacks
    slots: int
    steps: tuple[_Step, ...]
    observed: np.ndarray  # int64 slots of `values`
    values: tuple[str, ...]

    @classmethod
    def build(cls, layout: MinMaxLayout) -> _Program:
        order = [v for _, covered in layout.stacks for v in covered]
        stacked = len(order)
        depth = dict.fromkeys(order, 0)
        levels: defaultdict[tuple[int, str, bool], list[_Derived]] = defaultdict(list)
        for rule in layout.derived:
            depth[rule.value] = depth[rule.source] + 1
            op_type = "Clip" if rule.op_type == "Relu" else rule.op_type
            levels[depth[rule.value], op_type, rule.constant_first].append(rule)
            order.append(rule.value)
        slot = {v: i for i, v in enumerate(order)}
        steps = []
        for (_, op_type, constant_first), rules in sorted(levels.items()):
            lower = [_bound(r.constant, -np.inf) for r in rules]
            if op_type == "Clip":
                lower = [np.float32(0.0) if r.op_type == "Relu" else b for r, b in zip(rules, lower)]
            steps.append(
                _Step(
                    op_type,
                    constant_first,
                    np.array([slot[r.source] for r in rules], dtype=np.int64),
                    np.array([slot[r.value] for r in rules], dtype=np.int64),
                    np.array(lower, dtype=np.float32),
                    np.array([_bound(r.upper, np.inf) for r in rules], dtype=np.float32),
                    np.array([r.decreasing for r in rules], dtype=bool),
                )
            )
        values = tuple(v for v in order if v in layout.axes)
        return cls(
            tuple(name for name, _ in layout.stacks),
            stacked,
            len(order),
            tuple(steps),
            np.array([slot[v] for v in values], dtype=np.int64),
            values,
        )

    def run(self, arrays: Mapping[str, np.ndarray]) -> PerTensorExtremes:
        lows = np.empty(self.slots, dtype=np.float32)
        highs = np.empty(self.slots, dtype=np.float32)
        empty = np.zeros(self.slots, dtype=bool)
        if self.stacks:
            stats = np.concatenate(
                [np.asarray(arrays[name], dtype=np.float32).reshape(-1) for name in self.stacks]
            ).reshape(self.stacked, 3)
            n = self.stacked
            lows[:n], highs[:n] = stats[:, 0], stats[:, 1]
            empty[:n] = stats[:, 0] > stats[:, 1]
            nan = np.isnan(stats[:, 2])
            if nan.any():  # numpy's min/max give this NaN too
                lows[:n][nan] = np.float32(np.nan)
                highs[:n][nan] = np.float32(np.nan)
        with np.errstate(all="ignore"):  # inf/NaN extremes go through as in the kernels
            for step in self.steps:
                lo = _apply(step, lows[step.sources])
                hi = _apply(step, highs[step.sources])
                lows[step.targets] = np.where(step.decreasing, hi, lo)
                highs[step.targets] = np.where(step.decreasing, lo, hi)
                empty[step.targets] = empty[step.sources]
        return PerTensorExtremes(
            self.values, lows[self.observed], highs[self.observed], empty[self.observed]
        )


def _bound(value: np.float32 | None, default: float) -> np.float32:
    return cast(np.float32, np.float32(default if value is None else value))


def _apply(step: _Step, x: np.ndarray) -> np.ndarray:
    """:meth:`_Derived.apply` of the step's rules, elementwise."""
    c = step.constants
    result: np.ndarray
    if step.op_type == "Clip":
        result = np.minimum(np.maximum(x, c), step.uppers)
        return result
    a, b = (c, x) if step.constant_first else (x, c)
    if step.op_type == "Add":
        result = a + b
    elif step.op_type == "Sub":
        result = a - b
    elif step.op_type == "Mul":
        result = a * b
    else:
        result = a / b
    return result


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
    derived = _derivations(graph, {v for v, axis in values.items() if axis is None})
    for value in sorted(values):
        if value not in known:
            raise ModelError(f"tensor {value!r} to reduce is not a value of the main graph")
        if value in derived:
            continue
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
                graph.initializer.append(
                    numpy_helper.from_array(np.array([1], np.int64), flat_shape)
                )
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
        graph.output.extend(
            helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs
        )
    _insert(graph, after)
    return out, MinMaxLayout(tuple(stacks), channels, dict(values), tuple(derived.values()))


def _derivations(graph: onnx.GraphProto, per_tensor: set[str]) -> dict[str, _Derived]:
    """Per-tensor values whose extremes follow from another per-tensor value's through a chain
    of monotone operations (graph order; intermediates that are not values of the layout are
    kept only where an observed value is derived through them)."""
    constants = {t.name: t for t in graph.initializer}
    inputs = {v.name for v in graph.input}
    found: dict[str, _Derived] = {}
    for node in graph.node:
        rule = _monotone(node, constants, inputs)
        if rule is None or rule.value in found:
            continue
        if rule.source not in per_tensor and rule.source not in found:
            continue
        observed = rule.value in per_tensor
        found[rule.value] = _Derived(**{**rule.__dict__, "observed": observed})
    needed: set[str] = set()
    for rule in reversed(list(found.values())):
        if rule.observed or rule.value in needed:
            needed.add(rule.source)
    return {v: r for v, r in found.items() if r.observed or v in needed}


def _monotone(
    node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto], inputs: set[str]
) -> _Derived | None:
    """The rule when `node` maps one value monotonically and exactly (see the module docstring)."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.input:
        return None
    value = node.output[0]

    def scalar(name: str) -> np.float32 | None:
        return None if name in inputs else _scalar(constants.get(name))

    if node.op_type == "Relu" and len(node.input) == 1:
        return _Derived(value, node.input[0], "Relu", None, None, False, False, False)
    if node.op_type == "Clip":
        bounds = [scalar(v) if v else None for v in node.input[1:3]]
        if any(v and b is None for v, b in zip(node.input[1:3], bounds)):
            return None  # a bound that is not a finite scalar constant
        for attribute in node.attribute:  # opset < 11: bounds are attributes
            if attribute.name in ("min", "max") and np.isfinite(attribute.f):
                bounds[0 if attribute.name == "min" else 1] = np.float32(attribute.f)
        bounds += [None] * (2 - len(bounds))
        return _Derived(value, node.input[0], "Clip", bounds[0], bounds[1], False, False, False)
    if node.op_type not in ("Add", "Sub", "Mul", "Div") or len(node.input) != 2:
        return None
    first, second = scalar(node.input[0]), scalar(node.input[1])
    if (first is None) == (second is None):
        return None  # no constant, or two: nothing to derive from
    constant_first = first is not None
    constant = first if constant_first else second
    assert constant is not None
    if node.op_type in ("Mul", "Div") and constant == 0:
        return None  # x * 0 is not monotone (and inf * 0 is NaN)
    if node.op_type == "Div" and constant_first:
        return None  # c / x is not monotone across 0
    decreasing = (node.op_type == "Sub" and constant_first) or (
        node.op_type in ("Mul", "Div") and bool(constant < 0)
    )
    source = node.input[1] if constant_first else node.input[0]
    return _Derived(value, source, node.op_type, constant, None, constant_first, decreasing, False)


def _scalar(tensor: onnx.TensorProto | None) -> np.float32 | None:
    """The value of a finite one-element float32 initializer, else None."""
    if tensor is None or tensor.data_type != TensorProto.FLOAT:
        return None
    if int(np.prod(tensor.dims, dtype=np.int64)) != 1:
        return None
    value = numpy_helper.to_array(tensor).reshape(-1)[0]
    return np.float32(value) if np.isfinite(value) else None


def read_per_tensor(reduced: MinMaxLayout, arrays: Mapping[str, np.ndarray]) -> PerTensorExtremes:
    """The per-tensor extremes of one run's outputs, as :func:`read_min_max` gives them, in
    arrays (a few array operations per run however many values the layout holds)."""
    return reduced._program.run(arrays)


def read_min_max(
    reduced: MinMaxLayout, arrays: Mapping[str, np.ndarray]
) -> Iterator[tuple[str, Extreme, Extreme] | tuple[str, None, None]]:
    """(value, min, max) per value of the layout from one run's outputs; (value, None, None)
    when the value was empty in that run. Min and max are NaN where the value (channel) held a
    NaN."""
    per_tensor = read_per_tensor(reduced, arrays)
    for value, lo, hi, is_empty in zip(
        per_tensor.values, per_tensor.lows, per_tensor.highs, per_tensor.empty.tolist()
    ):
        if is_empty:
            yield value, None, None
        else:
            yield value, lo, hi
    yield from read_per_channel(reduced, arrays)


def read_per_channel(
    reduced: MinMaxLayout, arrays: Mapping[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray, np.ndarray] | tuple[str, None, None]]:
    """The per-channel part of :func:`read_min_max`: (value, min, max), shape (C,) each."""
    for value, (lo_name, hi_name, sq_name) in reduced.channels.items():
        lo = np.asarray(arrays[lo_name], dtype=np.float32).reshape(-1)
        hi = np.asarray(arrays[hi_name], dtype=np.float32).reshape(-1)
        if lo.size and bool((lo > hi).all()):
            yield value, None, None
            continue
        squares = np.asarray(arrays[sq_name], dtype=np.float32).reshape(-1)
        nan = np.isnan(squares)
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
    attributes: dict[str, Any] = {"keepdims": keepdims}
    if axes is not None and opset >= _AXES_INPUT_OPSET:
        axes_name = names.allocate(f"{value}_{op_type}_axes")
        where.append(
            helper.make_node(
                "Constant",
                [],
                [axes_name],
                name=names.allocate(f"{axes_name}_Constant"),
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
        helper.make_node(
            "Reshape", [value, shape], [output], name=names.allocate(f"{output}_Reshape")
        )
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
