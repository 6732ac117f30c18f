"""Counting decisions float vs quantized: how an output read as decisions (`DecisionRule`,
chosen by `qcal.accuracy.decisions`) is counted, and near-ties of the float model.

A decision the float model itself does not hold is no disagreement: where its two candidates'
scores (float top-1 and quantized top-1, read in the float output) differ by less than
TIE_TOLERANCE of the sample's largest score, or a probability lies that close to 0.5, a change
of mind is counted as agreement. That is about a hundred float32 steps: float models flip such
near-ties between thread counts and kernels, and untrained networks are full of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MAP_CLASSES", "TIE_TOLERANCE", "Argmax", "DecisionRule", "agreeing_by_sample", "argmax_ties",
           "decisions_by_class", "is_classifier_like", "probability_rows", "sequence_axis",
           "sequences_read_alike", "yes_decisions", "yes_of_classes"]

TIE_TOLERANCE = 1e-5
# Classes a Conv's upsampled maps must have to be read as a segmentation's: two channels so
# resized are as often a flow's (dx, dy), whose argmax means nothing.
MAP_CLASSES = 3
# The float model's argmax, the quantized model's, and where the two are a near-tie of the float
# model's scores (`argmax_ties`).
Argmax = tuple[np.ndarray, np.ndarray, np.ndarray]


def is_classifier_like(shape: tuple[int, ...], *, per_position: bool = False) -> bool:
    """[N, classes]; with `per_position` (a softmax over the last axis), any rank from 2."""
    return (len(shape) == 2 or (per_position and len(shape) > 2)) and shape[-1] >= 2


@dataclass(frozen=True)
class DecisionRule:
    """How one output is read.

    Attributes:
        threshold: a sigmoid's probabilities, each a yes/no at 0.5.
        softmax_axis: for a softmax (or the version converter's spelling of an old one), the
            axis it normalizes; its positions are decisions when that is the last axis.
        linear: a linear layer's scores over the last axis; its positions are decisions.
        channel_maps: the classes are on axis 1 of a map, ``[N, classes, ...]``: one decision
            per position (a segmentation's pixels), as for a softmax over that axis.
    """

    threshold: bool = False
    softmax_axis: int | None = None
    linear: bool = False
    channel_maps: bool = False

    def applies(self, shape: tuple[int, ...]) -> bool:
        """Whether an output of this shape holds decisions under the rule."""
        if self.threshold:
            return len(shape) > 0
        if self.channel_maps and len(shape) >= 3:
            return shape[1] >= (2 if self.softmax_axis is not None else MAP_CLASSES)
        last = self.linear or (self.softmax_axis is not None
                               and self.softmax_axis in (-1, len(shape) - 1))
        return is_classifier_like(shape, per_position=last and len(shape) > 2)

    def class_last(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """An output's shape with its classes' axis last, as `argmax` reads it."""
        if self.channel_maps and len(shape) >= 3:
            return (shape[0], *shape[2:], shape[1])
        return shape

    def argmax(self, x: np.ndarray, y: np.ndarray) -> Argmax:
        """`argmax_ties` over the classes' axis: the last, or a map's channels (axis 1), one
        decision per position."""
        if self.channel_maps:
            x, y = np.moveaxis(x, 1, -1), np.moveaxis(y, 1, -1)
        return argmax_ties(x, y)

    def count(self, x: np.ndarray, y: np.ndarray, argmax: Argmax | None = None,
              ) -> tuple[int, int, np.ndarray | None]:
        """(decisions that agree, decisions, the float model's per-sample classes or None);
        float `x`, quantized `y`, and their `argmax` when already taken. Near-ties of
        the float model agree (module docstring)."""
        if self.threshold:
            fx, fy = x > 0.5, y > 0.5
            tie = np.abs(x.astype(np.float64) - 0.5) <= TIE_TOLERANCE * 0.5
            return int(np.count_nonzero((fx == fy) | tie)), int(fx.size), None
        fx, fy, tie = argmax if argmax is not None else self.argmax(x, y)
        agree = int(np.count_nonzero((fx == fy) | tie))
        return agree, int(fx.size), fx if fx.ndim == 1 else None


def argmax_ties(x: np.ndarray, y: np.ndarray) -> Argmax:
    """The float and quantized argmax over the last axis, and where the float model's own
    scores for the two lie within TIE_TOLERANCE (module docstring)."""
    fx, fy = np.argmax(x, axis=-1), np.argmax(y, axis=-1)
    wide = x.astype(np.float64)
    chosen = np.take_along_axis(wide, fx[..., None], axis=-1)[..., 0]
    other = np.take_along_axis(wide, fy[..., None], axis=-1)[..., 0]
    largest = np.max(np.abs(wide), axis=-1)
    return fx, fy, chosen - other <= TIE_TOLERANCE * largest


def agreeing_by_sample(argmax: Argmax, samples: int | None) -> np.ndarray | None:
    """Which decisions are alike (near-ties of the float model too), one row per sample: the
    batch axis is the first of the argmax's first two axes that holds `samples` (a CRNN's
    ``[T, N]`` positions on the second); None where none does."""
    fx, fy, tie = argmax
    axis = None if samples is None else next(
        (a for a in range(min(2, fx.ndim)) if fx.shape[a] == samples), None)
    if axis is None:
        return None
    alike: np.ndarray = np.moveaxis((fx == fy) | tie, axis, 0).reshape(samples, -1)
    return alike


def decisions_by_class(argmax: Argmax, classes: int) -> list[np.ndarray]:
    """A per-position argmax's decisions by class: the float model's, the quantized model's
    (a near-tie of the float model's scores its float class) and both's alike."""
    fx, fy, tie = argmax
    fy = np.where(tie, fx, fy)
    return [np.bincount(v.ravel(), minlength=classes) for v in (fx, fy, fx[fx == fy])]


# The share of a per-position argmax's positions one class must hold to be its background, whose
# agreement says little (`yes_of_classes`): not a tagger's commonest class among a few of like
# frequency.
_BACKGROUND_SHARE = 2.0 / 3.0


def yes_of_classes(counts: list[np.ndarray] | None) -> list[int]:
    """A per-position argmax's yes decisions, read as a sigmoid's are, from `decisions_by_class`
    summed: its positions of any class but the one most of the float model's are (a detector's
    anchors' background, a CTC recognizer's blank), the float model's, the quantized's and
    both's alike; [0, 0, 0] where no class holds _BACKGROUND_SHARE of them. Agreement over
    every position is mostly that background's (a captcha's 20 positions of 4 or 5 characters)."""
    if counts is None:
        return [0, 0, 0]
    float_, quant, both = counts
    background = int(np.argmax(float_))
    if float_[background] < _BACKGROUND_SHARE * float_.sum():
        return [0, 0, 0]
    return [int(c.sum() - c[background]) for c in (float_, quant, both)]


def sequence_axis(shape: tuple[int, ...], samples: int, known: int | None) -> int | None:
    """The axis of a per-position output of rank 3 (``[T, N, classes]`` as a CRNN writes it, or
    ``[N, T, classes]``) that holds its batch of `samples`: the one of its first two of that
    size; when both are (as many positions as samples), `known`, the axis an earlier batch
    showed, else the first. None: another rank, or neither axis is the batch."""
    if len(shape) != 3:
        return None
    axes = [axis for axis in (0, 1) if shape[axis] == samples]
    if len(axes) == 2:
        return known if known is not None else 0
    return axes[0] if axes else None


def sequences_read_alike(argmax: Argmax, axis: int) -> tuple[int, int]:
    """(samples whose sequence the quantized model reads as the float model does, samples) of
    a per-position output, from its `argmax_ties`, its batch along `axis`. A sample's reading is its positions'
    argmax with repeats merged, as a CTC decoder or a tagger's segments read it: it is the
    same when every position agrees (or is a near-tie of the float model), or when the merged
    labels are equal (a boundary moved by a position changes no text and no segment)."""
    fx, fy, tie = (np.moveaxis(a, axis, 0) for a in argmax)
    alike = sum(1 for a, b, t in zip(fx, fy, tie)
                if bool(np.all((a == b) | t)) or np.array_equal(_merged(a), _merged(b)))
    return alike, int(fx.shape[0])


def _merged(labels: np.ndarray) -> np.ndarray:
    """`labels` with each run of repeats kept once."""
    keep = np.ones(labels.shape, dtype=bool)
    keep[1:] = labels[1:] != labels[:-1]
    return labels[keep]


def yes_decisions(x: np.ndarray, y: np.ndarray) -> tuple[int, int, int]:
    """Elements above 0.5 in the float `x`, in the quantized `y`, and in both (probabilities of
    the same shape)."""
    fx, fy = x > 0.5, y > 0.5
    return int(np.count_nonzero(fx)), int(np.count_nonzero(fy)), int(np.count_nonzero(fx & fy))


def probability_rows(x: np.ndarray) -> bool:
    """Whether every row of `x` along its last axis (of at least 2) is a probability
    distribution: finite, non-negative, summing to 1 within the type's rounding."""
    if x.dtype.kind != "f" or x.ndim < 2 or x.shape[-1] < 2 or x.size == 0:
        return False
    values = x.astype(np.float64, copy=False)
    if not np.isfinite(values).all() or values.min() < 0:
        return False
    tolerance = 1e-2 if x.dtype.itemsize < 4 else 1e-4
    return bool(np.abs(values.sum(axis=-1) - 1.0).max() <= tolerance)
