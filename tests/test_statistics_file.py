"""Statistics as files: `qcal collect` writes them, `calibrate --stats` builds the same model
and report as the direct run from them, mismatches are refused with exit 8."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from qcal.calibration.data import sample_digest
from qcal.calibration.statistics import read_statistics
from qcal.calibration.statistics._fingerprint import Fingerprint
from qcal.cli import main
from qcal.numerics.errors import StatisticsError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
TRANSFORMER = ROOT / "sample_models" / "transformer_block.onnx"
SCHEMA = json.loads(
    (ROOT / "qcal" / "calibration" / "statistics" / "statistics.schema.json").read_text())


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def comparable(report_path: Path) -> dict[str, Any]:
    """A report without what may differ between a direct run and one from a statistics file."""
    report = json.loads(report_path.read_text())
    report.pop("timings_seconds")
    report["output_model"].pop("path")
    report["data"].pop("statistics", None)
    return report


def header(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("header.json"))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def digits_stats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stats") / "digits.stats"
    result = run("collect", DIGITS, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    return out


def test_file_is_a_pickle_free_npz_with_a_valid_header(digits_stats: Path) -> None:
    jsonschema.validate(header(digits_stats), SCHEMA)
    with np.load(digits_stats, allow_pickle=False) as arrays:  # readable as a plain .npz
        keys = [k for k in arrays.files if k.endswith("keys")]
        assert keys and all(arrays[k].dtype == np.int64 for k in keys)
    found = header(digits_stats)
    data = np.load(ROOT / "sample_models" / "digits_cnn.calib.npz")
    assert found["data"]["samples"] == len(data["image"]) == 200
    assert found["model"]["sha256"] == __import__("hashlib").sha256(DIGITS.read_bytes()).hexdigest()


def test_collect_is_deterministic_and_order_invariant(digits_stats: Path, tmp_path: Path) -> None:
    data = np.load(ROOT / "sample_models" / "digits_cnn.calib.npz")["image"]
    shuffled = tmp_path / "shuffled.npz"
    np.savez(shuffled, image=data[np.random.default_rng(3).permutation(len(data))])
    again = tmp_path / "again.stats"
    assert run("collect", DIGITS, "--data", shuffled, "-o", again, "-q").exit_code == 0
    assert again.read_bytes() == digits_stats.read_bytes()


def test_fingerprint_is_the_sum_of_sample_digests() -> None:
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((1, 3)).astype(np.float32)} for _ in range(5)]
    whole, parts = Fingerprint(), [Fingerprint(), Fingerprint()]
    for i, sample in enumerate(samples):
        whole.add(sample)
        parts[i % 2].add(sample)
    parts[1].merge(parts[0])
    assert (parts[1].hex(), parts[1].samples) == (whole.hex(), 5)
    expected = sum(sample_digest(s) for s in samples) % (1 << 256)
    assert whole.total == expected
    twice = Fingerprint()
    twice.add(samples[0])
    twice.add(samples[0])
    assert twice.total != 0  # a repeated sample is counted, not cancelled as by XOR
    other = {"x": samples[0]["x"].astype(np.float64)}
    assert sample_digest(other) != sample_digest(samples[0])  # the dtype is part of a sample


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile", "mse"])
def test_calibrate_from_stats_is_byte_identical(
    digits_stats: Path, tmp_path: Path, method: str
) -> None:
    direct, reused = tmp_path / "a", tmp_path / "b"
    for folder, extra in ((direct, []), (reused, ["--stats", digits_stats])):
        folder.mkdir()
        result = run("calibrate", DIGITS, "--method", method, "-o", folder / "q.onnx",
                     "--report", folder / "q.json", "-q", *extra)
        assert result.exit_code == 0, result.output
    assert (direct / "q.onnx").read_bytes() == (reused / "q.onnx").read_bytes()
    assert comparable(direct / "q.json") == comparable(reused / "q.json")
    source = json.loads((reused / "q.json").read_text())["data"]["statistics"]
    assert source["samples"] == 200
    assert source["fingerprint"] == header(digits_stats)["data"]["fingerprint"]["value"]


def test_other_preset_with_the_same_observer_is_byte_identical(
    digits_stats: Path, tmp_path: Path
) -> None:
    """tensorflow observes min/max as pytorch does: its scheme works on the same file."""
    for name, extra in (("a", []), ("b", ["--stats", digits_stats])):
        result = run("calibrate", DIGITS, "--preset", "tensorflow", "-o", tmp_path / f"{name}.onnx",
                     "--report", tmp_path / f"{name}.json", "-q", *extra)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


@pytest.mark.parametrize(("args", "needle"), [
    (["--preset", "mindspore", "--method", "minmax"], "collect with --preset mindspore"),
    (["--method", "moving-average"], "collect with --method moving-average"),
    (["--op-types", "Conv,MatMul,Gemm,Add,Relu,MaxPool,Flatten,Reshape", "--placement", "all"],
     None),
])
def test_statistics_that_do_not_fit_are_refused(
    digits_stats: Path, tmp_path: Path, args: list[str], needle: str | None
) -> None:
    out = tmp_path / "q.onnx"
    result = run("calibrate", DIGITS, "--stats", digits_stats, "-o", out, "--report",
                 tmp_path / "q.json", "-q", *args)
    if needle is None and result.exit_code == 0:
        return  # the wider plan happened to observe no new tensor
    assert result.exit_code == StatisticsError.exit_code, result.output
    assert needle is None or needle in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_other_model_and_broken_files_exit_8(digits_stats: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    result = run("calibrate", TRANSFORMER, "--stats", digits_stats, "-o", out, "-q",
                 "--report", tmp_path / "q.json")
    assert result.exit_code == 8 and "another model" in result.output
    broken = tmp_path / "broken.stats"
    broken.write_bytes(digits_stats.read_bytes()[:300])
    text = tmp_path / "text.stats"
    text.write_text("hello")
    for bad in (broken, text):
        result = run("calibrate", DIGITS, "--stats", bad, "-o", out, "-q",
                     "--report", tmp_path / "q.json")
        assert result.exit_code == 8, result.output
        assert str(bad) in result.output and not out.exists()


def test_a_pickled_member_is_refused(digits_stats: Path, tmp_path: Path) -> None:
    """An object array (a pickle) inside the file is never loaded."""
    evil = tmp_path / "evil.stats"
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(digits_stats) as src, zipfile.ZipFile(evil, "w") as dst:
        for name in src.namelist():
            data = buffer.getvalue() if name.endswith("0.histogram.keys.npy") else src.read(name)
            dst.writestr(name, data)
    with pytest.raises(StatisticsError, match="evil.stats"):
        read_statistics(evil)


def test_statistics_that_saw_every_sample_hold_none_out(tmp_path: Path) -> None:
    """Without evaluation data a run holds out the last quarter of its samples for the floor;
    from statistics collected beforehand over all of them it cannot, and does not say so:
    it measures on the calibration samples, all 200."""
    model = tmp_path / "digits.onnx"  # no evaluation data beside it
    model.write_bytes(DIGITS.read_bytes())
    data = ROOT / "sample_models" / "digits_cnn.calib.npz"
    stats = tmp_path / "digits.stats"
    assert run("collect", model, "--data", data, "-o", stats, "-q").exit_code == 0
    reports = {}
    for name, extra in (("direct", []), ("reused", ["--stats", stats])):
        result = run("calibrate", model, "--data", data, "-o", tmp_path / f"{name}.onnx",
                     "--report", tmp_path / f"{name}.json", "-q", *extra)
        assert result.exit_code == 0, result.output
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert reports["direct"]["data"]["samples"] == 150
    assert "held out" in reports["direct"]["evaluation"]["data"]
    assert reports["reused"]["data"]["samples"] == 200
    assert reports["reused"]["evaluation"]["data"] == "calibration"
    assert reports["reused"]["evaluation"]["samples"] == 200
