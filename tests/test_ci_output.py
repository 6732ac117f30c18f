"""What CI jobs read: --json on stdout, --summary-md and $GITHUB_STEP_SUMMARY, plain text when
NO_COLOR is set or the output is not a terminal, and click's shell completion."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
QCAL = [sys.executable, "-c", "from qcal.cli import main; main()"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "GITHUB_STEP_SUMMARY")}
    return {**env, **extra}


def qcal(*args: str | Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QCAL, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env=_env(**env), timeout=600, check=False)


def test_json_is_one_line_on_stdout_and_says_the_exit_code(tmp_path: Path) -> None:
    done = qcal("calibrate", DIGITS, "--json", "--fail-under-sqnr", "99", cwd=tmp_path)
    assert done.returncode == 7, done.stderr
    assert done.stdout.count("\n") == 1
    summary = json.loads(done.stdout)
    report = json.loads((tmp_path / "digits_cnn.qcal.json").read_text())
    assert summary["exit_code"] == 7 and summary["failed"] == ["fail-under-sqnr"]
    assert summary["samples"] == report["data"]["samples"]
    assert summary["quantized_nodes"] == report["coverage"]["quantized"]
    assert summary["outputs"][0]["sqnr_db"] == report["evaluation"]["outputs"][0]["sqnr_db"]
    assert summary["report"] == str(tmp_path / "digits_cnn.qcal.json")
    passing = qcal("calibrate", DIGITS, "--json", "--force", cwd=tmp_path)
    assert passing.returncode == 0 and json.loads(passing.stdout)["exit_code"] == 0


def test_summary_md_and_the_github_step_summary(tmp_path: Path) -> None:
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    summaries = []
    for _ in range(2):  # each run appends its summary (they differ in the latency line)
        done = qcal("calibrate", DIGITS, "--summary-md", "s.md", "--force", "-q",
                    cwd=tmp_path, GITHUB_STEP_SUMMARY=str(step))
        assert done.returncode == 0, done.stderr
        summaries.append((tmp_path / "s.md").read_text())
    written = summaries[0]
    assert written.startswith("### qcal digits_cnn.onnx: PASS")
    assert "| logits |" in written and "| coverage |" in written
    assert step.read_text() == "earlier step\n" + "".join(summaries)
    # a failed gate says FAIL, and the file is still written
    done = qcal("calibrate", DIGITS, "--summary-md", "s.md", "--force", "-q",
                "--fail-under-sqnr", "99", cwd=tmp_path)
    assert done.returncode == 7
    text = (tmp_path / "s.md").read_text()
    assert "FAIL" in text.splitlines()[0] and "**FAILED**: fail-under-sqnr" in text
    # worded as the terminal's gate line, the measure and the option named
    assert "vs --fail-under-sqnr 99: FAILED" in text
    assert "gate failed" not in text  # the gate's line says it; its warning is not repeated


def test_summary_md_is_checked_before_the_run(tmp_path: Path) -> None:
    done = qcal("calibrate", DIGITS, "--summary-md", tmp_path / "missing" / "s.md", cwd=tmp_path)
    assert done.returncode == 6 and "--summary-md" in done.stderr
    assert not (tmp_path / "digits_cnn.qcal.json").exists()


_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_STYLE = re.compile(rb"\x1b\[[0-9;]*m")


def test_output_to_a_pipe_has_no_control_characters(tmp_path: Path) -> None:
    done = qcal("calibrate", DIGITS, "--fail-under-sqnr", "99", cwd=tmp_path)
    assert done.returncode == 7
    for stream in (done.stdout, done.stderr):
        assert stream and not _ESCAPE.search(stream) and "\r" not in stream
        assert all(ch in "\n\t" or ch >= " " for ch in stream)


def _in_terminal(args: list[str], cwd: Path, **env: str) -> bytes:
    """The command's output as a terminal shows it (a pseudo-terminal for stdout and stderr)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen([*QCAL, *args], cwd=cwd, stdout=follower, stderr=follower,
                               env=_env(TERM="xterm-256color", COLUMNS="120", **env))
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other side closed
            break
        if not chunk:
            break
        output += chunk
    process.wait(timeout=600)
    os.close(leader)
    return output


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_no_color_in_a_terminal_has_no_styles(tmp_path: Path) -> None:
    args = ["calibrate", str(DIGITS), "--force", "--fail-under-sqnr", "99"]
    styled = _in_terminal(args, tmp_path)
    assert _STYLE.search(styled), "a terminal shows colours by default (else this test proves nothing)"
    plain = _in_terminal(args, tmp_path, NO_COLOR="1")
    assert b"quality" in plain and b"gate" in plain
    assert not _STYLE.search(plain)


