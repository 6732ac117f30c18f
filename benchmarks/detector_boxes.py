"""Boxes a detector's outputs decode to, for the benchmark's box F1 (quantized vs float).

A detector's task is its boxes, not the values of its score maps: a score map judged per element
counts every anchor near a threshold, where the boxes after decoding and NMS may not move. The
decoders follow the postprocessing the detectors ship with, simplified where it does not change
which boxes come out:

- ``db``: a DB text detector's probability map [N, 1, H, W], decoded by
  ``eval_ppocr.db_boxes`` (the PP-OCRv4 detector's box F1);
- ``picodet``: a PP-PicoDet's per-stride class scores [N, anchors, classes] (sigmoid) and box
  distributions [N, anchors, 4 (reg_max + 1)] (GFL: a softmax over the bins of each side, its
  expectation times the stride is the distance from the anchor's centre), strides 8, 16, 32, 64
  on the input's height and width; per class, the anchors scoring above 0.5, then hard NMS at
  IoU 0.5, the boxes kept clipped to the image, as rapid_layout 1.2.1's defaults (conf_thresh 0.5, iou_thresh 0.5). Boxes carry their
  class, and a float box matches only a quantized box of its class;
- ``yolox``: a YOLOX head's [N, anchors, 4 + 1 + classes] (centre offsets and log sizes per
  grid cell, objectness, class probabilities), strides 8, 16, 32 on the input's height and
  width; a box's score is its objectness times its best class probability; the boxes scoring
  above 0.1, then NMS at IoU 0.45 over all classes, as ddddocr 1.6.1's detector does
  (``multiclass_nms_class_agnostic``, score_thr 0.1, nms_thr 0.45). Boxes carry their class.

Matching is ``eval_ppocr.match_boxes`` (one to one, IoU >= 0.5, highest IoU first), micro-averaged
over the samples (``eval_ppocr.BoxF1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from eval_ppocr import BoxF1, db_boxes, iou_matrix

PICODET_STRIDES = (8, 16, 32, 64)
PICODET_SCORE, PICODET_IOU = 0.5, 0.5
PICODET_TOP_K = 1000  # candidates per stride, by their best class score (rapid_layout's nms_top_k)
PICODET_CANDIDATES, PICODET_KEEP = 200, 100  # per class: NMS's candidates and the boxes kept
YOLOX_STRIDES = (8, 16, 32)
YOLOX_SCORE, YOLOX_IOU = 0.1, 0.45
DECODERS = ("db", "picodet", "yolox")


def picodet_boxes(outputs: Sequence[np.ndarray], input_hw: Sequence[int]) -> list[np.ndarray]:
    """Boxes [x0, y0, x1, y1] per class (a list over classes) of sample 0 of a PicoDet's
    outputs: the score maps of each stride, then the box distributions of each stride."""
    levels = len(outputs) // 2
    scores, distributions = outputs[:levels], outputs[levels:]
    boxes, confidences = [], []
    for stride, score, dist in zip(PICODET_STRIDES, scores, distributions):
        score, dist = score[0].astype(np.float64), dist[0].astype(np.float64)
        rows = int(np.ceil(input_hw[0] / stride))
        cols = int(np.ceil(input_hw[1] / stride))
        cy, cx = np.meshgrid((np.arange(rows) + 0.5) * stride, (np.arange(cols) + 0.5) * stride,
                             indexing="ij")
        centre = np.stack([cx.ravel(), cy.ravel(), cx.ravel(), cy.ravel()], axis=1)
        bins = dist.shape[-1] // 4
        logits = dist.reshape(-1, 4, bins)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        distance = (weights * np.arange(bins)).sum(-1) * stride
        keep = np.argsort(-score.max(axis=1), kind="stable")[:PICODET_TOP_K]
        boxes.append(centre[keep] + np.array([-1, -1, 1, 1]) * distance[keep])
        confidences.append(score[keep])
    all_boxes, all_scores = np.concatenate(boxes), np.concatenate(confidences)
    kept = [_hard_nms(all_boxes[all_scores[:, c] > PICODET_SCORE],
                      all_scores[all_scores[:, c] > PICODET_SCORE, c])
            for c in range(all_scores.shape[1])]
    for found in kept:  # inside the image, as rapid_layout clips the boxes NMS kept
        found[:, 0::2] = found[:, 0::2].clip(0, input_hw[1])
        found[:, 1::2] = found[:, 1::2].clip(0, input_hw[0])
    return kept


def yolox_boxes(output: np.ndarray, input_hw: Sequence[int]) -> list[np.ndarray]:
    """Boxes [x0, y0, x1, y1] per class of sample 0 of a YOLOX head's output."""
    rows = output[0].astype(np.float64)
    cells, strides = [], []
    for stride in YOLOX_STRIDES:
        h, w = input_hw[0] // stride, input_hw[1] // stride
        y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        cells.append(np.stack([x.ravel(), y.ravel()], axis=1))
        strides.append(np.full((h * w, 1), stride))
    cell, stride = np.concatenate(cells), np.concatenate(strides)
    centre = (rows[:, :2] + cell) * stride
    size = np.exp(rows[:, 2:4]) * stride
    corners = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
    probabilities = rows[:, 4:5] * rows[:, 5:]
    classes, scores = probabilities.argmax(1), probabilities.max(1)
    above = scores > YOLOX_SCORE
    boxes, scores, classes = corners[above], scores[above], classes[above]
    kept = _nms_order(boxes, scores, YOLOX_IOU, len(scores), len(scores))  # every candidate
    return [boxes[kept][classes[kept] == c] for c in range(probabilities.shape[1])]


