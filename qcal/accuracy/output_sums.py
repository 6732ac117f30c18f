"""The sums one output's comparison keeps, float model against quantized, and the figures
made of them (`qcal.accuracy.output_metrics.OutputMetrics`); what each figure means is said in
`qcal.accuracy.evaluate`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qcal.accuracy.crossed import DecisionRows
from qcal.accuracy.decision_counts import (
    Argmax,
    DecisionRule,
    agreeing_by_sample,
    decisions_by_class,
    probability_rows,
    sequence_axis,
    sequences_read_alike,
    yes_decisions,
    yes_of_classes,
)
from qcal.accuracy.output_metrics import MIN_YES_DECISIONS, OutputMetrics
from qcal.accuracy.output_parts import OutputPart, describe_parts, measured_groups, part_of
from qcal.numerics.errors import DataError
from qcal.numerics.sums import inner_product

__all__ = ["MAX_ROW_VALUES", "MIN_ROWS", "OutputAccumulator"]

# Fewer samples say too little of how an output varies between them (`variation_sqnr_db`).
MIN_ROWS = 4
# A sample's values summed for their mean at most (float64: 32 MiB; not a long text's logits).
MAX_ROW_VALUES = 1 << 22


@dataclass
class OutputAccumulator:
    signal: float = 0.0
    noise: float = 0.0
    dot: float = 0.0
    quant_energy: float = 0.0
    max_abs: float = 0.0
    agree: int = 0
    rows: int = 0
    # Σa², Σan, Σn² of each sample's agreeing decisions a of n (`_agreement_error`); None
    # once a batch's samples could not be told apart.
    sample_sums: list[float] | None = field(default_factory=lambda: [0.0, 0.0, 0.0])
    rule: DecisionRule | None = None  # None: no decisions, SQNR and cosine only
    correct_float: int = 0
    correct_quant: int = 0
    labelled: int = 0
    nonfinite_float: int = 0
    nonfinite_quantized: int = 0
    nonfinite_introduced: int = 0
    # Integer outputs (indices, labels, counts) are decisions: their elements agree or not.
    integer: bool = False
    equal: int = 0
    elements: int = 0
    # Batches whose outputs differ in shape (NonZero finds another count): they disagree.
    batches: int = 0
    other_shape: int = 0
    float_elements: int = 0  # of the batches of the same shape
    # No rule from the graph: an output whose rows are probability distributions in every
    # batch (a softmax however it is spelled, as jax2tf's Exp / ReduceSum / Div) is read as
    # decisions, one argmax per row.
    measure: bool = False
    # An output that concatenates parts of different kinds or sizes: each part's sums (when
    # the output has the rank they were found at).
    parts: tuple[OutputPart, ...] = ()
    part_signal: list[float] = field(default_factory=list)
    part_noise: list[float] = field(default_factory=list)
    # Yes decisions (> 0.5) of its probabilities: the float model's, the quantized's, both's.
    yes: list[int] = field(default_factory=lambda: [0, 0, 0])
    # A per-position argmax's decisions by class (`decisions_by_class`), summed; None: none, or
    # their count of classes changed.
    classes: list[np.ndarray] | None = None
    classes_apart: bool = False
    # A threshold rule's float probabilities, and those of them undecided (_UNDECIDED).
    probabilities: int = 0
    undecided: int = 0
    # A per-position output's samples read alike and read, its batch axis once a batch showed
    # it, and whether a batch held positions not to be told apart by sample.
    sequences_alike: int = 0
    sequences: int = 0
    sequence_axis: int | None = None
    unsplit: bool = False
    # One row per sample: their float sum, count and rank (`variation_energy`); `rows_apart`
    # once a batch was not such rows (non-finite values, samples not known); rows of another
    # width in some batch (images of several sizes) are summed as values, `value_sum` of them.
    row_sum: np.ndarray | None = None
    row_count: int = 0
    rows_apart: bool = False
    row_rank: int = 0
    widths_differ: bool = False
    value_sum: float = 0.0
    value_count: int = 0
    crossed: DecisionRows = field(default_factory=DecisionRows)  # one decision per sample

    def add(self, x: np.ndarray, y: np.ndarray, labels: np.ndarray | None,
            samples: int | None = None) -> None:
        """One batch's outputs, float `x` and quantized `y`, of `samples` samples (None: not
        known, so no sequences are read)."""
        self.batches += 1
        if x.shape != y.shape:
            self.other_shape += 1
            return
        self.float_elements += int(x.size)
        if x.dtype.kind in "biu":  # cosine and largest error still say how far they are
            self.integer = True
            self.equal += int(np.count_nonzero(x == y))
            self.elements += int(x.size)
        x64 = x.astype(np.float64, copy=False).ravel()
        y64 = y.astype(np.float64, copy=False).ravel()
        finite_x, finite_y = np.isfinite(x64), np.isfinite(y64)
        all_finite = bool(finite_x.all() and finite_y.all())
        self._add_rows(x64, x.shape, samples if all_finite and not self.integer else None)
        if not all_finite:
            self.nonfinite_float += int(finite_x.size - np.count_nonzero(finite_x))
            self.nonfinite_quantized += int(finite_y.size - np.count_nonzero(finite_y))
            self.nonfinite_introduced += int(np.count_nonzero(finite_x & ~finite_y))
            both = finite_x & finite_y
            x64, y64 = x64[both], y64[both]
        diff = x64 - y64
        self.signal += inner_product(x64, x64)
        self.noise += inner_product(diff, diff)
        self.dot += inner_product(x64, y64)
        self.quant_energy += inner_product(y64, y64)
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(diff))))
        if self.parts and x.ndim == len(self.parts[0].box):
            if not self.part_signal:
                self.part_signal, self.part_noise = [0.0] * len(self.parts), [0.0] * len(self.parts)
            for i, part in enumerate(self.parts):
                px, py = part_of(x, part.box), part_of(y, part.box)
                signal, noise = _energies(px, py)
                self.part_signal[i] += signal
                self.part_noise[i] += noise
                if part.probabilities:
                    self._count_yes(px, py)
        if self.measure:
            if probability_rows(x) and (self.batches == 1 or self.rule is not None):
                self.rule = self.rule or _MEASURED_SOFTMAX
            else:
                self.rule, self.measure = None, False
        if self.rule is not None and not self.rule.applies(x.shape):
            self.rule = None  # a shape without decisions (first batch or any later one)
        if self.rule is not None:
            if self.rule.threshold:
                self._count_yes(x, y)
                low, high = _UNDECIDED
                self.probabilities += int(x.size)
                self.undecided += int(np.count_nonzero((x > low) & (x < high)))
            # taken once for the positions and the sequences they make
            argmax = None if self.rule.threshold else self.rule.argmax(x, y)
            agree, decisions, classes = self.rule.count(x, y, argmax)
            self.agree += agree
            self.rows += decisions
            shape = self.rule.class_last(x.shape)
            if argmax is not None:
                self._count_by_sample(argmax, samples)
                if x.ndim == 2 and x.shape[0] == samples and all_finite and not self.integer:
                    self.crossed.add(x, y, probabilities=self.rule.softmax_axis is not None)
            if argmax is not None and x.ndim == 3:
                self._count_sequences(argmax, shape, samples)
            if argmax is not None and x.ndim >= 3:
                self._count_classes(argmax, shape[-1])
            if labels is not None and classes is not None:
                if labels.shape[0] != classes.shape[0]:
                    raise DataError(
                        f"labels: {labels.shape[0]} labels for a batch of {classes.shape[0]} outputs"
                    )
                fy = np.argmax(y, axis=-1)
                self.correct_float += int(np.sum(classes == labels))
                self.correct_quant += int(np.sum(fy == labels))
                self.labelled += int(labels.shape[0])

    def _add_rows(self, x64: np.ndarray, shape: tuple[int, ...], samples: int | None) -> None:
        """Sum the float rows of an output of one row per sample, of one size in every batch,
        at most MAX_ROW_VALUES: `[N, ...]`, N the batch's `samples` (a scalar for one)."""
        if self.rows_apart:
            return
        if samples is None or (shape[0] if shape else 1) != samples \
                or x64.size > MAX_ROW_VALUES * samples:
            self.rows_apart, self.row_sum = True, None
            return
        rows = x64.reshape(samples, -1)
        self.value_sum += float(rows.sum())
        self.value_count += int(rows.size)
        self.row_count += samples
        self.row_rank = max(self.row_rank, len(shape))
        if self.widths_differ:
            return
        if self.row_sum is None:
            self.row_sum = np.zeros(rows.shape[1])
        elif self.row_sum.shape[0] != rows.shape[1]:
            self.widths_differ, self.row_sum = True, None
            return
        self.row_sum += rows.sum(axis=0)

    @property
    def variation_energy(self) -> float | None:
        """Σ(x − x̄)² over the rows, x̄ the mean row: the energy of what tells the samples
        apart, which the error must stay small against. Against their whole energy an error
        scrambling speech-quality ratings near 3 of 5 still read 22 dB, as one on a log
        spectrum around 55 dB would. Rows of several widths (a depth model fed images of
        several sizes) have no mean row: Σ(x − m)² then, m the mean of all their values, what
        tells them apart from their common offset (a depth map read 36.1 dB against its whole
        energy where the same model on images of one size read 26.4 dB against its rows'
        variation). None: not rows of samples, or too few."""
        if self.rows_apart or self.row_count < MIN_ROWS or not self.value_count:
            return None
        if self.widths_differ:
            return self.signal - self.value_sum * self.value_sum / self.value_count
        assert self.row_sum is not None
        return self.signal - inner_product(self.row_sum, self.row_sum) / self.row_count

    def _values(self) -> bool:
        """Whether the output holds values whose offset says nothing (`variation_energy`):
        none of its decisions read, or a linear layer's scores, one row per sample (`[N]`,
        `[N, k]`: per-position scores are read by their decoder, argmax by argmax). Not
        probabilities: a softmax's or a sigmoid's, which a confident model holds near 1 on
        every sample of a class (a spam filter's held-out mail all ham), and whose level is
        what is read."""
        return self.rule is None or (not self.rule.threshold and self.rule.softmax_axis is None
                                     and self.row_rank <= 2)

    def _count_sequences(self, argmax: Argmax, shape: tuple[int, ...],
                         samples: int | None) -> None:
        axis = None if samples is None else sequence_axis(shape, samples, self.sequence_axis)
        if axis is None:
            self.unsplit = True
            return
        if shape[0] != shape[1]:
            self.sequence_axis = axis
        alike, read = sequences_read_alike(argmax, axis)
        self.sequences_alike += alike
        self.sequences += read

    def _count_yes(self, x: np.ndarray, y: np.ndarray) -> None:
        self.yes = [a + b for a, b in zip(self.yes, yes_decisions(x, y))]

    def _count_classes(self, argmax: Argmax, classes: int) -> None:
        if self.classes_apart:
            return
        counts = decisions_by_class(argmax, classes)
        if self.classes is None:
            self.classes = counts
        elif len(self.classes[0]) == classes:
            self.classes = [a + b for a, b in zip(self.classes, counts)]
        else:
            self.classes, self.classes_apart = None, True

    def metrics(self, name: str) -> OutputMetrics:
        sqnr = None if self.noise == 0.0 else 10.0 * math.log10(max(self.signal, 1e-300) / self.noise)
        variation = self.variation_energy if self._values() else None
        # rows that do not vary (beyond float64's rounding of the sums) have nothing to tell
        # apart: their SQNR alone says how far they are
        variation_sqnr = (10.0 * math.log10(variation / self.noise)
                          if variation is not None and self.noise > 0.0
                          and variation > 1e-9 * self.signal else None)
        worst_part = None
        groups = (measured_groups(self.part_signal, [p.probabilities for p in self.parts])
                  if self.part_signal else [])
        for group in groups if len(groups) > 1 else ():
            signal = sum(self.part_signal[i] for i in group)
            noise = sum(self.part_noise[i] for i in group)
            # parts the float model leaves at zero have no signal to measure their error against
            if noise > 0.0 and signal > 0.0 and sqnr is not None and (
                    part_sqnr := 10.0 * math.log10(signal / noise)) < sqnr:
                sqnr, worst_part = part_sqnr, describe_parts([self.parts[i].box for i in group])
        denom = math.sqrt(self.signal * self.quant_energy)
        cosine = 1.0 if denom == 0.0 and self.noise == 0.0 else (self.dot / denom if denom else 0.0)
        agreement = self.agree / self.rows if self.rule is not None and self.rows else None
        soft = self.undecided > _MOSTLY_UNDECIDED * self.probabilities
        if soft:  # values, not yes/no decisions: judged by their SQNR (`_UNDECIDED`)
            agreement = None
        if self.integer:  # no SQNR of indices: the share of equal elements is the agreement
            sqnr, agreement = None, self.equal / self.elements if self.elements else 1.0
        # an output of values whose only decisions are its batches' shapes (a speech model
        # whose waveform comes out longer or shorter)
        shapes_only = agreement is None and not self.integer and self.other_shape > 0
        if self.other_shape:  # a batch of another shape is a batch of decisions that differ
            same = 1.0 - self.other_shape / self.batches
            agreement = same * (1.0 if agreement is None else agreement)
        has_labels = self.rule is not None and self.labelled > 0
        decisions = ("equal" if self.integer else None if agreement is None
                     else "shape" if shapes_only
                     else "threshold" if self.rule is not None and self.rule.threshold
                     else "argmax")
        yes = (yes_of_classes(self.classes) if decisions == "argmax" and not self.yes[0]
               else self.yes)
        counted = yes[0] >= MIN_YES_DECISIONS and not soft  # enough yes decisions for an F1
        sequences = None
        if decisions == "argmax" and self.rule is not None and self.sequences and not self.unsplit:
            sequences = (self.sequences_alike / self.sequences
                         * (1.0 - self.other_shape / self.batches))
        return OutputMetrics(
            name=name,
            sqnr_db=sqnr,
            cosine=cosine,
            max_abs_error=self.max_abs,
            top1_agreement=agreement,
            float_accuracy=self.correct_float / self.labelled if has_labels else None,
            quantized_accuracy=self.correct_quant / self.labelled if has_labels else None,
            nonfinite_float=self.nonfinite_float,
            nonfinite_quantized=self.nonfinite_quantized,
            nonfinite_introduced=self.nonfinite_introduced,
            float_all_zero=(not self.integer and self.signal == 0.0 and self.nonfinite_float == 0
                            and self.batches > self.other_shape),
            float_all_empty=self.batches > self.other_shape and self.float_elements == 0,
            decisions=decisions,
            sqnr_part=None if self.integer else worst_part,
            sequence_agreement=sequences,
            variation_sqnr_db=variation_sqnr,  # no rows of an integer output are summed
            decision_count=(None if agreement is None else self.elements if self.integer
                            else self.batches if shapes_only else self.rows),
            yes_f1=2 * yes[2] / (yes[0] + yes[1]) if counted else None,
            yes_counts=(yes[0], yes[1], yes[2]) if counted else None,
            agreement_error=self._agreement_error() if decisions == "argmax" else None,
            decision_rows=(self.crossed if decisions == "argmax" and self.crossed.scores
                           and not self.other_shape else None),
        )

    def _count_by_sample(self, argmax: Argmax, samples: int | None) -> None:
        alike = None if self.sample_sums is None else agreeing_by_sample(argmax, samples)
        if alike is None or self.sample_sums is None:
            self.sample_sums = None
            return
        a = np.count_nonzero(alike, axis=1).astype(np.float64)
        n = float(alike.shape[1])
        a2, an, n2 = self.sample_sums
        self.sample_sums = [a2 + float(a @ a), an + n * float(a.sum()), n2 + n * n * len(a)]

    def _agreement_error(self) -> float | None:
        """sqrt(Σ(a − p·n)²) / Σn over the samples, p the agreement: the ratio estimator's
        standard error, samples as clusters (one decision each: sqrt(p(1 − p) / n))."""
        if self.sample_sums is None or not self.rows or self.other_shape:
            return None
        p = self.agree / self.rows
        a2, an, n2 = self.sample_sums
        return math.sqrt(max(a2 - 2.0 * p * an + p * p * n2, 0.0)) / self.rows


