"""Accuracy and coverage gates for CI: thresholds the finished run must meet.

Each gate compares one figure of the finished run with a threshold the user set. The pipeline
writes the model and the report first (the report is the evidence, and it records every gate),
then raises AccuracyGateError naming the gates that failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qcal.accuracy.coverage import Coverage
from qcal.accuracy.evaluate import Comparison
from qcal.accuracy.latency import SideBySide
from qcal.accuracy.target import shown_down, worst_agreement, worst_yes_f1
from qcal.numerics.errors import AccuracyGateError

__all__ = ["BUILT_IN_GATES", "CALIBRATION_SAMPLES_GATE", "MET_HELD_OUT", "YES_NO", "GateResult",
           "Gates", "check_gates", "raise_for_failed"]

# The fallback's target met on the held-out samples, checked on the calibration samples too
# (`AccuracyTarget.clearly_missed`): a result only when it fails.
CALIBRATION_SAMPLES_GATE = "calibration-samples"
MET_HELD_OUT = " (met on the held-out ones): "  # before what that gate found missed

# Gates every run checks, set by no option.
BUILT_IN_GATES = frozenset({"finite-outputs", "accuracy-floor", "coverage-floor", "not-slower",
                            "prepared-model", CALIBRATION_SAMPLES_GATE})
# Gates whose value is a yes/no: whether the fallback reached its target (on the held-out
# samples, then on the calibration samples).
_REACHED_GATES = frozenset({"accuracy-floor", "target-sqnr", "max-agreement-drop",
                            CALIBRATION_SAMPLES_GATE})
YES_NO = " (1 yes, 0 no)"  # how the measure of a yes/no gate ends


@dataclass(frozen=True)
class Gates:
    """The thresholds a run must meet (None: that gate is off), and the fallback's own target
    (its option name and threshold: the default floor or the user's target), which counts as a
    gate when the fallback misses it."""

    fail_under_sqnr: float | None = None
    fail_under_agreement: float | None = None
    fail_if_coverage_below: float | None = None
    fail_if_slower: float | None = None
    fallback_target: tuple[str, float] | None = None
    # With the fallback on: the share of compute MACs (%) that must run in integers, whatever
    # kept the rest float (the selection, onnxruntime's own graph, the fallback).
    coverage_floor: float | None = None
    # Unless allowed (or --fail-if-slower sets a limit of its own): the quantized model may not
    # be slower than the float one beyond the timing noise, at 1 or 2 threads.
    not_slower: bool = False


@dataclass(frozen=True)
class GateResult:
    """One gate: its option, threshold, the measured value and whether it passed.

    Attributes:
        option: the flag that set it ("fail-under-sqnr", ...).
        measure: what was compared ("worst output SQNR (dB)", ...).
        threshold: the limit, in the measure's unit (dB or %).
        value: the measured value in that unit (None: outputs identical, so infinite SQNR).
        passed: whether the value meets the threshold.
    """

    option: str
    measure: str
    threshold: float
    value: float | None
    passed: bool

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        if self.option in _REACHED_GATES:  # a yes/no: the value says nothing more
            limit = "always checked" if self.option in BUILT_IN_GATES else f"--{self.option}"
            return f"{self.measure.removesuffix(YES_NO)} ({limit}): {verdict}"
        value = "infinite" if self.value is None else f"{self.value:.2f}"
        limit = ("always checked" if self.option in BUILT_IN_GATES
                 else f"--{self.option} {self.threshold:g}")
        if self.option == "coverage-floor":
            limit = f"the coverage floor {self.threshold:g} (--min-coverage)"
        if self.option == "not-slower":
            limit = "1 beyond the timing noise, always checked; --allow-slower accepts it"
        if self.option == "prepared-model":
            limit = f"{self.threshold:g}, always checked (a preparation step changed your model)"
        return f"{self.measure} {value} vs {limit}: {verdict}"

    def to_json(self) -> dict[str, object]:
        return {
            "option": self.option,
            "measure": self.measure,
            "threshold": self.threshold,
            "value": None if self.value is None else float(f"{self.value:.6g}"),
            "passed": self.passed,
        }


def check_gates(
    gates: Gates,
    comparison: Comparison | None,
    coverage: Coverage,
    fallback_reached: bool | None = None,
    speed: SideBySide | None = None,
    unconfirmed: tuple[int, str] | None = None,
) -> list[GateResult]:
    """Evaluate every gate that is set, in a fixed order (SQNR, agreement, coverage, latency).

    When any gate is set and the fallback ran without reaching its target above the coverage
    floor, that is a failed gate too (named after the target's option).

    One gate is always on: the quantized model may not compute non-finite values where the float
    model computes finite ones ("finite-outputs"). Such a model is broken whatever its other
    figures, so when it fails, every other gate fails with it. With the fallback on, so is the
    coverage floor ("coverage-floor"): a model with Conv/MatMul/Gemm nodes of which less than
    that share runs in integers, or one with none of which no node is quantized, is no
    quantized model to hand over silently; nor is one whose
    target, met on the held-out samples, the calibration samples show missed beyond doubt
    (`unconfirmed`: their count and what missed). And unless allowed,
    a quantized model that the latency check (`speed`) found slower beyond the noise at a thread
    count ("not-slower"): quantization that costs time is no gain to hand
    over silently either. Those two are results only when they fail.
    """
    results: list[GateResult] = []
    broken = comparison is not None and bool(comparison.broken_outputs)
    if broken:
        assert comparison is not None
        introduced = sum(o.nonfinite_introduced for o in comparison.outputs)
        names = ", ".join(comparison.broken_outputs)
        results.append(GateResult("finite-outputs", f"non-finite output values the float model "
                                  f"does not produce (outputs {names})", 0.0,
                                  float(introduced), False))
    if gates.fail_under_sqnr is not None:
        sqnr = None if comparison is None else comparison.worst_finite_sqnr_db()
        passed = (comparison is not None and not broken
                  and (sqnr is None or sqnr >= gates.fail_under_sqnr))
        results.append(GateResult("fail-under-sqnr", "worst output SQNR (dB)",
                                  gates.fail_under_sqnr, sqnr, passed))
    if gates.fail_under_agreement is not None:
        agreement = None if comparison is None else worst_agreement(comparison)
        value = None if agreement is None else 100.0 * agreement
        passed = value is not None and value >= gates.fail_under_agreement and not broken
        results.append(GateResult("fail-under-agreement", "worst top-1 agreement (%)",
                                  gates.fail_under_agreement, value, passed))
    if gates.fail_if_coverage_below is not None:
        value = 100.0 * coverage.fraction
        measure = ("quantized share of compute MACs (%)" if coverage.basis == "macs"
                   else "quantized share of compute nodes (%)")
        results.append(GateResult("fail-if-coverage-below", measure,
                                  gates.fail_if_coverage_below, value,
                                  value >= gates.fail_if_coverage_below and not broken))
    # A model with no Conv/MatMul/Gemm of which nothing is quantized (a logistic regression,
    # skl2onnx's LinearClassifier) is the float model too: it was handed over with exit 0.
    if gates.coverage_floor is not None and not coverage.mostly_in_bodies and (
            coverage.compute_nodes or not coverage.anything_quantized):
        value = 100.0 * coverage.fraction
        if value < gates.coverage_floor:  # checked always: only a miss is a result
            why = (f" ({coverage.float_reasons})" if coverage.float_reasons
                   else "" if coverage.compute_nodes else
                   " (the model has none, and no other node of it is quantized)")
            results.append(GateResult(
                "coverage-floor", f"share of Conv/MatMul/Gemm compute running in integers (%)"
                f"{why}", gates.coverage_floor, value, False))
    if gates.fail_if_slower is not None:
        results.append(GateResult(
            "fail-if-slower", "quantized/float latency, worst of 1 and 2 threads (x)",
            gates.fail_if_slower, None if speed is None else speed.worst_ratio,
            speed is not None and speed.worst_ratio <= gates.fail_if_slower and not broken))
    if gates.not_slower and speed is not None and speed.clearly_slower:
        threads = " and ".join(str(t) for t in speed.clearly_slower)
        # the ratio at the thread counts found slower (a burst of load can make the other
        # count's figure the larger one without it being beyond the noise)
        ratio = max(speed.ratio(t) for t in speed.clearly_slower)
        results.append(GateResult(
            "not-slower", f"quantized/float latency on this machine, slower at {threads} "
            f"thread{'s' * (speed.clearly_slower != (1,))} (x)", 1.0, ratio, False))
    if unconfirmed is not None:
        option, threshold = gates.fallback_target or ("accuracy-floor", 0.0)
        what = "the accuracy floor" if option == "accuracy-floor" else f"--{option} {threshold:g}"
        count, missed = unconfirmed
        results.append(GateResult(
            CALIBRATION_SAMPLES_GATE, f"{what} on the {count} calibration samples"
            f"{MET_HELD_OUT}{missed}{YES_NO}", 1.0, 0.0, False))
    if fallback_reached is False:  # the default floor, or the target that replaced it
        option, threshold = gates.fallback_target or ("max-agreement-drop", 0.0)
        what, notes = (("accuracy floor", ["see README"]) if option == "accuracy-floor"
                       else ("fallback target", [f"--{option} {threshold:g}"]))
        if comparison is not None:  # the one-line reason names the figures that missed
            notes.append(_figures(comparison))
        said = f" ({'; '.join(notes)})" if notes else ""
        # the figures after the whole condition: "(floor) reached ...: FAILED" read as met
        measure = f"{what} above the coverage floor{said}{YES_NO}"
        # a yes/no in the report's units: value 0 (no) against the 1 (yes) it needed; the
        # target's own figure is in the measure
        results.append(GateResult(option, measure, 1.0, 0.0, False))
    return results


def _figures(comparison: Comparison) -> str:
    """The measured quality in a few words: the worst agreement, the worst other SQNR."""
    said = []
    agreement = worst_agreement(comparison)
    if agreement is not None:
        said.append(f"{shown_down(100 * agreement, 2)} % of the decisions agree")
    f1 = worst_yes_f1(comparison)
    if f1 is not None:
        said.append(f"F1 {shown_down(f1, 3)} of the yes decisions")
    sqnr = comparison.worst_finite_sqnr_db(floor=True)
    if sqnr is not None:
        said.append(f"worst SQNR {shown_down(sqnr, 1)} dB")
    return ", ".join(said) or "outputs identical"


def raise_for_failed(results: Sequence[GateResult], report_path: object) -> None:
    """Raise AccuracyGateError naming every failed gate (the report is already written)."""
    failed = [r for r in results if not r.passed]
    if failed:
        where = f"; see {report_path}" if report_path is not None else ""
        raise AccuracyGateError("; ".join(r.describe() for r in failed) + where)
