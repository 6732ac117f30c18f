"""The graph-building side of the in-graph min/max pass: adds the reduction nodes right after
each observed value's producer, stacks per-tensor results into a few ``Concat`` outputs, and
finds the values whose extremes follow from another's through a monotone operation (so they
need no reduction of their own).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.calibration.reduce_min_max._layout import MinMaxLayout, _Derived
from qcal.graph.names import NameAllocator
from qcal.graph.shapes import value_ranks
from qcal.graph.structure import default_opset, insert_after
from qcal.numerics.errors import ModelError

_AXES_INPUT_OPSET = 18  # ReduceMin/ReduceMax/ReduceSumSquare take `axes` as an input from 18
_REDUCTIONS = ("ReduceMin", "ReduceMax", "ReduceSumSquare")
# Values per Concat: onnxruntime's session setup grows quadratically with a node's input count
# (a 1200-input Concat costs 0.3 s to set up, 25 Concats of 48 inputs 0.06 s).
_STACK_VALUES = 16


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
    insert_after(graph, after)
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
