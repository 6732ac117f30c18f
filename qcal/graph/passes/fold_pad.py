"""Pass: fold a zero-padding Pad into the Conv that reads it (the Conv's own `pads` then add the
same zeros).

Exporters write explicit Pad nodes for padding a Conv attribute could hold: tf2onnx for a
Keras ``ZeroPadding2D`` or a strided "same" convolution's uneven padding, torch for some
padding modes; tf2onnx may put a Transpose between (the Pad in NHWC, the Conv in NCHW: the pads
then follow the Transpose's permutation). onnxruntime folds such a Pad into a float Conv
itself, but not into an integer one: quantized, the Pad would stay a float node between a
DequantizeLinear and a QuantizeLinear (three nodes where there were none; a Keras MobileNet ran
1.27x its float latency with four of them). The result is exact: the Conv pads with the same
zeros.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import helper

from qcal.graph.files.large import tensor_array
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    Use,
    UseIndex,
    drop_unread_initializers,
    drop_value_info,
    ints_attribute,
)

__all__ = ["FoldPad"]


class FoldPad:
    """Fold each Pad of the main graph that adds zeros in constant mode, and whose output only
    Conv nodes read as their input (on spatial axes only), or Transposes that only such Convs
    read (on the axes that become spatial); never a graph output. Its pads (and axes, constant
    value) must be initializers; each Conv must pad explicitly (``auto_pad`` NOTSET or VALID)
    and have as many spatial axes as the padded input."""

    name: ClassVar[str] = "fold-pad"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        removed: set[int] = set()  # positions of the folded Pads
        moved: set[str] = set()  # Transpose outputs that lost the padding
        for position, node in enumerate(graph.node):
            pads = _zero_pads(node, index)
            if pads is None or node.output[0] in index.graph_outputs:
                continue
            readers = index.uses.get(node.output[0], [])
            folds = [f for f in (_fold(use, pads, index) for use in readers) if f is not None]
            if not readers or len(folds) != len(readers):
                continue
            for use, fold in zip(readers, folds):
                for conv, spatial in fold:
                    _add_pads(conv, spatial)
                    if use.node is conv:
                        conv.input[0] = node.input[0]
                if use.node.op_type == "Transpose":
                    use.node.input[0] = node.input[0]
                    moved.add(use.node.output[0])
            removed.add(position)
        if not removed:
            return StepResult(model, False)
        dropped = {graph.node[p].output[0] for p in removed} | moved
        constants = {v for p in removed for v in graph.node[p].input[1:] if v}
        kept = [n for p, n in enumerate(graph.node) if p not in removed]
        del graph.node[:]
        graph.node.extend(kept)
        drop_value_info(graph, dropped)
        drop_unread_initializers(graph, constants)  # the pads nothing else reads
        count = len(removed)
        return StepResult(model, True, f"folded {count} Pad{'s' * (count != 1)} into Conv")


def _fold(use: Use, pads: tuple[np.ndarray, np.ndarray],
          index: UseIndex) -> list[tuple[onnx.NodeProto, list[int]]] | None:
    """The Convs a read of the Pad's output reaches and the spatial pads each adds, or None
    when that read cannot take the padding: a Conv's data input, or a Transpose whose output
    only such Convs read (the pads permuted as it permutes the axes)."""
    begins, ends = pads
    if use.slot != 0:  # a subgraph's read, or not the data input
        return None
    node = use.node
    if node.op_type == "Transpose" and node.domain in DEFAULT_DOMAINS:
        perm = ints_attribute(node, "perm", reversed(range(begins.size)))
        if sorted(perm) != list(range(begins.size)) or node.output[0] in index.graph_outputs:
            return None
        begins, ends = begins[perm], ends[perm]
        convs = index.uses.get(node.output[0], [])
        if not convs or any(u.slot != 0 or not _pads_explicitly(u.node) for u in convs):
            return None
        spatial = _spatial(begins, ends)
        return None if spatial is None else [(u.node, spatial) for u in convs]
    spatial = _spatial(begins, ends)
    if spatial is None or not _pads_explicitly(node):
        return None
    return [(node, spatial)]


def _spatial(begins: np.ndarray, ends: np.ndarray) -> list[int] | None:
    """A Conv's `pads` (begins, then ends, of the spatial axes) for padding of an NC... input,
    or None when it pads the batch or channel axis, or the input has no spatial axis."""
    if begins.size < 3 or begins[:2].any() or ends[:2].any():
        return None
    return [int(v) for v in (*begins[2:], *ends[2:])]


def _zero_pads(node: onnx.NodeProto, index: UseIndex) -> tuple[np.ndarray, np.ndarray] | None:
    """The (begins, ends) per axis a zero-padding Pad adds, or None when `node` is not such a
    Pad."""
    if node.op_type != "Pad" or node.domain not in DEFAULT_DOMAINS or len(node.output) != 1:
        return None
    if any(a.name == "mode" and a.s not in (b"", b"constant") for a in node.attribute):
        return None
    if len(node.input) < 2 or any(a.name in ("pads", "paddings") for a in node.attribute):
        return None  # before opset 11 the pads are an attribute; preparation upgrades that
    pads = _constant(node, 1, index)
    if pads is None:
        return None
    value = _constant(node, 2, index) if len(node.input) > 2 and node.input[2] else np.zeros(1)
    if value is None or value.size > 1 or np.any(value != 0):
        return None
    if len(node.input) > 3 and node.input[3]:
        return None  # pads of some axes only (opset 18): the input's rank is not known here
    pads = pads.astype(np.int64).ravel()
    rank = pads.size // 2
    if rank < 3 or np.any(pads < 0):
        return None
    return pads[:rank], pads[rank:]


def _constant(node: onnx.NodeProto, slot: int, index: UseIndex) -> np.ndarray | None:
    tensor = index.constant(node.input[slot])
    return None if tensor is None else tensor_array(tensor)


def _pads_explicitly(conv: onnx.NodeProto) -> bool:
    """A Conv whose padding its `pads` say (SAME_UPPER/LOWER pad by the input's size)."""
    return conv.op_type == "Conv" and conv.domain in DEFAULT_DOMAINS and not any(
        a.name == "auto_pad" and a.s not in (b"", b"NOTSET", b"VALID") for a in conv.attribute)


def _add_pads(conv: onnx.NodeProto, spatial: list[int]) -> None:
    """Add `spatial` to the Conv's pads (VALID: no pads of its own)."""
    own = [0] * len(spatial)
    for attribute in list(conv.attribute):
        if attribute.name == "pads":
            own = list(attribute.ints)
            conv.attribute.remove(attribute)
        elif attribute.name == "auto_pad":
            conv.attribute.remove(attribute)
    conv.attribute.append(helper.make_attribute("pads", [a + b for a, b in zip(own, spatial)]))
