"""The float model's side of the comparisons: its session and outputs on the evaluation data,
made once for the many QDQ models the accuracy stage checks (`qcal.accuracy.evaluate`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qcal.accuracy.decision_counts import DecisionRule
from qcal.accuracy.output_parts import OutputPart
from qcal.calibration.runtime import Feed
from qcal.graph.attention_masks import AttentionMask
from qcal.graph.detections import DetectionSet

__all__ = ["FloatReference"]


class FloatReference:
    """The float model's session and its outputs on the evaluation data, made once for several
    comparisons on the same data (the fallback checks many QDQ models against one float model).
    Outputs are kept while they fit in `budget_bytes`; past it they are recomputed each time, so
    memory stays bounded whatever the data size. The calibration pass can hand over the outputs
    it computed anyway (`keep`), when the evaluation runs on the calibration data. The data's
    batches are held too while outputs and batches fit: a comparison then reads no data (a
    layout detector's fallback read its 8 compressed pages 16 times, 3 s)."""

    def __init__(self, budget_bytes: int = 256 << 20) -> None:
        self.session: Any = None
        self.rules: dict[str, DecisionRule] | None = None  # how each output is read
        self.parts: dict[str, tuple[OutputPart, ...]] = {}  # outputs compared part by part
        self.detections: list[DetectionSet] = []  # outputs compared as sets of detections
        self.mask: AttentionMask | None = None  # outputs compared on real tokens only
        self.mask_measured = False  # its padding value measured (`padding.measured_mask`)
        self.names: list[str] = []  # the outputs kept, in this order
        self.outputs: list[list[np.ndarray]] = []  # per batch, from the first on
        self.budget = budget_bytes
        self.kept_bytes = 0
        self.full = False  # a batch did not fit: no later one is kept (they would misalign)
        self.feeds: list[tuple[Feed, int]] = []  # the data's batches, from the first on
        self.holds_data = False  # every batch of the data is in `feeds`, with its outputs

    def release(self) -> None:
        """Drop the session and the outputs (a later comparison makes them again)."""
        self.session, self.rules, self.names, self.outputs = None, None, [], []
        self.parts, self.detections, self.mask, self.mask_measured = {}, [], None, False
        self.kept_bytes, self.full = 0, False
        self.feeds, self.holds_data = [], False

    def keep(self, names: list[str], outputs: list[np.ndarray]) -> None:
        """The float outputs `names` of the next batch (batches in data order, from the first):
        kept for the comparisons while they fit in the budget. The calibration pass hands over
        the outputs it computes anyway when the evaluation runs on the calibration data."""
        if self.full or (self.outputs and names != self.names):
            return
        size = sum(x.nbytes for x in outputs)
        if self.kept_bytes + size > self.budget:
            self.full = True
            return
        self.names = names
        self.outputs.append(outputs)
        self.kept_bytes += size

    def hold(self, batch: int, feed: Feed, n: int) -> None:
        """The data's next batch (after `run` for it), held while it fits beside the outputs."""
        size = sum(np.asarray(v).nbytes for v in feed.values())
        if batch == len(self.feeds) < len(self.outputs) and self.kept_bytes + size <= self.budget:
            self.feeds.append(({k: np.array(v, copy=True) for k, v in feed.items()}, n))
            self.kept_bytes += size

    def run(self, batch: int, names: list[str], feed: Feed) -> list[np.ndarray]:
        if batch < len(self.outputs) and names == self.names:
            return self.outputs[batch]
        if not names:  # onnxruntime reads no names as all of them (sequences, maps...)
            return []
        outputs = [np.asarray(x) for x in self.session.run(names, dict(feed))]
        if batch == len(self.outputs):
            self.keep(names, outputs)
        return outputs
