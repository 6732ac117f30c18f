"""Faults while writing: a full disk, and two runs writing the same outputs at once."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from qcal.cli import main
from qcal.graph.files import atomic
from qcal.numerics import errors

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"
MODEL, DATA = SAMPLES / "digits_cnn.onnx", SAMPLES / "digits_cnn.calib.npz"


def _full_disk_at(write: int) -> Callable[[int], None]:
    """An fsync that fails with ENOSPC on the `write`-th file synced (1: the first)."""
    real, count = os.fsync, [0]

    def fsync(fd: int) -> None:
        count[0] += 1
        if count[0] == write:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    return fsync


def _calibrate(out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["calibrate", str(MODEL), "--data", str(DATA), "-o",
                                       str(out / "q.onnx"), "--report", str(out / "q.json"),
                                       "-q", "--limit", "8", *extra])
    return result.exit_code, result.output


@pytest.mark.parametrize(("write", "file"), [(1, "q.json"), (2, "q.onnx")])
def test_a_full_disk_leaves_no_output_and_exits_6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: int, file: str
) -> None:
    """The report is written (under a temporary name) before the model: a failure at either
    leaves neither, nor any temporary file, and names the file that could not be written."""
    monkeypatch.setattr(atomic.os, "fsync", _full_disk_at(write))
    code, output = _calibrate(tmp_path)
    assert code == errors.OutputError.exit_code == 6
    assert f"cannot write {tmp_path / file}: No space left on device" in output
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_with_force_leaves_the_old_outputs_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "q.onnx").write_bytes(b"old model")
    (tmp_path / "q.json").write_bytes(b"old report")
    monkeypatch.setattr(atomic.os, "fsync", _full_disk_at(2))
    code, _ = _calibrate(tmp_path, "--force")
    assert code == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.json", "q.onnx"]
    assert (tmp_path / "q.onnx").read_bytes() == b"old model"
    assert (tmp_path / "q.json").read_bytes() == b"old report"


def test_two_runs_writing_the_same_outputs_leave_one_whole_model(tmp_path: Path) -> None:
    """Each output is renamed into place whole: whichever run renames last, the files are a
    complete model and report (byte-identical to a run alone), never a mix or a truncation."""
    alone = tmp_path / "alone"
    alone.mkdir()
    assert _calibrate(alone)[0] == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    command = [sys.executable, "-m", "qcal.cli", "calibrate", str(MODEL), "--data", str(DATA),
               "-o", str(shared / "q.onnx"), "--report", str(shared / "q.json"), "-q",
               "--limit", "8", "--force"]
    runs = [subprocess.Popen(command, stderr=subprocess.PIPE) for _ in range(2)]
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr.decode()
    assert sorted(p.name for p in shared.iterdir()) == ["q.json", "q.onnx"]
    model = onnx.load(str(shared / "q.onnx"))
    onnx.checker.check_model(model)
    assert (shared / "q.onnx").read_bytes() == (alone / "q.onnx").read_bytes()
    for folder in (alone, shared):
        report = json.loads((folder / "q.json").read_text())
        report.pop("timings_seconds")
        report["output_model"].pop("path", None)
        report.pop("config")
        if folder is alone:
            expected = report
    assert report == expected