_MEASURED_SOFTMAX = DecisionRule(softmax_axis=-1)
# A sigmoid's output is read as yes/no decisions at 0.5 where the float model decides: trained
# detectors' and voice-activity models' maps hold 0-2 % of their probabilities between 0.1 and
# 0.9 (PP-OCRv6 det 2.1 %, PP-PicoDet's score maps 0-1.6 %, a VAD 0 %), fewer between 0.2 and
# 0.8. An output with most there is an image or a soft map whose values are read (a style
# transfer's sigmoid image 100 % between 0.1 and 0.9; photos' pixels 69 % between 0.2 and
# 0.8), judged by its SQNR. Not a mask whose background sits at 0.11-0.15 (a binary
# segmentation's: 93 % between 0.1 and 0.9, 6 % between 0.2 and 0.8): those are clear noes.
_UNDECIDED = (0.2, 0.8)
_MOSTLY_UNDECIDED = 0.5


def _energies(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Σx² and Σ(x−y)² over the elements both models computed finite."""
    x64 = x.astype(np.float64).ravel()
    y64 = y.astype(np.float64).ravel()
    both = np.isfinite(x64) & np.isfinite(y64)
    if not both.all():
        x64, y64 = x64[both], y64[both]
    diff = x64 - y64
    return inner_product(x64, x64), inner_product(diff, diff)
