"""The measured quality of a run in one sentence, read from its report: what the terminal
summary, the HTML page and the Markdown summary all say, in the same words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qcal.accuracy.evaluate import floor_sqnr_applies, floor_sqnr_value
from qcal.accuracy.gates import (
    CALIBRATION_SAMPLES_GATE,
    MET_HELD_OUT,
    YES_NO,
    GateResult,
)
from qcal.accuracy.target import agreement_lower_bound, shown_down
from qcal.config import DEFAULT_FLOOR_AGREEMENT_DROP, DEFAULT_FLOOR_SQNR_DB, DEFAULT_FLOOR_YES_F1
from qcal.report import gate_warning

__all__ = ["Verdict", "agreement_cell", "other_warnings", "quality_verdict", "sqnr_cell"]


def sqnr_cell(output: Mapping[str, Any]) -> str:
    """An output's SQNR as the tables show it, rounded down as the verdict and the gates show
    figures (one just under a floor never shows as the floor): "exact" only when the outputs
    are identical; "-" when there is none (an integer output's labels have an agreement
    instead, however many differ)."""
    if output["sqnr_db"] is not None:
        return shown_down(output["sqnr_db"], 1)
    return "exact" if output["max_abs_error"] == 0 else "-"


def _floor_sqnr(output: Mapping[str, Any]) -> float | None:
    """The SQNR the floor holds a report's output to (`floor_sqnr_value`)."""
    return floor_sqnr_value(output["sqnr_db"], output.get("variation_sqnr_db"))


# The share of decisions that must agree under the default floor.
_FLOOR_AGREEMENT = 1.0 - DEFAULT_FLOOR_AGREEMENT_DROP / 100.0


def _how_sure(output: Mapping[str, Any], given: bool) -> str:
    """What the count of decisions lets the worst agreement show, where that is less than the
    floor: 16 held-out samples that all agree cannot tell 99.7 % from 90 %. `given`: the user
    gave the evaluation data (--eval-data)."""
    count = output.get("decision_count")
    if not count:
        return ""
    bound = agreement_lower_bound(output["top1_agreement"], count)
    if bound >= _FLOOR_AGREEMENT:
        return ""
    more = "more evaluation samples" if given else "more evaluation samples, --eval-data,"
    return (f" (of {count} decisions, which show at 95 % confidence only that at least "
            f"{shown_down(100 * bound, 1)} % agree; {more} show more)")


def _measured_on(held: list[Mapping[str, Any]], worst: float) -> str:
    """Where the worst SQNR of the floor was measured, and against what: the part of a
    concatenated output (a detector's class scores), or an output's variation between samples
    (`OutputMetrics.variation_sqnr_db`)."""
    share = f"{100 * 10 ** (-worst / 10):.2g} %"
    for output in held:
        if _floor_sqnr(output) != worst:
            continue
        if output["sqnr_db"] != worst:
            return (f" on {output['name']}, against its variation between samples (error "
                    f"energy {share} of the variation's)")
        if output.get("sqnr_part"):
            return f" on {output['name']}{output['sqnr_part']} (error energy {share} of the signal's)"
        break
    return f" (error energy {share} of the signal's)"


def agreement_cell(output: Mapping[str, Any]) -> str:
    """An output's share of agreeing decisions as the tables show it (rounded down), or "-",
    with the F1 of its yes decisions where it has one (`yes_f1`)."""
    agreement = output["top1_agreement"]
    cell = "-" if agreement is None else f"{shown_down(100 * agreement, 2)}%"
    if agreement is not None and output.get("decisions") == "shape":
        cell = f"{cell} of shapes"
    sequences = output.get("sequence_agreement")
    if sequences is not None:  # a per-position output: its sequences too
        cell = f"{cell} ({shown_down(100 * sequences, 2)}% of sequences)"
    f1 = output.get("yes_f1")
    if f1 is None:
        return cell
    return f"F1 {shown_down(f1, 3)}" if agreement is None else f"{cell} (F1 {shown_down(f1, 3)})"


@dataclass(frozen=True)
class Verdict:
    """`level`: "broken", "below-floor", "within-floor" or "measured" (no floor was checked)."""

    level: str
    headline: str   # "quality: within the accuracy floor", ...
    detail: str     # the figures, and what to do when below the floor

    @property
    def text(self) -> str:
        return f"{self.headline}: {self.detail}" if self.detail else self.headline

    @property
    def ok(self) -> bool:
        return self.level in ("within-floor", "measured")


def padding_words(padding: Mapping[str, Any] | None) -> str:
    """What an evaluation's `padding` left out, to follow what it was measured on ("" for
    none)."""
    if not padding:
        return ""
    share = padding["positions_left_out"] / padding["positions"]
    return (f", on the real tokens: the {padding['positions_left_out']} positions "
            f"({100 * share:.0f} %) where {padding['input']!r} is "
            f"{padding.get('padding_value', 0)} (padding) left out")