def _hard_nms(boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Boxes kept by greedy NMS at IoU PICODET_IOU, highest score first, among the
    PICODET_CANDIDATES best, at most PICODET_KEEP."""
    kept = _nms_order(boxes, scores, PICODET_IOU, PICODET_CANDIDATES, PICODET_KEEP)
    return np.array(boxes[kept], dtype=np.float64).reshape(-1, 4)


def _nms_order(boxes: np.ndarray, scores: np.ndarray, iou: float, candidates: int, keep: int
               ) -> np.ndarray:
    """Indices of the boxes greedy NMS keeps at `iou`, highest score first, among the
    `candidates` best, at most `keep`."""
    order = np.argsort(-scores, kind="stable")[:candidates]
    kept: list[int] = []
    while len(order) and len(kept) < keep:
        best, order = order[0], order[1:]
        kept.append(int(best))
        order = order[iou_matrix(boxes[best : best + 1], boxes[order])[0] <= iou]
    return np.array(kept, dtype=np.int64)


def decode(decoder: str, outputs: Sequence[np.ndarray], input_hw: Sequence[int]
           ) -> list[np.ndarray]:
    """Sample 0's boxes, one array per class (a DB map has one class)."""
    if decoder == "db":
        return [db_boxes(outputs[0][0, 0])]
    if decoder == "picodet":
        return picodet_boxes(outputs, input_hw)
    if decoder == "yolox":
        return yolox_boxes(outputs[0], input_hw)
    raise ValueError(f"unknown box decoder {decoder!r}; choose from {', '.join(DECODERS)}")


def box_f1(decoder: str, refs: Sequence[Sequence[np.ndarray]],
           quants: Sequence[Sequence[np.ndarray]], input_hws: Sequence[Sequence[int]]
           ) -> tuple[float, float]:
    """Box F1 of the quantized outputs' boxes against the float outputs' (per sample, per
    class), and the float model's boxes per sample."""
    f1, found = BoxF1(), 0
    for ref, quant, hw in zip(refs, quants, input_hws):
        ref_boxes, quant_boxes = decode(decoder, ref, hw), decode(decoder, quant, hw)
        for r, q in zip(ref_boxes, quant_boxes):
            f1.update(r, q)
            found += len(r)
    return f1.result(), found / max(len(refs), 1)
