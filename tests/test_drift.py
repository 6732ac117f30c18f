"""`qcal diff` and `qcal calibrate --baseline`: reports that differ in known ways, and the gate."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from qcal.cli import main
from qcal.drift import THRESHOLDS, compare_reports
from qcal.numerics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("baseline")
    result = run("calibrate", DIGITS, "-o", out / "q.onnx", "--report", out / "q.json", "-q")
    assert result.exit_code == 0, result.output
    return out / "q.json"


def _edited(report: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, str], float]]:
    """A copy with known moves, and the change each should show (the first output of `report`
    itself gets an F1 of yes decisions to move from)."""
    new = copy.deepcopy(report)
    acts = [t for t in new["tensors"] if t["role"] == "activation"]
    acts[0]["onnx"]["scale"][0] *= 1.05                       # +5 % scale
    acts[1]["onnx"]["zero_point"][0] += 3                     # 3 steps
    removed = acts[2]["name"]
    new["tensors"] = [t for t in new["tensors"] if t["name"] != removed]   # left float
    new["coverage"]["macs_quantized_fraction"] -= 0.025        # 2.5 points
    logits = new["evaluation"]["outputs"][0]
    logits["sqnr_db"] -= 2.0
    logits["top1_agreement"] -= 0.01                           # 1 point
    old_f1 = report["evaluation"]["outputs"][0]
    old_f1["yes_f1"], logits["yes_f1"] = 0.98, 0.965             # 1.5 points
    expected = {
        (acts[0]["name"], "scale"): 5.0,
        (acts[1]["name"], "zero-point"): 3.0,
        (removed, "tensors"): 1.0,
        ("(model)", "coverage"): 2.5,
        (logits["name"], "sqnr"): 2.0,
        (logits["name"], "agreement"): 1.0,
        (logits["name"], "f1"): 1.5,
    }
    return new, expected


def test_known_moves_are_found_with_their_size(baseline: Path) -> None:
    old = json.loads(baseline.read_text())
    new, expected = _edited(old)
    drift = compare_reports(old, new)
    found = {(m.name, m.measure): m.change for m in drift.moves}
    assert found.keys() == expected.keys()
    for key, change in expected.items():
        assert found[key] == pytest.approx(change, rel=1e-6), key
    # every one is over its default threshold
    assert {(m.name, m.measure) for m in drift.over} == expected.keys()
    # thresholds just above each change let all of them pass; just below, each fails alone
    generous = {"scale": 5.01, "zero-point": 3, "tensors": 1, "coverage": 2.51, "sqnr": 2.01,
                "agreement": 1.01, "f1": 1.51}
    assert compare_reports(old, new, generous).over == []
    for measure, value in generous.items():
        tight = {**generous, measure: value - 0.02}
        over = compare_reports(old, new, tight).over
        assert [m.measure for m in over] == [measure]


def test_identical_reports_have_no_move(baseline: Path) -> None:
    old = json.loads(baseline.read_text())
    drift = compare_reports(old, copy.deepcopy(old))
    assert drift.moves == () and drift.notes == ()


def test_an_exact_output_becoming_inexact_is_over_any_threshold(baseline: Path) -> None:
    old = json.loads(baseline.read_text())
    old["evaluation"]["outputs"][0]["sqnr_db"] = None
    drift = compare_reports(old, json.loads(baseline.read_text()), {"sqnr": 1000})
    assert [(m.measure, math.isinf(m.change), m.over) for m in drift.moves] == [("sqnr", True, True)]


def test_improvements_move_but_never_fail(baseline: Path) -> None:
    old = json.loads(baseline.read_text())
    new = copy.deepcopy(old)
    new["evaluation"]["outputs"][0]["sqnr_db"] += 5.0
    new["coverage"]["macs_quantized_fraction"] = 1.0
    old["coverage"]["macs_quantized_fraction"] = 0.9
    drift = compare_reports(old, new)
    assert {m.measure for m in drift.moves} == {"sqnr", "coverage"} and drift.over == []


def test_diff_command_gate(baseline: Path, tmp_path: Path) -> None:
    new, _ = _edited(json.loads(baseline.read_text()))
    edited = tmp_path / "new.json"
    edited.write_text(json.dumps(new))
    shown = run("diff", baseline, edited)
    assert shown.exit_code == 0, shown.output  # without --fail-on-drift it only shows
    assert "over" in shown.output and "coverage" in shown.output
    failed = run("diff", baseline, edited, "--fail-on-drift")
    assert failed.exit_code == 7 and "drift gate failed" in failed.output
    relaxed = ["--drift-threshold", "scale=10", "--drift-threshold", "zero-point=5",
               "--drift-threshold", "tensors=2", "--drift-threshold", "coverage=3",
               "--drift-threshold", "sqnr=2.5", "--drift-threshold", "agreement=2"]
    assert run("diff", baseline, edited, "--fail-on-drift", *relaxed).exit_code == 0
    as_json = run("diff", baseline, edited, "--json")
    parsed = json.loads(as_json.output)
    assert parsed["over"] == 6 and parsed["thresholds"]["scale"] == THRESHOLDS["scale"][0]


def test_bad_thresholds_are_configuration_errors(baseline: Path) -> None:
    for bad in ("speed=1", "scale=-1", "scale=fast", "scale"):
        result = run("diff", baseline, baseline, "--drift-threshold", bad)
        assert result.exit_code == 3, (bad, result.output)
        assert "--drift-threshold" in result.output
    result = run("calibrate", DIGITS, "--fail-on-drift")
    assert result.exit_code == 3 and "--baseline" in result.output
    with pytest.raises(ConfigError):
        compare_reports({}, {}, {"scale": float("nan")})


def test_calibrate_against_a_baseline(baseline: Path, tmp_path: Path) -> None:
    """Two real runs: the same options give no move; other data and method move ranges."""
    same = run("calibrate", DIGITS, "-o", tmp_path / "a.onnx", "--report", tmp_path / "a.json",
               "--baseline", baseline, "--fail-on-drift")
    assert same.exit_code == 0, same.output
    assert "no drift over the thresholds (0 figure(s) moved" in same.output
    other = run("calibrate", DIGITS, "-o", tmp_path / "b.onnx", "--report", tmp_path / "b.json",
                "--baseline", baseline, "--fail-on-drift", "--method", "percentile",
                "--limit", "50")
    assert other.exit_code == 7, other.output
    assert "method: 'auto' -> 'percentile'" in other.output
    assert (tmp_path / "b.onnx").exists() and (tmp_path / "b.json").exists()  # evidence kept
    # the same comparison from the files
    drift = compare_reports(json.loads(baseline.read_text()),
                            json.loads((tmp_path / "b.json").read_text()))
    assert any(m.measure == "scale" and m.over for m in drift.moves)


def test_a_missing_baseline_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    result = run("calibrate", DIGITS, "-o", tmp_path / "a.onnx", "--report", tmp_path / "a.json",
                 "--baseline", tmp_path / "none.json")
    assert result.exit_code == 5 and "--baseline" in result.output
    assert list(tmp_path.iterdir()) == []
