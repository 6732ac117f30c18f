"""How many of a classifier's decisions its quantization error would change on other samples:
each sample's error met with every other sample's scores.

A few dozen samples cannot show 99 % agreement by counting (16 of 16 alike show only 85.5 %).
They can show how large the quantization error is against how far the float model's decisions
are from changing: sample j's error e_j, added to sample i's float scores s_i, changes i's
decision when argmax(s_i + e_j) is not argmax(s_i). Over every pair i != j, n(n − 1) trials
instead of n, the share that change estimates the disagreement on samples like these; it sees
a heavy tail of rare large errors that the count on the held-out samples misses (an
EfficientNetV2 whose 64 calibration photos agreed, 1 in 20 of its errors large: 11.9 % of the
pairs change, and 5 % of 200 other photos did; an r3d_18 video model, 64 of 64 alike: 3.3 %,
and 4.7 % of 128 other clips; networks that agree on 99-100 % of other samples: 0-1.1 %).
Scores are the output itself where it is a linear layer's, and the log of a softmax's
probabilities, whose differences between classes are those of the logits: an error added to
probabilities reads any change as small (0.2 % of the EfficientNetV2's pairs).

One sample may weigh on it alone: a float near-tie flips under most errors (one digit of 64,
its top two classes level, moved the benchmark's PReLU network's pairs to 98.98 %, while all
200 of its evaluation digits agree). So the share is also taken without each sample in turn
(its pairs as scores and as error), and the highest of those says what the other samples show
whichever one is left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from qcal.accuracy.decision_counts import TIE_TOLERANCE

__all__ = ["DecisionRows", "crossed_agreement"]

# Values kept of either kind (scores, errors) at most: 4 MiB each in float32 (768 samples of
# 1000 classes; the comparison of every model the fallback tries keeps its own). An output of
# more keeps none and has no estimate.
MAX_VALUES = 1 << 20
# Classes of a sample that can take its decision, the nearest to its top score first: a change
# to one further away needs an error no model that agrees this much makes.
_CANDIDATES = 64
# The smallest normal float32: probabilities below it have lost their precision, and their
# logs say nothing of the logits.
_TINY = float(np.finfo(np.float32).tiny)


@dataclass
class DecisionRows:
    """One classifier output's per-sample rows, float scores and their quantization error
    (module docstring); `full` once more than MAX_VALUES came, and no estimate is made."""

    scores: list[np.ndarray] = field(default_factory=list)
    errors: list[np.ndarray] = field(default_factory=list)
    values: int = 0
    full: bool = False

    def add(self, x: np.ndarray, y: np.ndarray, *, probabilities: bool) -> None:
        """A batch's float `x` and quantized `y`, one row of classes per sample ``[N, k]``;
        `probabilities`: a softmax's, compared by their logs."""
        if self.full:
            return
        self.values += int(x.size)
        if self.values > MAX_VALUES or (self.scores and self.scores[0].shape[1] != x.shape[1]):
            self.full, self.scores, self.errors = True, [], []
            return
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        if probabilities:
            lost = (x64 < _TINY) | (y64 < _TINY)
            x64 = np.log(np.maximum(x64, _TINY))
            error = np.where(lost, 0.0, np.log(np.maximum(y64, _TINY)) - x64)
        else:
            error = y64 - x64
        self.scores.append(x64.astype(np.float32))
        self.errors.append(error.astype(np.float32))


def crossed_agreement(parts: Iterable[DecisionRows | None]) -> tuple[float, float] | None:
    """The share of decisions alike when each sample's error meets every other sample's scores,
    over the rows of `parts` together, and the highest such share without one of the samples
    (module docstring); None without three rows, or where a part kept none."""
    kept = [p for p in parts if p is not None]
    if not kept or any(p.full or not p.scores for p in kept):
        return None
    if len({p.scores[0].shape[1] for p in kept}) > 1:
        return None
    scores = np.concatenate([s for p in kept for s in p.scores]).astype(np.float64)
    errors = np.concatenate([e for p in kept for e in p.errors]).astype(np.float64)
    n = scores.shape[0]
    if n < 3:
        return None
    changed = _changed_pairs(scores, errors)
    total = int(changed.sum())
    without = total - changed.sum(axis=1) - changed.sum(axis=0)  # no pair (k, k) changes
    return (1.0 - total / (n * (n - 1)),
            1.0 - float(without.min()) / ((n - 1) * (n - 2)))


def _changed_pairs(scores: np.ndarray, errors: np.ndarray) -> np.ndarray:
    """[i, j]: whether sample j's error changes sample i's decision (never where i == j, nor
    to a class the float model holds level with its top: `TIE_TOLERANCE`)."""
    n = scores.shape[0]
    top = np.argmax(scores, axis=1)
    # no error moves a class up on the top one by more than its largest spread
    span = float(np.max(errors.max(axis=1) - errors.min(axis=1)))
    changed = np.zeros((n, n), dtype=bool)
    for i in range(n):
        row = scores[i]
        gaps = row[top[i]] - row
        near = np.flatnonzero(gaps <= span)
        near = near[near != top[i]]
        if near.size == 0:
            continue
        if near.size > _CANDIDATES:
            near = near[np.argsort(gaps[near], kind="stable")[:_CANDIDATES]]
        tie = TIE_TOLERANCE * float(np.max(np.abs(row)))
        near = near[gaps[near] > tie]
        if near.size == 0:
            continue
        # each pair's best rival class over its top one, by sample j
        lift = errors[:, near] - errors[:, top[i]][:, None] - gaps[near][None, :]
        changed[i] = lift.max(axis=1) > 0.0
        changed[i, i] = False
    return changed
