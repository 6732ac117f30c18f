"""Sets of detections compared as sets (`qcal.graph.detections` finds them): each detection of the
float model is matched with a detection of the quantized model's of the same label whose box
overlaps it by an IoU of at least 0.5, and the F1 of the matches is the outputs' figure, held to
the floor's F1 of yes decisions (a detection is a yes decision of the detector's). Rows are not
compared one by one (why: `qcal.graph.detections`), so their SQNR and agreement are not figures
of the set."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from qcal.accuracy.output_metrics import OutputMetrics
from qcal.graph.detections import DetectionSet

__all__ = ["DETECTIONS", "MIN_IOU", "DetectionCounts", "as_detections", "count_matches"]

# The `decisions` of an output of a set of detections.
DETECTIONS = "detections"
# The overlap at which two boxes are the same detection (the usual detection benchmarks' 0.5).
MIN_IOU = 0.5


@dataclasses.dataclass
class DetectionCounts:
    """Detections of the float model, of the quantized model, and matched, summed over batches;
    `unread`: a batch's rows were not what the set's layout says (a set of `columns` whose class
    column held no class numbers), so the outputs are compared row by row after all."""

    float_count: int = 0
    quantized_count: int = 0
    matched: int = 0
    unread: bool = False

    def add(self, detections: DetectionSet, x: Mapping[str, np.ndarray],
            y: Mapping[str, np.ndarray], samples: int) -> None:
        """One batch's outputs of the set, float `x` and quantized `y`, by name."""
        fx, fy = x[detections.boxes], y[detections.boxes]
        width = 6 if detections.columns else 4
        if (fx.ndim < 2 or fy.ndim < 2 or fx.shape[-1] != fy.shape[-1]
                or fx.shape[-1] < width or not detections.columns and fx.shape[-1] != 4):
            self.unread = True
            return
        # [samples, K, ...]: a set per sample; otherwise the batch's rows are one set
        per_sample = samples > 1 and fx.ndim == 3 and fx.shape[0] == fy.shape[0] == samples
        groups = samples if per_sample else 1
        rows_x = fx.reshape(groups, -1, fx.shape[-1])
        rows_y = fy.reshape(groups, -1, fy.shape[-1])
        labels_x: np.ndarray | None
        labels_y: np.ndarray | None
        if detections.columns:  # box, score, class: the class is the label
            if not (_columns_read(rows_x) and _columns_read(rows_y)):
                self.unread = True
                return
            labels_x, labels_y = rows_x[..., 5], rows_y[..., 5]
        else:
            lx = _labels(detections, x, rows_x.shape[0] * rows_x.shape[1])
            ly = _labels(detections, y, rows_y.shape[0] * rows_y.shape[1])
            labels_x = None if lx is None or ly is None else lx.reshape(groups, -1)
            labels_y = None if lx is None or ly is None else ly.reshape(groups, -1)
        for g in range(groups):
            counts = count_matches(rows_x[g, :, :4], rows_y[g, :, :4],
                                   None if labels_x is None else labels_x[g],
                                   None if labels_y is None else labels_y[g])
            self.float_count += counts[0]
            self.quantized_count += counts[1]
            self.matched += counts[2]


def _columns_read(rows: np.ndarray) -> bool:
    """Whether rows [groups, K, 6 or more] read as box, score and class: in the rows that are
    not padding, a score between 0 and 1 and a class that is a whole number of 0 or more."""
    real = rows[(rows != 0.0).any(axis=2)].astype(np.float64)
    if not np.isfinite(real[:, :6]).all():
        return False
    scores, classes = real[:, 4], real[:, 5]
    return bool(((scores >= 0.0) & (scores <= 1.0)).all()
                and ((classes >= 0.0) & (classes == np.round(classes))).all())


def _labels(detections: DetectionSet, outputs: Mapping[str, np.ndarray],
            rows: int) -> np.ndarray | None:
    """The set's labels: its first other output of integers, one per detection (None: none)."""
    for name in detections.others:
        values = outputs.get(name)
        if values is not None and values.dtype.kind in "biu" and values.size == rows:
            return values.ravel()
    return None


def count_matches(float_boxes: np.ndarray, quantized_boxes: np.ndarray,
                  float_labels: np.ndarray | None, quantized_labels: np.ndarray | None,
                  ) -> tuple[int, int, int]:
    """Detections of each model and matched: each float detection, in its order (its model's
    scores'), takes the unmatched quantized one of its label that overlaps it most, at an IoU of
    MIN_IOU or more. Rows all 0 are padding (a fixed count of rows, the unused ones zero), and
    rows not finite are no boxes; neither counts."""
    fx, lx = _detections(float_boxes, float_labels)
    fy, ly = _detections(quantized_boxes, quantized_labels)
    if not len(fx) or not len(fy):
        return len(fx), len(fy), 0
    iou = _iou(fx, fy)
    if lx is not None and ly is not None:
        iou[lx[:, None] != ly[None, :]] = 0.0
    taken = np.zeros(len(fy), bool)
    matched = 0
    for row in iou:
        row = np.where(taken, -1.0, row)
        best = int(np.argmax(row))
        if row[best] >= MIN_IOU:
            taken[best] = True
            matched += 1
    return len(fx), len(fy), matched


def _detections(boxes: np.ndarray, labels: np.ndarray | None,
                ) -> tuple[np.ndarray, np.ndarray | None]:
    rows = boxes.reshape(-1, 4).astype(np.float64)
    real = np.isfinite(rows).all(axis=1) & (rows != 0.0).any(axis=1)
    return rows[real], None if labels is None else labels.ravel()[real]


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` with every box of `b`, corners in either order (x1, y1, x2, y2 or
    y1, x1, y2, x2: the same overlap)."""
    def corners(boxes: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.minimum(boxes[:, 0], boxes[:, 2]), np.minimum(boxes[:, 1], boxes[:, 3]),
                np.maximum(boxes[:, 0], boxes[:, 2]), np.maximum(boxes[:, 1], boxes[:, 3]))

    ax1, ay1, ax2, ay2 = corners(a)
    bx1, by1, bx2, by2 = corners(b)
    w = np.clip(np.minimum(ax2[:, None], bx2[None]) - np.maximum(ax1[:, None], bx1[None]), 0, None)
    h = np.clip(np.minimum(ay2[:, None], by2[None]) - np.maximum(ay1[:, None], by1[None]), 0, None)
    inter = w * h
    union = ((ax2 - ax1) * (ay2 - ay1))[:, None] + ((bx2 - bx1) * (by2 - by1))[None] - inter
    same = (a[:, None, :] == b[None, :, :]).all(axis=2)  # equal boxes, even of no area
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0.0, inter / np.where(union > 0.0, union, 1.0), 0.0)
    result: np.ndarray = np.where(same, 1.0, iou)
    return result


def as_detections(metrics: OutputMetrics, counts: DetectionCounts | None) -> OutputMetrics:
    """An output of a set of detections: no figure row by row; the set's F1 on its boxes output
    (`counts`; None for the set's other outputs)."""
    f1 = yes = None
    if counts is not None and counts.float_count + counts.quantized_count:
        f1 = 2 * counts.matched / (counts.float_count + counts.quantized_count)
        yes = (counts.float_count, counts.quantized_count, counts.matched)
    return dataclasses.replace(
        metrics, sqnr_db=None, top1_agreement=None, decisions=DETECTIONS, sqnr_part=None,
        yes_f1=f1, yes_counts=yes, sequence_agreement=None, variation_sqnr_db=None,
        decision_count=None if counts is None else counts.float_count,
        agreement_error=None, decision_rows=None)
