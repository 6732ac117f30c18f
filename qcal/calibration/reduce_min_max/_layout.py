"""The bookkeeping side of the in-graph min/max pass: where each reduced value's statistics are
among the rewritten model's outputs (`MinMaxLayout`), the derivations that stand in for a
reduction, and reading one run's outputs back into per-value extremes (per tensor in a few array
operations through `_Program`, per channel one value at a time).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import numpy as np

Extreme = np.ndarray | np.floating[Any]  # () per tensor, (C,) per channel


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
                lower = [
                    np.float32(0.0) if r.op_type == "Relu" else b for r, b in zip(rules, lower)
                ]
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
