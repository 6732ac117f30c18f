"""Checkpoints: a collection stopped part-way (a signal, or a limit on the data) resumes from
its checkpoint file and ends byte-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import helper

from qcal.cli import main

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def header(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("header.json"))  # type: ignore[no-any-return]


def test_limit_then_resume_equals_one_run(tmp_path: Path) -> None:
    whole, out, part = tmp_path / "whole.stats", tmp_path / "out.stats", tmp_path / "part.stats"
    assert run("collect", DIGITS, "-o", whole, "-q").exit_code == 0
    first = run("collect", DIGITS, "-o", out, "-q", "--limit", "70", "--checkpoint", part,
                "--checkpoint-every", "32")
    assert first.exit_code == 0, first.output
    assert header(part)["data"]["samples"] == 70
    result = run("collect", DIGITS, "-o", out, "-q", "--force", "--checkpoint", part,
                 "--checkpoint-every", "32")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == whole.read_bytes() == part.read_bytes()


def test_checkpoint_of_other_data_or_options_is_refused(tmp_path: Path) -> None:
    part = tmp_path / "part.stats"
    assert run("collect", DIGITS, "-o", tmp_path / "a.stats", "-q", "--limit", "20",
               "--checkpoint", part).exit_code == 0
    other = tmp_path / "other.npz"
    data = np.load(ROOT / "sample_models" / "digits_cnn.calib.npz")["image"]
    np.savez(other, image=data[::-1])
    result = run("collect", DIGITS, "-o", tmp_path / "b.stats", "-q", "--data", other,
                 "--checkpoint", part)
    assert result.exit_code == 8 and "first 20 samples" in result.output
    result = run("collect", DIGITS, "-o", tmp_path / "b.stats", "-q", "--no-histograms",
                 "--checkpoint", part)
    assert result.exit_code == 8 and "histograms" in result.output
    assert not (tmp_path / "b.stats").exists()


def test_calibrate_with_checkpoint_equals_the_direct_run(tmp_path: Path) -> None:
    part = tmp_path / "part.stats"
    for name, extra in (("a", []), ("b", ["--checkpoint", part])):
        result = run("calibrate", DIGITS, "-o", tmp_path / f"{name}.onnx", "--report",
                     tmp_path / f"{name}.json", "-q", "--method", "entropy", *extra)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert header(part)["complete"] is True


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A stack of wide MatMuls (a few ms a sample on one thread) and 800 samples."""
    folder = tmp_path_factory.mktemp("slow")
    rng = np.random.default_rng(0)
    nodes, inits, last = [], {}, "x"
    for i in range(8):
        inits[f"W{i}"] = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [last, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"))
        last = f"r{i}"
    model = build_model(nodes, [float_input("x", ["N", 64, 256])], [last], inits)
    onnx.save(model, folder / "slow.onnx")
    np.savez(folder / "data.npz", x=rng.standard_normal((800, 64, 256)).astype(np.float32))
    return folder / "slow.onnx", folder / "data.npz"


def test_interrupted_collection_resumes_to_the_same_bytes(
    slow_model: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = slow_model
    part, out, whole = tmp_path / "part.stats", tmp_path / "out.stats", tmp_path / "whole.stats"
    common = ["--data", str(data), "--threads", "1", "--no-histograms", "-q"]
    args = [sys.executable, "-m", "qcal.cli", "collect", str(model), "-o", str(out), *common,
            "--checkpoint", str(part), "--checkpoint-every", "16"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not part.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err.decode()
    assert not out.exists()
    saved = header(part)
    assert saved["complete"] is False and 16 <= saved["data"]["samples"] < 800
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file
    resumed = run("collect", model, "-o", out, *common, "--checkpoint", part,
                  "--checkpoint-every", "16")
    assert resumed.exit_code == 0, resumed.output
    assert run("collect", model, "-o", whole, *common).exit_code == 0
    assert out.read_bytes() == whole.read_bytes()
