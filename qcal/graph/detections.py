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
`Loop` body (torchvision's exports hold theirs in an `If`), whatever they are named. A set is
either a boxes output of rows of four corners with the other outputs beside it, or one output
whose rows hold a box's four corners, its score and its class (ultralytics' NMS export writes
[1, 300, 6], its segmentation and pose exports more columns after those six), read as such only
where its values show it (`qcal.accuracy.detection_sets`).
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
    other outputs computed from the same selection (scores, labels, masks); with `columns`,
    an output of rows of box, score, class and more ([..., K, 6 or more]), alone."""

    boxes: str
    others: tuple[str, ...]
    columns: bool = False


def detection_sets(model: onnx.ModelProto) -> list[DetectionSet]:
    """The detection sets among the main graph's outputs (module docstring); none for a model
    without a NonMaxSuppression."""
    graph = model.graph
    selected: set[str] = set()
    for node in graph.node:
        if _selects(node) or selected.intersection(node.input) or selected.intersection(subgraph_reads(node)):
            selected.update(v for v in node.output if v)
    outputs = [o for o in graph.output if o.name in selected]
    boxes = [o.name for o in outputs if _rows_of(o) == 4]
    if not boxes:
        return [DetectionSet(o.name, (), columns=True) for o in outputs if _rows_of(o) >= 6]
    return [DetectionSet(b, tuple(o.name for o in outputs if o.name != b)) for b in boxes]


def _selects(node: onnx.NodeProto) -> bool:
    """Whether `node` is a NonMaxSuppression or holds one in its bodies."""
    if node.op_type in _SELECTIONS and node.domain in DEFAULT_DOMAINS:
        return True
    return any(_selects(inner) for graph in node_subgraphs(node) for inner in graph.node)


def _rows_of(value: onnx.ValueInfoProto) -> int:
    """The declared length of a float output's rows (its last dimension) where it has rank 2 or
    more; 0 otherwise."""
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or tensor.elem_type not in _FLOAT_TYPES:
        return 0
    dims = tensor.shape.dim
    return dims[-1].dim_value if tensor.HasField("shape") and len(dims) >= 2 else 0
