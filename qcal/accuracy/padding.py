"""Padding positions left out of the comparisons: where a token model's attention mask is 0
(`qcal.graph.attention_masks`), its outputs of one row per position hold values nothing reads,
so float and quantized models are compared on the real tokens only, sample by sample. Both
the evaluation (`qcal.accuracy.evaluate`) and sensitivity read their outputs so."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcal.graph.attention_masks import AttentionMask

__all__ = ["PaddingCount", "compared_positions", "has_positions", "position_pieces"]


@dataclass
class PaddingCount:
    """The mask input and how many of the positions it covered it left out."""

    input: str
    left_out: int = 0
    positions: int = 0

    def add(self, valid: np.ndarray) -> None:
        self.positions += int(valid.size)
        self.left_out += int(valid.size - np.count_nonzero(valid))

    def to_json(self) -> dict[str, object]:
        return {"input": self.input, "positions_left_out": self.left_out,
                "positions": self.positions}


def compared_positions(feed: Mapping[str, Any], mask: AttentionMask | None) -> np.ndarray | None:
    """The positions of this batch to compare, bool [samples, sequence] (all True: no padding
    in this batch); None without a mask, or where its input holds values other than 0 and 1,
    which make no padding mask."""
    if mask is None or mask.input not in feed:
        return None
    values = np.asarray(feed[mask.input])
    if values.ndim != 2 or values.size == 0 or values.dtype.kind not in "biuf":
        return None
    if values.dtype.kind != "b" and not ((values == 0) | (values == 1)).all():
        return None
    valid: np.ndarray = values != 0
    return valid


def has_positions(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> bool:
    """Whether both outputs hold one row per position of this batch's mask."""
    return x.shape == y.shape and x.ndim >= 2 and x.shape[:2] == valid.shape


def position_pieces(x: np.ndarray, y: np.ndarray, valid: np.ndarray
                    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per sample with a real position, (sample, its positions of `x`, of `y`) as a batch of
    one ([1, positions, ...]), for outputs of one row per position (`has_positions`). Scores
    of one value per position ([samples, sequence]: a span's start) need two positions to
    choose from: a sample of one real token holds no such decision and is passed over."""
    least = 2 if x.ndim == 2 else 1
    return [(i, x[i][valid[i]][None], y[i][valid[i]][None])
            for i in range(valid.shape[0]) if np.count_nonzero(valid[i]) >= least]
