"""Outputs that are sets of detections: the boxes a NonMaxSuppression kept, with their scores,
labels and masks (torchvision's detectors, TensorFlow's object-detection exports, a YOLO exported
with its NMS).

Their rows are detections in the order of their scores, as many as were kept: a detection one
model keeps and the other drops near the score threshold shifts every later row, and two
detections of close scores swap rows. Compared row by row, such outputs disagree wherever their
detections are the same (a trained Faster R-CNN whose detections matched the float model's at an
F1 of 0.94 kept the same count on 61-73 % of its images, and its boxes read 6-12 dB). So they
are compared as sets (`qcal.accuracy.detection_sets`), and found here by data flow: the graph
outputs computed from a NonMaxSuppression's selection, in the main graph or inside an `If` or
`Loop` body (torchvision's exports hold theirs in an `If`), whatever they are named.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from qcal.graph.structure import DEFAULT_DOMAINS, node_subgraphs, subgraph_reads

__all__ = ["DetectionSet", "detection_sets"]

_SELECTIONS = frozenset({"NonMaxSuppression"})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16})


@dataclass(frozen=True)
class DetectionSet:
    """The boxes output of a set of detections (rows of 4 coordinates, [..., K, 4]) and the
    other outputs computed from the same selection (scores, labels, masks)."""

    boxes: str
    others: tuple[str, ...]


def detection_sets(model: onnx.ModelProto) -> list[DetectionSet]:
    """The detection sets among the main graph's outputs (module docstring); none for a model
    without a NonMaxSuppression."""
    graph = model.graph
    selected: set[str] = set()
    for node in graph.node:
        if _selects(node) or selected.intersection(node.input) or selected.intersection(subgraph_reads(node)):
            selected.update(v for v in node.output if v)
    outputs = [o for o in graph.output if o.name in selected]
    boxes = [o.name for o in outputs if _rows_of_four(o)]
    return [DetectionSet(b, tuple(o.name for o in outputs if o.name != b)) for b in boxes]


def _selects(node: onnx.NodeProto) -> bool:
    """Whether `node` is a NonMaxSuppression or holds one in its bodies."""
    if node.op_type in _SELECTIONS and node.domain in DEFAULT_DOMAINS:
        return True
    return any(_selects(inner) for graph in node_subgraphs(node) for inner in graph.node)


def _rows_of_four(value: onnx.ValueInfoProto) -> bool:
    """A float output declared [..., 4] (boxes' corners): rank 2 or more, last dimension 4."""
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or tensor.elem_type not in _FLOAT_TYPES:
        return False
    dims = tensor.shape.dim
    return tensor.HasField("shape") and len(dims) >= 2 and dims[-1].dim_value == 4
