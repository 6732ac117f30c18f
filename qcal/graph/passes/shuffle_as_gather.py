"""Pass: write a channel shuffle (ShuffleNet's Reshape, Transpose, Reshape) as the Gather of
channels it is.

A shuffle of ``g`` groups reshapes ``[N, C, *S]`` to ``[N, g, C/g, *S]``, swaps the two group
axes and reshapes back: channel ``j * g + i`` of the result is channel ``i * C/g + j`` of the
input, a fixed permutation of the channels. A Gather of the channels moves the same values,
exactly. Quantized, the shuffle sits between integer Convs that onnxruntime runs channels-last,
and it transposes the codes to channels-first and back around either form; but the five-axis
Transpose runs in its general transpose, many times a Gather of the channels: on a Caffe2
ShuffleNet (16 shuffles of 4 groups) at one thread, its 41 Transposes took 4.0 ms of 9.0 ms,
its 40 Transposes and 16 Gathers 0.56 ms of 4.3 ms once its shuffles were Gathers (and its
residual Sums Adds, `qcal.graph.passes.sum_as_add`). Against the float model, at one / two
threads: that ShuffleNet 1.87x / 2.24x -> 0.85x / 0.94x; a torch ShuffleNetV2 (dynamo export,
224 x 224) 0.82x / 0.94x -> 0.67x / 0.75x.

Only where every shape is known: the input's channels and spatial sizes (shape inference),
both Reshapes' target shapes as constants (a batch size of 0, -1 or the input's own, the
second Reshape's channels -1 or C), and each intermediate value read by the next node alone.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.shapes import value_dims
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    drop_unread_initializers,
    drop_value_info,
    int_attribute,
    ints_attribute,
)

__all__ = ["ShuffleAsGather"]


class ShuffleAsGather:
    """Replace each channel shuffle of the main graph (module docstring) by a Gather over axis 1
    with the shuffle's permutation as a constant, named after the second Reshape."""

    name: ClassVar[str] = "shuffle-as-gather"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        dims = value_dims(graph)
        names = NameAllocator.from_model(model)
        found: dict[int, tuple[onnx.NodeProto, onnx.NodeProto, np.ndarray]] = {}
        for position, node in enumerate(graph.node):
            shuffle = _shuffle(node, index, dims)
            if shuffle is not None:
                found[position] = shuffle
        if not found:
            return StepResult(model, False)
        removed = {id(n) for first, second, _ in found.values() for n in (first, second)}
        nodes: list[onnx.NodeProto] = []
        shape_inputs: set[str] = set()
        stale: set[str] = set()
        for position, node in enumerate(graph.node):
            if id(node) in removed:
                continue
            if position not in found:
                nodes.append(node)
                continue
            first, second, order = found[position]
            indices = names.allocate(f"{second.output[0]}_channels")
            graph.initializer.append(numpy_helper.from_array(order, indices))
            # at the Transpose's place: its input is computed before it, its reader after
            nodes.append(helper.make_node("Gather", [first.input[0], indices], [second.output[0]],
                                          name=second.name, axis=1))
            shape_inputs.update((first.input[1], second.input[1]))
            stale.update((first.output[0], node.output[0]))
        del graph.node[:]
        graph.node.extend(nodes)
        drop_value_info(graph, stale)
        drop_unread_initializers(graph, shape_inputs)
        count = len(found)
        return StepResult(model, True, f"wrote {count} channel shuffle{'s' * (count != 1)} "
                                       "(Reshape, Transpose, Reshape) as a Gather of channels")


def _shuffle(transpose: onnx.NodeProto, index: UseIndex,
             dims: dict[str, tuple[int | None, ...] | None],
             ) -> tuple[onnx.NodeProto, onnx.NodeProto, np.ndarray] | None:
    """(first Reshape, second Reshape, the permutation of channels) when `transpose` is the
    middle of a channel shuffle, else None."""
    if transpose.op_type != "Transpose" or transpose.domain not in DEFAULT_DOMAINS:
        return None
    first = index.producer.get(transpose.input[0]) if transpose.input else None
    second = index.only_reader(transpose.output[0])
    if first is None or second is None or index.only_reader(first.output[0]) is not transpose:
        return None
    split, joined = _reshape_target(first, index), _reshape_target(second, index)
    shape = dims.get(first.input[0])
    if split is None or joined is None or shape is None or len(shape) < 3:
        return None
    known = [d for d in shape[1:] if d is not None]
    if len(known) != len(shape) - 1:
        return None
    batch, channels, spatial = shape[0], known[0], known[1:]
    rank = len(shape) + 1
    if ints_attribute(transpose, "perm") != [0, 2, 1, *range(3, rank)]:
        return None
    if len(split) != rank or len(joined) != rank - 1:
        return None
    groups, per_group = split[1], split[2]
    if (groups < 2 or per_group < 1 or groups * per_group != channels
            or split[3:] != spatial or not _batch(split[0], batch)
            or joined[2:] != spatial or joined[1] not in (-1, channels)
            or not _batch(joined[0], batch) or (joined[1] == -1 and joined[0] == -1)):
        return None
    # channel j * groups + i of the result is channel i * per_group + j of the input
    order = np.arange(channels, dtype=np.int64).reshape(groups, per_group).T.reshape(-1)
    return first, second, order


def _reshape_target(node: onnx.NodeProto, index: UseIndex) -> list[int] | None:
    """The constant target shape of a Reshape of the default domain, None for another node or
    a target read at run time; and None for a target with a dimension 0 under allowzero
    (torch's dynamo exporter sets it: then 0 is an empty dimension, not the input's)."""
    if (node.op_type != "Reshape" or node.domain not in DEFAULT_DOMAINS
            or len(node.input) != 2 or len(node.output) != 1):
        return None
    tensor = index.constant(node.input[1])
    if tensor is None:
        return None
    target = [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
    return None if int_attribute(node, "allowzero", 0) and 0 in target else target


def _batch(target: int, batch: int | None) -> bool:
    """Whether a Reshape's first target dimension keeps the batch: 0 copies it, -1 infers it
    (the other dimensions being known), or it names the input's own."""
    return target in (0, -1) or (batch is not None and target == batch)
