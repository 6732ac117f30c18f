"""Pass: fold a zero-padding Pad into the Conv that reads it (the Conv's own `pads` then add the
same zeros).

Exporters write explicit Pad nodes for padding a Conv attribute could hold: tf2onnx for a
Keras ``ZeroPadding2D`` or a strided "same" convolution's uneven padding, torch for some
padding modes. onnxruntime folds such a Pad into a float Conv itself, but not into an integer
one: quantized, the Pad would stay a float node between a DequantizeLinear and a
QuantizeLinear (three nodes where there were none; a Keras MobileNet ran 1.27x its float
latency with four of them). The result is exact: the Conv pads with the same zeros.
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
    UseIndex,
    drop_unread_initializers,
    drop_value_info,
)

__all__ = ["FoldPad"]


class FoldPad:
    """Fold each Pad of the main graph that adds zeros on spatial axes only, in constant mode,
    and whose output only Conv nodes read, as their input (not a graph output). Its pads (and
    axes, constant value) must be initializers; each Conv must pad explicitly (``auto_pad``
    NOTSET or VALID) and have as many spatial axes as the padded input."""

    name: ClassVar[str] = "fold-pad"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        removed: set[int] = set()  # positions of the folded Pads
        for position, node in enumerate(graph.node):
            spatial = _zero_spatial_pads(node, index)
            if spatial is None:
                continue
            readers = index.uses.get(node.output[0], [])
            convs = [use.node for use in readers]
            if (
                not readers
                or node.output[0] in index.graph_outputs
                or any(use.slot != 0 for use in readers)  # a subgraph read too
                or not all(_pads_explicitly(conv) for conv in convs)
            ):
                continue
            for conv in convs:
                _add_pads(conv, spatial)
                conv.input[0] = node.input[0]
            removed.add(position)
        if not removed:
            return StepResult(model, False)
        dropped = {graph.node[p].output[0] for p in removed}
        constants = {v for p in removed for v in graph.node[p].input[1:] if v}
        kept = [n for p, n in enumerate(graph.node) if p not in removed]
        del graph.node[:]
        graph.node.extend(kept)
        drop_value_info(graph, dropped)
        drop_unread_initializers(graph, constants)  # the pads nothing else reads
        count = len(removed)
        return StepResult(model, True, f"folded {count} Pad{'s' * (count != 1)} into Conv")


def _zero_spatial_pads(node: onnx.NodeProto, index: UseIndex) -> list[int] | None:
    """The pads a zero-padding Pad adds to the spatial axes (begins, then ends, as a Conv's
    `pads`), or None when `node` is not such a Pad."""
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
    begins, ends = pads[:rank], pads[rank:]
    if rank < 3 or np.any(pads < 0) or begins[:2].any() or ends[:2].any():
        return None
    return [int(v) for v in (*begins[2:], *ends[2:])]


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
