"""Merging statistics: random data split into random shards, collected with random batch sizes
and merged in random order, give the bytes of one collection over all the data, and the QDQ
model of the direct run. ``QCAL_MERGE_EXAMPLES=200 pytest tests/test_statistics_merge.py`` draws
more examples than the default."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import residual_classifier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qcal._collection import collect_statistics
from qcal.calibration.statistics import Statistics, merge_statistics
from qcal.config import CalibrationConfig
from qcal.numerics.errors import StatisticsError
from qcal.pipeline import calibrate

EXAMPLES = int(os.environ.get("QCAL_MERGE_EXAMPLES", "40"))
METHODS = ("minmax", "percentile", "entropy", "mse")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A conv net with a residual Add and a classifier, batch dimension free."""
    model = residual_classifier(np.random.default_rng(5), in_channels=2, channels=6, classes=4,
                                side=6, second_scale=0.2)
    path = tmp_path_factory.mktemp("merge") / "m.onnx"
    onnx.save(model, path)
    return path


@st.composite
def splits(draw: st.DrawFn) -> tuple[np.ndarray, list[list[int]], list[int], str]:
    """(samples, shards as lists of sample indices in their collection order, batch sizes, method)."""
    count = draw(st.integers(2, 24))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    data = (rng.standard_normal((count, 2, 6, 6)) * scale).astype(np.float32)
    if draw(st.booleans()):
        data[rng.integers(count)] = data[0]  # a repeated sample
    shards = draw(st.integers(1, min(4, count)))
    owner = rng.permutation(np.arange(count) % shards)  # every shard gets at least one sample
    parts = [list(rng.permutation(np.flatnonzero(owner == k))) for k in range(shards)]
    order = draw(st.permutations(range(shards)))
    batches = [draw(st.integers(1, 5)) for _ in range(shards + 1)]
    return data, [parts[k] for k in order], batches, draw(st.sampled_from(METHODS))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=splits())
def test_merged_shards_equal_one_collection(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory,
    case: tuple[np.ndarray, list[list[int]], list[int], str],
) -> None:
    data, shards, batches, method = case
    folder = tmp_path_factory.mktemp("case")
    whole = folder / "all.npz"
    np.savez(whole, x=data)
    config = CalibrationConfig(data=whole, method=method, batch_size=batches[-1])
    single = collect_statistics(model_path, config, output=folder / "all.stats")
    parts: list[tuple[str, Statistics]] = []
    for k, indices in enumerate(shards):
        path = folder / f"shard{k}.npz"
        np.savez(path, x=data[indices])
        # Min/max and histograms do not see the batching: each shard is batched its own way.
        shard_config = CalibrationConfig(data=path, method=method, batch_size=batches[k])
        parts.append((str(path), collect_statistics(model_path, shard_config)))
    merged = merge_statistics(parts)
    assert merged.to_bytes() == (folder / "all.stats").read_bytes()
    assert merged.fingerprint.hex() == single.fingerprint.hex()
    merged_path = folder / "merged.stats"
    merged_path.write_bytes(merged.to_bytes())
    run = CalibrationConfig(data=whole, method=method, batch_size=batches[-1], fallback=False)
    direct = calibrate(model_path, run)
    reused = calibrate(model_path, run, statistics=merged_path)
    assert direct.model.SerializeToString() == reused.model.SerializeToString()


def test_shards_batched_differently_merge_to_the_same_bytes(
    model_path: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((10, 2, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "a.npz", x=data[:4])
    np.savez(tmp_path / "b.npz", x=data[4:])
    np.savez(tmp_path / "all.npz", x=data)
    whole = collect_statistics(model_path, CalibrationConfig(data=tmp_path / "all.npz"))
    parts = [(name, collect_statistics(model_path, CalibrationConfig(data=tmp_path / name)))
             for name in ("b.npz", "a.npz")]
    assert merge_statistics(parts).to_bytes() == whole.to_bytes()


def test_moving_averages_and_mismatches_are_refused(model_path: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    for name in ("a", "b"):
        np.savez(tmp_path / f"{name}.npz", x=rng.standard_normal((3, 2, 6, 6)).astype(np.float32))
    average = CalibrationConfig(method="moving-average", data=tmp_path / "a.npz")
    parts = [(n, collect_statistics(model_path, CalibrationConfig(
        method="moving-average", data=tmp_path / f"{n}.npz"))) for n in ("a", "b")]
    assert average.method == "moving-average"
    with pytest.raises(StatisticsError, match="depend on the order of the batches"):
        merge_statistics(parts)
    minmax = collect_statistics(model_path, CalibrationConfig(data=tmp_path / "a.npz"))
    other = collect_statistics(model_path, CalibrationConfig(data=tmp_path / "b.npz",
                                                             preset="mindspore"))
    with pytest.raises(StatisticsError, match="different options"):
        merge_statistics([("a", minmax), ("b", other)])
    no_histograms = collect_statistics(model_path, CalibrationConfig(data=tmp_path / "b.npz"),
                                       histograms=False)
    with pytest.raises(StatisticsError, match="histograms"):
        merge_statistics([("a", minmax), ("b", no_histograms)])


def test_merge_command(model_path: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from qcal.cli import main

    def run(*args: object) -> object:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    rng = np.random.default_rng(4)
    data = rng.standard_normal((9, 2, 6, 6)).astype(np.float32)
    for name, rows in (("a", data[:5]), ("b", data[5:]), ("all", data)):
        np.savez(tmp_path / f"{name}.npz", x=rows)
        result = run("collect", model_path, "--data", tmp_path / f"{name}.npz", "-o",
                     tmp_path / f"{name}.stats", "-q")
        assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    merged = tmp_path / "merged.stats"
    result = run("merge", tmp_path / "b.stats", tmp_path / "a.stats", "-o", merged)
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert "9 samples" in result.output  # type: ignore[attr-defined]
    assert merged.read_bytes() == (tmp_path / "all.stats").read_bytes()
    again = run("merge", tmp_path / "a.stats", tmp_path / "b.stats", "-o", merged)
    assert again.exit_code == 6  # type: ignore[attr-defined]  (exists, no --force)
    # Shards of equal samples are legitimate (a data set may repeat a sample): no refusal, and
    # the count says what was merged.
    twice = run("merge", tmp_path / "a.stats", tmp_path / "a.stats", "-o", tmp_path / "x.stats")
    assert twice.exit_code == 0 and "10 samples" in twice.output  # type: ignore[attr-defined]
    over_input = run("merge", tmp_path / "a.stats", tmp_path / "b.stats", "-o",
                     tmp_path / "a.stats", "--force")
    assert over_input.exit_code == 6  # type: ignore[attr-defined]
