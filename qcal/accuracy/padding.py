"""Padding positions left out of the comparisons: where a token model's attention mask says
padding (`qcal.graph.attention_masks`), its outputs of one row per position hold values nothing
reads, so float and quantized models are compared on the real tokens only, sample by sample.
Both the evaluation (`qcal.accuracy.evaluate`) and sensitivity read their outputs so.

Which value marks padding is measured, not assumed (`measured_mask`): on a batch that holds
both values, the float model runs again with the content of one value's positions changed (its
other inputs of the mask's shape: token ids replaced by a real token's, float inputs moved); the
positions of the value whose content changes none of the other positions' outputs are padding.
Hugging Face's masks mark it 0, PyTorch's `key_padding_mask` True; a decoder's outputs read
beside an encoder's mask, or a mask of other meaning, pass neither way, and nothing is left
out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qcal.graph.attention_masks import AttentionMask

__all__ = ["PaddingCount", "compared_positions", "has_positions", "label_among_real",
           "measured_mask", "position_pieces", "real_pieces"]

# An output at a real position moved by less than this share of the outputs' largest value
# when the padding's content changed is unchanged (masked attention adds exp(-10000) = 0).
_UNMOVED = 1e-4


@dataclass
class PaddingCount:
    """The mask input and how many of the positions it covered it left out."""

    input: str
    value: int  # the mask's value that marks padding
    left_out: int = 0
    positions: int = 0

    def add(self, valid: np.ndarray) -> None:
        self.positions += int(valid.size)
        self.left_out += int(valid.size - np.count_nonzero(valid))

    def to_json(self) -> dict[str, object]:
        return {"input": self.input, "padding_value": self.value,
                "positions_left_out": self.left_out, "positions": self.positions}


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
    valid: np.ndarray = values != mask.padding
    # no real token in the whole batch: a mask of other meaning (an additive mask of zeros)
    return valid if valid.any() else None


def has_positions(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> bool:
    """Whether both outputs hold one row per position of this batch's mask."""
    return x.shape == y.shape and x.ndim >= 2 and x.shape[:2] == valid.shape


def real_pieces(x: np.ndarray, y: np.ndarray, valid: np.ndarray | None
                ) -> list[tuple[int, np.ndarray, np.ndarray]] | None:
    """An output's real positions to compare, sample by sample (`position_pieces`); None: the
    outputs whole (no padding in the batch, or not of one row per position of its mask)."""
    if valid is None or valid.all() or not has_positions(x, y, valid):
        return None
    return position_pieces(x, y, valid)


def position_pieces(x: np.ndarray, y: np.ndarray, valid: np.ndarray
                    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per sample with a real position, (sample, its positions of `x`, of `y`) as a batch of
    one ([1, positions, ...]), for outputs of one row per position (`has_positions`). Scores
    of one value per position ([samples, sequence]: a span's start) need two positions to
    choose from: a sample of one real token holds no such decision and is passed over."""
    least = 2 if x.ndim == 2 else 1
    return [(i, x[i][valid[i]][None], y[i][valid[i]][None])
            for i in range(valid.shape[0]) if np.count_nonzero(valid[i]) >= least]


def label_among_real(label: Any, real: np.ndarray, rank: int) -> np.ndarray:
    """A sample's label, as a batch of one, for its output's real positions (`position_pieces`):
    a position, for scores of one value per position ([samples, sequence]: a span's start),
    counted among the real ones (left padding moves them), -1 where it points at padding;
    as it is for other outputs."""
    if rank != 2:
        return np.asarray([label])
    position = int(label)
    inside = 0 <= position < real.shape[0] and bool(real[position])
    return np.asarray([np.count_nonzero(real[:position]) if inside else -1])


def measured_mask(mask: AttentionMask | None, feed: Mapping[str, Any], session: Any,
                  before: Mapping[str, np.ndarray]) -> tuple[bool, AttentionMask | None]:
    """Whether this batch told which value of `mask` marks padding, and the mask then: with
    that value, or None where neither is padding (module docstring). `session`: the float
    model's; `before`: its outputs on `feed`, by name, the masked ones among them. A batch
    without both values, or a model without a mask, tells nothing."""
    if mask is None:
        return False, None
    found = compared_positions(feed, replace(mask, padding=0))
    if found is None or found.all():
        return False, mask
    names = sorted(mask.outputs)

    def run(inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(inputs))))

    for padding, real in ((0, found), (1, ~found)):
        moved = _moved_content(feed, mask.input, real)
        if moved is not None and _unchanged(before, run(moved), mask.outputs, real):
            return True, replace(mask, padding=padding)
    return True, None


def _moved_content(feed: Mapping[str, Any], mask: str, real: np.ndarray
                   ) -> dict[str, Any] | None:
    """`feed` with the content of the positions not `real` changed, in the inputs of the mask's
    shape but the mask: integers (token ids, types) replaced by the sample's first real one,
    floats moved by 1. None where no input of that shape holds content."""
    moved, changed = dict(feed), False
    for name, value in feed.items():
        array = np.asarray(value)
        if name == mask or array.shape[:2] != real.shape:
            continue
        array = array.copy()
        for i in range(real.shape[0]):
            if not real[i].any() or real[i].all():
                continue
            if array.dtype.kind in "biu":
                array[i][~real[i]] = array[i][real[i]][0]
            elif array.dtype.kind == "f":
                array[i][~real[i]] += 1
        moved[name], changed = array, True
    return moved if changed else None


def _unchanged(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
               outputs: frozenset[str], real: np.ndarray) -> bool:
    """Whether every masked output kept its values at the `real` positions."""
    compared = False
    for name in outputs:
        x, y = np.asarray(before[name]), np.asarray(after[name])
        if not has_positions(x, y, real) or x.dtype.kind not in "fiu":
            continue
        a, b = x[real].astype(np.float64), y[real].astype(np.float64)
        scale = float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0))
        both = np.isfinite(a) & np.isfinite(b)
        if not np.array_equal(np.isfinite(a), np.isfinite(b)) or (
                both.any() and float(np.max(np.abs(a[both] - b[both]))) > _UNMOVED * max(scale, 1e-30)):
            return False
        compared = True
    return compared
