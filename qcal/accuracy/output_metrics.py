"""The figures of one output's comparison, float model against quantized (`OutputMetrics`),
made of the sums `qcal.accuracy.output_sums` keeps; what each figure means is said in
`qcal.accuracy.evaluate`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qcal.accuracy.crossed import DecisionRows

__all__ = ["MIN_YES_DECISIONS", "OutputMetrics", "floor_sqnr_applies", "floor_sqnr_value"]

# Fewer yes decisions are too few for an F1: one cell would move it by over 2 %, most of the
# floor's 3 % (a detector's yes decisions on a handful of held-out images).
MIN_YES_DECISIONS = 50


def floor_sqnr_applies(top1_agreement: float | None, decisions: str | None,
                       variation_sqnr_db: float | None = None) -> bool:
    """Whether the floor's SQNR applies to an output: one without decisions; a sigmoid's map,
    whose per-element agreement a sparse map's confident background fills (a pitch detector's
    note maps, 2 % of them on, agreed at 99 % with 7.7 dB and a note F1 of 0.73); and one row
    of a linear layer's scores per sample, whose variation was measured: a regression head's
    values read as a classifier's by their shape and their linear layer (speech-quality
    ratings, signal, background and overall, whose argmax stays on the first) agree by their
    argmax however scrambled they are. Per-position scores are read by their decoder, argmax
    by argmax. Values whose only decisions are their shapes are held to it too. Not a set of
    detections: its rows are compared as a set
    (`qcal.accuracy.detection_sets`)."""
    if decisions == "detections":
        return False
    return (top1_agreement is None or decisions in ("threshold", "shape")
            or variation_sqnr_db is not None)


def floor_sqnr_value(sqnr_db: float | None, variation_sqnr_db: float | None) -> float | None:
    """The SQNR the floor holds an output to: the lower of its SQNR and its SQNR against its
    variation between samples (None: identical outputs, or no SQNR)."""
    values = [v for v in (sqnr_db, variation_sqnr_db) if v is not None]
    return min(values) if values else None


@dataclass(frozen=True)
class OutputMetrics:
    name: str
    sqnr_db: float | None
    cosine: float
    max_abs_error: float
    top1_agreement: float | None
    float_accuracy: float | None = None
    quantized_accuracy: float | None = None
    nonfinite_float: int = 0       # non-finite elements in the float model's output
    nonfinite_quantized: int = 0   # ... in the quantized model's output
    nonfinite_introduced: int = 0  # non-finite in the quantized output where the float is finite
    # The float model's output is 0 on every sample (a zero-initialised head): equal outputs
    # then say nothing of the quantized model (the report warns, and the verdict leaves it out).
    float_all_zero: bool = False
    # ... of no element at all on every sample (a detector that found nothing): likewise.
    float_all_empty: bool = False
    # How `top1_agreement` counts: "argmax" (per sample or position), "threshold" (a
    # sigmoid's yes/no at 0.5 per element), "equal" (integer outputs), "shape" (values whose
    # batches keep the float model's shape or not: a waveform of another length),
    # "detections" (a set of detections: `qcal.accuracy.detection_sets`); None: no decisions.
    decisions: str | None = None
    # The parts of a concatenated output whose SQNR `sqnr_db` is (`describe_parts`); None:
    # the whole output's.
    sqnr_part: str | None = None
    # F1 of the yes decisions of its probabilities (module docstring); None: none, or too few.
    yes_f1: float | None = None
    # A per-position output's share of samples whose sequence reads the same
    # (`qcal.accuracy.decision_counts.sequences_read_alike`); None: no sequences.
    sequence_agreement: float | None = None
    # Values of one row per sample ([N, ...]; a linear layer's scores, [N] or [N, k]): their
    # SQNR against how the rows vary between samples (`OutputAccumulator.variation_energy`);
    # None: no such output, fewer than `output_sums.MIN_ROWS` samples, rows alike, or
    # outputs identical.
    variation_sqnr_db: float | None = None
    # How many decisions `top1_agreement` counts (None: no decisions).
    decision_count: int | None = None
    # What `yes_f1` is computed from: the float model's yes decisions, the quantized model's
    # and both's (None where it is); not in the report.
    yes_counts: tuple[int, int, int] | None = None
    # The standard error of `top1_agreement`, each batch's decisions together (a sequence's
    # frames are no independent draws); not in the report. None: no decisions, or one batch.
    agreement_error: float | None = None
    # A classifier's rows of scores and errors (`qcal.accuracy.crossed`); not in the report.
    decision_rows: DecisionRows | None = field(default=None, compare=False, repr=False)

    @property
    def floor_sqnr(self) -> bool:
        """Whether the floor's SQNR applies (`floor_sqnr_applies`)."""
        return floor_sqnr_applies(self.top1_agreement, self.decisions, self.variation_sqnr_db)

    @property
    def floor_sqnr_db(self) -> float | None:
        """The SQNR the floor holds (`floor_sqnr_value`)."""
        return floor_sqnr_value(self.sqnr_db, self.variation_sqnr_db)

    @property
    def broken(self) -> bool:
        """The quantized model computes non-finite values the float model does not."""
        return self.nonfinite_introduced > 0

    def to_json(self) -> dict[str, float | int | str | None]:
        return {
            "name": self.name,
            "sqnr_db": _round(self.sqnr_db),
            "cosine": _round(self.cosine),
            "max_abs_error": _round(self.max_abs_error),
            "top1_agreement": _round(self.top1_agreement),
            "float_accuracy": _round(self.float_accuracy),
            "quantized_accuracy": _round(self.quantized_accuracy),
            "nonfinite_float": self.nonfinite_float,
            "nonfinite_quantized": self.nonfinite_quantized,
            "nonfinite_introduced": self.nonfinite_introduced,
            "decisions": self.decisions,
            "sqnr_part": self.sqnr_part,
            "yes_f1": _round(self.yes_f1),
            "sequence_agreement": _round(self.sequence_agreement),
            "variation_sqnr_db": _round(self.variation_sqnr_db),
            "decision_count": self.decision_count,
            "float_all_zero": self.float_all_zero,
        }


def _round(value: float | None) -> float | None:
    # Reports are compared byte for byte across runs; 9 significant digits hide summation noise
    # that does not exist anyway (sums are sequential) while keeping float32-level detail.
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.9g}")
