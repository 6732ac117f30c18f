"""Determinism: the same model, data and options give byte-identical QDQ models and reports
(timings aside), from run to run, whatever the batch size and the number of onnxruntime threads,
for the min-max and histogram methods and for each weight rounding. Moving averages depend on how samples are batched (each
batch is one update), so only repeated runs and thread counts are checked for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import residual_classifier
from click.testing import CliRunner

from qcal.cli import main

# (batch size, onnxruntime threads); the first is repeated to check run-to-run identity.
RUNS = [(1, 1), (1, 1), (5, 2), (24, 2), (7, 1)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A conv net with a residual Add and a classifier, and 24 samples of data."""
    folder = tmp_path_factory.mktemp("determinism")
    rng = np.random.default_rng(11)
    model = residual_classifier(rng, in_channels=8, channels=8, classes=5, side=12,
                                second_scale=0.1, softmax=True)
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "d.npz", x=rng.standard_normal((24, 8, 12, 12)).astype(np.float32))
    return folder / "m.onnx", folder / "d.npz"


def calibrate(
    inputs: tuple[Path, Path], out: Path, method: str, batch: int, threads: int,
    *flags: str,
) -> tuple[bytes, dict[str, Any]]:
    model, data = inputs
    result = CliRunner().invoke(
        main,
        [
            "calibrate", "--min-product-macs", "0",
            str(model),
            "--data",
            str(data),
            "--method",
            method,
            "--batch-size",
            str(batch),
            "--threads",
            str(threads),
            "-o",
            str(out / "q.onnx"),
            "--report",
            str(out / "q.json"),
            "-q",
            "--no-fallback",  # a near-tie flipping on these random weights is not the point
            *flags,
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "q.json").read_text())
    return (out / "q.onnx").read_bytes(), report


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """The report without timings and without what the runs are meant to differ in."""
    report = {k: v for k, v in report.items() if k != "timings_seconds"}
    report["config"] = {
        k: v for k, v in report["config"].items() if k not in ("batch_size", "threads")
    }
    report["data"] = {k: v for k, v in report["data"].items() if k != "batch_size"}
    report["runtime"] = {k: v for k, v in report["runtime"].items() if k != "threads"}
    report["output_model"] = {k: v for k, v in report["output_model"].items() if k != "path"}
    return report


@pytest.mark.parametrize("method", ["auto", "minmax", "percentile", "entropy", "mse"])
def test_identical_across_runs_batch_sizes_and_threads(
    inputs: tuple[Path, Path], tmp_path: Path, method: str
) -> None:
    results = []
    for i, (batch, threads) in enumerate(RUNS):
        out = tmp_path / str(i)
        out.mkdir()
        results.append(calibrate(inputs, out, method, batch, threads))
    first_model, first_report = results[0]
    for (model, report), (batch, threads) in zip(results[1:], RUNS[1:]):
        assert model == first_model, (batch, threads)
        assert comparable(report) == comparable(first_report), (batch, threads)
    assert first_report["evaluation"]["samples"] == 24


@pytest.mark.parametrize("rounding", ["auto", "gptq"])
def test_weight_rounding_is_identical_across_runs_batch_sizes_and_threads(
    inputs: tuple[Path, Path], tmp_path: Path, rounding: str
) -> None:
    """GPTQ's Hessians are exact integer sums: the codes it chooses do not depend on batching
    (auto: the classifier's Gemm by GPTQ, the Convs to nearest)."""
    results = []
    for i, (batch, threads) in enumerate(RUNS):
        out = tmp_path / str(i)
        out.mkdir()
        results.append(calibrate(inputs, out, "auto", batch, threads,
                                 "--weight-rounding", rounding))
    first_model, first_report = results[0]
    for (model, report), (batch, threads) in zip(results[1:], RUNS[1:]):
        assert model == first_model, (batch, threads)
        assert comparable(report) == comparable(first_report), (batch, threads)
    rounded = {t["name"] for t in first_report["tensors"] if "rounding" in t}
    assert rounded == ({"G"} if rounding == "auto" else {"W1", "W2", "G"})


def test_moving_average_is_identical_across_runs_and_threads_at_one_batch_size(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    results = []
    for i, threads in enumerate([1, 1, 2]):
        out = tmp_path / str(i)
        out.mkdir()
        results.append(calibrate(inputs, out, "moving-average", 4, threads))
    assert len({model for model, _ in results}) == 1
    assert all(comparable(r) == comparable(results[0][1]) for _, r in results)


def test_ranges_chosen_on_two_threads_are_those_chosen_on_one(
    inputs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activation ranges are chosen concurrently, each from its own statistics: the model is
    the one a single thread writes, for a histogram method."""
    import qcal._quantize_tensors as quantize_tensors

    written = []
    for workers in (1, 2):
        monkeypatch.setattr(quantize_tensors, "_RANGE_WORKERS", workers)
        out = tmp_path / str(workers)
        out.mkdir()
        written.append(calibrate(inputs, out, "mse", 1, 1))
    (one, one_report), (two, two_report) = written
    assert one == two and comparable(one_report) == comparable(two_report)