def test_shell_completion_is_clicks_own(tmp_path: Path) -> None:
    script = shutil.which("qcal")
    if script is None:
        pytest.skip("the qcal script is not installed on PATH")
    done = subprocess.run([script], cwd=tmp_path, capture_output=True, text=True, check=False,
                          env=_env(_QCAL_COMPLETE="bash_source"), timeout=60)
    assert done.returncode == 0 and "complete" in done.stdout and "_QCAL_COMPLETE" in done.stdout
    words = subprocess.run([script], cwd=tmp_path, capture_output=True, text=True, check=False,
                           env=_env(_QCAL_COMPLETE="bash_complete", COMP_WORDS="qcal di",
                                    COMP_CWORD="1"), timeout=60)
    assert "diff" in words.stdout


@pytest.mark.parametrize(("output", "sqnr", "agreement"), [
    ({"sqnr_db": None, "max_abs_error": 0.0, "top1_agreement": 1.0}, "exact", "100.00%"),
    # labels of a detector, most of them different: no SQNR, and not "exact"
    ({"sqnr_db": None, "max_abs_error": 86.0, "top1_agreement": 0.1054}, "-", "10.54%"),
    # just under a floor: never shown as the floor
    ({"sqnr_db": 13.96, "max_abs_error": 0.5, "top1_agreement": 0.98996}, "13.9", "98.99%"),
    # a sigmoid's map, and a detector's output whose probability part has yes decisions
    ({"sqnr_db": 7.5, "max_abs_error": 0.8, "top1_agreement": 0.9954, "yes_f1": 0.96999},
     "7.5", "99.54% (F1 0.969)"),
    ({"sqnr_db": 15.0, "max_abs_error": 2.4, "top1_agreement": None, "yes_f1": 0.934},
     "15.0", "F1 0.934"),
])
def test_the_tables_show_figures_rounded_down_and_exact_only_for_equal_outputs(
        output: dict[str, float | None], sqnr: str, agreement: str) -> None:
    from qcal._verdict import agreement_cell, sqnr_cell

    assert (sqnr_cell(output), agreement_cell(output)) == (sqnr, agreement)


def test_a_pipe_gets_names_whole_and_each_gate_on_one_line(tmp_path: Path) -> None:
    """A CI log is read with grep: a table keeps a long output name whole (it was cut to
    "keypoint…" at 80 columns) and a gate's line is one line."""
    name = "roi_heads/keypoint_predictor/kps_score_lowres/ConvTranspose_output_0/keypoints_scores"
    model = onnx.load(DIGITS)
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [name if o == old else o for o in node.output]
    model.graph.output[0].name = name
    onnx.save(model, tmp_path / "long.onnx")
    done = qcal("calibrate", tmp_path / "long.onnx", "--data", DIGITS.with_suffix(".calib.npz"),
                "--fail-under-sqnr", "99", cwd=tmp_path)
    assert done.returncode == 7
    assert f"│ {name} │" in done.stdout
    gates = [line for line in done.stdout.splitlines() if line.startswith("gate:")]
    assert gates and all(line.endswith(("PASSED", "FAILED")) for line in gates)
