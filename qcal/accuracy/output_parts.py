"""Outputs that join separately computed tensors: their parts, each compared on its own.

A detector's single output often concatenates what its heads compute on very different scales:
YOLOv8's ``[N, 4 + classes, anchors]`` holds box coordinates in pixels next to class
probabilities in [0, 1]. Summed over the whole output, the error of the probabilities vanishes
under the coordinates' energy (a detector's class scores at 10 dB inside an output at 34 dB).
So an output computed by a Concat whose inputs' sizes along its axis are known is compared part
by part; a part that is itself a Concat is split again, through the Transposes and the Reshapes
that keep the axes it is split along (YOLOv5 joins each scale's ``[xy, wh, conf]`` along the last
axis, then flattens the scale's anchors; YOLOX joins ``[box, objectness, class]`` along the
channels, flattens the positions, joins the scales and transposes). Parts are boxes of the
output, written as numpy slices (``[:, 4:22]``).

Parts of one kind (a detector's anchors at two scales) are measured together, as the whole
output: parts are judged apart only when they hold probabilities (a Sigmoid computes them: held
to the floor on their own, as a sigmoid's output is) beside values that are not, or when a
part's signal is so much smaller than the other values' that it could be wholly wrong while the
output's SQNR still read above the accuracy floor (`measured_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.graph.passes._inference import infer_shapes
from qcal.graph.shapes import known_dims
from qcal.graph.structure import ints_attribute

__all__ = ["OutputPart", "Part", "describe_parts", "measured_groups", "output_parts", "part_of"]

# (start, stop) per axis of the output; None: the whole axis.
Part = tuple[tuple[int, int] | None, ...]

# Concats and the Transposes and Reshapes between them followed this deep, and at most this many
# parts per output (a model concatenating hundreds of rows is compared as one output).
_MAX_DEPTH, _MAX_PARTS = 8, 64
# A part whose signal energy is below this many dB of the largest part's is measured on its own:
# were it wholly wrong (an error as large as itself), the output's SQNR would still read this
# high. The default accuracy floor's SQNR (`qcal.config.DEFAULT_FLOOR_SQNR_DB`).
_HIDDEN_DB = 14.0


@dataclass(frozen=True)
class OutputPart:
    """A box of an output, and whether a Sigmoid computes it (probabilities)."""

    box: Part
    probabilities: bool = False


def output_parts(model: onnx.ModelProto) -> dict[str, tuple[OutputPart, ...]]:
    """Main-graph outputs computed by a Concat of parts of known size (through Transposes and
    Reshapes that keep its axis) -> their parts, in order (each output listed has two or
    more)."""
    producer = {v: n for n in model.graph.node for v in n.output}
    joined = [o.name for o in model.graph.output if _joins(o.name, producer, 0)]
    found = _parts_at(joined, producer, model, model.graph)
    if len(found) < len(joined):
        # sizes the model does not state (a prepared model, shapes inferred, states them all)
        try:
            inferred = infer_shapes(model, strict=False).graph
        except Exception:  # noqa: BLE001  a model shape inference cannot read: no more parts
            return found
        found = _parts_at(joined, producer, model, inferred)
    return found


def _parts_at(joined: list[str], producer: Mapping[str, onnx.NodeProto],
              model: onnx.ModelProto, shaped: onnx.GraphProto,
              ) -> dict[str, tuple[OutputPart, ...]]:
    """The parts of the `joined` outputs at the shapes `shaped` states."""
    ranks, sizes = _shapes(model, shaped)
    found = {}
    for name in joined:
        rank = ranks.get(name)
        parts = _split(name, rank, producer, sizes, 0) if rank else []
        if 1 < len(parts) <= _MAX_PARTS:
            found[name] = tuple(parts)
    return found


def part_of(array: np.ndarray, part: Part) -> np.ndarray:
    """The elements of `array` in `part`."""
    return array[tuple(slice(None) if s is None else slice(*s) for s in part)]


def measured_groups(signals: Sequence[float], probabilities: Sequence[bool]) -> list[list[int]]:
    """Parts (by index) measured together. The probabilities form one group (on one scale, a
    part of less energy is mostly background, not another unit); among the other values,
    largest signal first, a group holds the parts within `_HIDDEN_DB` of its largest, the rest
    form the next groups. One group: the output is measured whole."""
    remaining = sorted((i for i in range(len(signals)) if not probabilities[i]),
                       key=lambda i: (-signals[i], i))
    groups = []
    while remaining:
        least = signals[remaining[0]] * 10.0 ** (-_HIDDEN_DB / 10.0)
        group = [i for i in remaining if signals[i] >= least and signals[i] > 0.0]
        groups.append(sorted(group or remaining))
        remaining = [i for i in remaining if i not in set(groups[-1])]
    if any(probabilities):
        groups.append([i for i in range(len(signals)) if probabilities[i]])
    return groups


def describe_parts(parts: Sequence[Part]) -> str:
    """Parts as numpy indices: ``[:, 4:22]``; several joined by ``+`` (the first three)."""
    shown = ["[" + ", ".join(":" if s is None else f"{s[0]}:{s[1]}" for s in _trim(part)) + "]"
             for part in parts[:3]]
    return " + ".join(shown) + (" + ..." if len(parts) > 3 else "")


def _through_copies(value: str, producer: Mapping[str, onnx.NodeProto]
                      ) -> onnx.NodeProto | None:
    """The node computing `value` behind Identities and Casts (a float16 model's output, which
    qcal computes in float32, is a Cast of what its Concat joins)."""
    node = producer.get(value)
    while node is not None and node.op_type in ("Identity", "Cast") and node.input:
        node = producer.get(node.input[0])
    return node


def _joins(value: str, producer: Mapping[str, onnx.NodeProto], depth: int) -> bool:
    """Whether a Concat computes `value`, through Transposes and Reshapes."""
    node = _through_copies(value, producer)
    if node is None or depth >= _MAX_DEPTH:
        return False
    if node.op_type in ("Transpose", "Reshape") and node.input:
        return _joins(node.input[0], producer, depth + 1)
    return node.op_type == "Concat"


def _split(value: str, rank: int, producer: Mapping[str, onnx.NodeProto],
           sizes: Mapping[str, tuple[int | None, ...]], depth: int) -> list[OutputPart]:
    """The parts of `value` (of `rank`) in its own coordinates."""
    node = _through_copies(value, producer)
    whole = [OutputPart((None,) * rank, node is not None and node.op_type == "Sigmoid")]
    if node is None or depth >= _MAX_DEPTH or not node.input:
        return whole
    if node.op_type == "Concat":
        return _split_concat(node, rank, producer, sizes, depth) or whole
    if node.op_type == "Transpose":
        perm = ints_attribute(node, "perm", reversed(range(rank)))
        if sorted(perm) != list(range(rank)):
            return whole
        inner = _split(node.input[0], rank, producer, sizes, depth + 1)
        return [OutputPart(tuple(p.box[axis] for axis in perm), p.probabilities) for p in inner]
    if node.op_type == "Reshape":
        return _split_reshaped(node, rank, producer, sizes, depth) or whole
    return whole


def _split_concat(node: onnx.NodeProto, rank: int, producer: Mapping[str, onnx.NodeProto],
                  sizes: Mapping[str, tuple[int | None, ...]], depth: int) -> list[OutputPart]:
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    if axis is None or not -rank <= axis < rank:
        return []
    axis %= rank
    lengths = []
    for name in node.input:
        shape = sizes.get(name)
        if not name or shape is None or len(shape) != rank or shape[axis] is None:
            return []  # a part of unknown size: where the parts meet is unknown
        lengths.append(shape[axis])
    parts: list[OutputPart] = []
    offset = 0
    for name, length in zip(node.input, lengths):
        for inner in (_split(name, rank, producer, sizes, depth + 1) if length else ()):
            start, stop = inner.box[axis] or (0, length)
            box = (*inner.box[:axis], (offset + start, offset + stop), *inner.box[axis + 1:])
            parts.append(OutputPart(box, inner.probabilities))
        offset += length
    return parts


def _split_reshaped(node: onnx.NodeProto, rank: int, producer: Mapping[str, onnx.NodeProto],
                    sizes: Mapping[str, tuple[int | None, ...]], depth: int) -> list[OutputPart]:
    """The parts of a Reshape's input split along axes it keeps (leading or trailing axes of
    the same known sizes), while it joins or splits the others."""
    source, target = sizes.get(node.input[0]), sizes.get(node.output[0])
    if not source or not target or len(target) != rank:
        return []
    lead = next((k for k, (a, b) in enumerate(zip(source, target)) if a is None or a != b),
                min(len(source), rank))
    trail = next((k for k, (a, b) in enumerate(zip(source[::-1], target[::-1]))
                  if a is None or a != b), min(len(source), rank))
    inner = _split(node.input[0], len(source), producer, sizes, depth + 1)
    parts = []
    for part in inner:
        box: list[tuple[int, int] | None] = [None] * rank
        for axis, span in enumerate(part.box):
            if span is None:
                continue
            if axis < lead:
                box[axis] = span
            elif axis >= len(source) - trail:
                box[axis - len(source) + rank] = span
            else:
                return []  # split along an axis the Reshape joins or splits
        parts.append(OutputPart(tuple(box), part.probabilities))
    return parts


def _trim(part: Part) -> Part:
    """Without the whole axes at its end."""
    end = len(part)
    while end and part[end - 1] is None:
        end -= 1
    return part[:end]


def _shapes(model: onnx.ModelProto, graph: onnx.GraphProto,
            ) -> tuple[dict[str, int], dict[str, tuple[int | None, ...]]]:
    """Rank and known dims (None: unknown) of every value `graph` states a shape for, and of
    the model's weights and outputs."""
    ranks: dict[str, int] = {}
    sizes: dict[str, tuple[int | None, ...]] = {t.name: tuple(int(d) for d in t.dims)
                                                for t in model.graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output, *model.graph.output):
        dims = known_dims(value)
        if dims is None:
            continue
        sizes.setdefault(value.name, dims)
        ranks.setdefault(value.name, len(dims))
    for name, dims in sizes.items():
        ranks.setdefault(name, len(dims))
    return ranks, sizes