def quality_verdict(report: Mapping[str, Any]) -> Verdict | None:
    """None when the report has no evaluation (nothing was measured)."""
    evaluation = report["evaluation"]
    if not evaluation:
        return None
    # Outputs the float model leaves at 0 are equal whatever the quantized model does: they say
    # nothing of it (the report's warnings name them).
    outputs = [o for o in evaluation["outputs"] if not o.get("float_all_zero")]
    if not outputs:  # sequences, maps, strings only, or outputs at 0
        return Verdict("measured", "quality: not measured",
                       "every output of this model is either not a numeric tensor or left at 0 "
                       "by the float model on every evaluation sample, so none tells how the "
                       "quantized model differs from it (see the warnings)")
    broken = [o["name"] for o in outputs if o.get("nonfinite_introduced")]
    deciding = [o for o in outputs if o["top1_agreement"] is not None]
    held = [o for o in outputs if floor_sqnr_applies(o["top1_agreement"], o.get("decisions"),
                                                      o.get("variation_sqnr_db"))]
    sqnrs = [_floor_sqnr(o) for o in held]
    figures = []
    if deciding:
        worst = min(deciding, key=lambda o: o["top1_agreement"])
        share = shown_down(100 * worst["top1_agreement"], 2)
        figures.append(
            f"{share}% of the samples give {worst['name']!r} the float model's shape (its "
            "length changes on the others)" if worst.get("decisions") == "shape" else
            f"{share}% of the decisions agree with the float model"
            + _how_sure(worst, report["config"].get("eval_data") is not None))
    sequences = [o["sequence_agreement"] for o in outputs
                 if o.get("sequence_agreement") is not None]
    if sequences:
        figures.append(f"{shown_down(100 * min(sequences), 2)}% of the sequences read alike")
    yes_f1s = [o["yes_f1"] for o in outputs if o.get("yes_f1") is not None]
    if yes_f1s:
        figures.append(f"F1 {shown_down(min(yes_f1s), 3)} of the yes decisions")
    if sqnrs:
        worst = min((s for s in sqnrs if s is not None), default=None)
        figures.append("outputs identical to the float model's" if worst is None else
                       f"worst SQNR {shown_down(worst, 1)} dB{_measured_on(held, worst)}")
    said = "; ".join(figures)
    floor = next((g for g in report["gates"] if g["option"] == "accuracy-floor"), None)
    config = report["config"]
    if broken:
        return Verdict("broken", "quality: BROKEN",
                       "the quantized model computes NaN or infinite values where the float "
                       f"model does not ({', '.join(broken)})")
    if floor is not None and not floor["passed"]:
        minimum = config["min_coverage"]
        fallback = report.get("fallback") or {}
        # Why the search stopped: the coverage floor, or no tensor left that it could blame.
        why = (f"Keeping float what harms most did not reach it with {minimum:g} % of compute "
               "quantized" if "coverage floor" in fallback.get("message", "coverage floor")
               else "Keeping float every tensor found harmful did not reach it")
        return Verdict(
            "below-floor",
            f"quality: below the accuracy floor ({100 - DEFAULT_FLOOR_AGREEMENT_DROP:g} % of "
            f"decisions, F1 {DEFAULT_FLOOR_YES_F1:g} of yes decisions, {DEFAULT_FLOOR_SQNR_DB:g} "
            "dB on values, sigmoids and per-sample scores)",
            f"{said}. {why}. To go on: --min-coverage "
            f"lower than {minimum:g} allows more float compute, another --method may fit this "
            "model's ranges, --no-fallback accepts this model as it is")
    unconfirmed = next((g for g in report["gates"]
                        if g["option"] == CALIBRATION_SAMPLES_GATE and not g["passed"]), None)
    if unconfirmed is not None:
        where, _, missed = unconfirmed["measure"].removesuffix(YES_NO).partition(MET_HELD_OUT)
        count = where.rsplit(" on the ", 1)[-1]  # "48 calibration samples"
        return Verdict(
            "below-floor", f"quality: below the accuracy floor on the {count}",
            f"{missed}; on the held-out samples, which met it: {said}. "
            "To go on: --eval-data with more samples of the data the model will see measures it "
            "there, --no-fallback accepts this model as it is")
    # The floor is checked by the fallback, which a weight-only run does not have.
    if (config["fallback"] and config.get("weight_only") is None and not config["target_sqnr"]
            and config["max_agreement_drop"] is None):
        return Verdict("within-floor", "quality: within the accuracy floor", said)
    if config.get("weight_only") is not None and not _gated(report):
        # nothing held the figures to a floor: say so where a user reads them
        return Verdict("measured", "quality (weight-only: no accuracy floor is checked; "
                       "--fail-under-agreement or --fail-under-sqnr sets one)", said)
    return Verdict("measured", "quality", said)


def _gated(report: Mapping[str, Any]) -> bool:
    """Whether an option's gate held the quality figures to a limit."""
    return any(g["option"] in ("fail-under-agreement", "fail-under-sqnr")
               for g in report["gates"])


def other_warnings(report: Mapping[str, Any]) -> list[str]:
    """The report's warnings but those of failed gates, which the gates' own lines show."""
    shown = {gate_warning(GateResult(**g)) for g in report["gates"]}
    return [w for w in report["warnings"] if w not in shown]
