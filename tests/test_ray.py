"""Collection on Ray (the qcal[ray] extra): shards across 2 local workers give the bytes of one
process, a worker lost mid-shard is replaced, Ctrl-C leaves nothing; without Ray, a clear
error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import helper

from qcal._collection import collect_statistics
from qcal.cli import main
from qcal.config import CalibrationConfig
from qcal.numerics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    result = run("collect", DIGITS, "--ray", "-o", tmp_path / "s.stats")
    assert result.exit_code == ConfigError.exit_code
    assert "pip install 'qcal[ray]'" in result.output
    assert not (tmp_path / "s.stats").exists()


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local Ray of 2 workers for the module; its first shard task kills its worker once."""
    ray = pytest.importorskip("ray", reason="the qcal[ray] extra is not installed")
    marker = tmp_path_factory.mktemp("ray") / "crashed"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"QCAL_RAY_CRASH_ONCE": str(marker)}})
    yield marker
    ray.shutdown()


def test_two_workers_give_the_bytes_of_one_process(local_ray: Path, tmp_path: Path) -> None:
    single, sharded = tmp_path / "single.stats", tmp_path / "ray.stats"
    collect_statistics(DIGITS, CalibrationConfig(), output=single)
    result = run("collect", DIGITS, "--ray", "--workers", "2", "-o", sharded, "-q")
    assert result.exit_code == 0, result.output
    assert sharded.read_bytes() == single.read_bytes()
    assert local_ray.exists()  # a worker died on its first shard, which ran again elsewhere


def test_calibrate_on_ray_is_the_direct_run(local_ray: Path, tmp_path: Path) -> None:
    for name, extra in (("a", []), ("b", ["--ray", "--workers", "2"])):
        result = run("calibrate", DIGITS, "--method", "percentile", "-q",
                     "-o", tmp_path / f"{name}.onnx", "--report", tmp_path / f"{name}.json", *extra)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    reports = [json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab"]
    for report in reports:
        report.pop("timings_seconds")
        report["output_model"].pop("path")
    assert reports[0] == reports[1]


def test_moving_averages_are_not_sharded(local_ray: Path, tmp_path: Path) -> None:
    result = run("collect", DIGITS, "--ray", "--method", "moving-average", "-o",
                 tmp_path / "s.stats")
    assert result.exit_code == ConfigError.exit_code
    assert "order of the batches" in result.output


def test_bad_data_in_a_shard_is_the_data_error_of_one_process(
    local_ray: Path, tmp_path: Path
) -> None:
    data = np.load(ROOT / "sample_models" / "digits_cnn.calib.npz")["image"].copy()
    data[150, 0, 3, 3] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, image=data)
    result = run("collect", DIGITS, "--ray", "--data", path, "-o", tmp_path / "s.stats", "-q")
    assert result.exit_code == 5, result.output
    assert "NaN" in result.output and not (tmp_path / "s.stats").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_the_workers_and_writes_nothing(
        tmp_path: Path, signum: int, code: int) -> None:
    # Ray's core takes SIGTERM for itself (it exited 1 mid-run): qcal's handler is put back.
    pytest.importorskip("ray", reason="the qcal[ray] extra is not installed")
    rng = np.random.default_rng(0)
    nodes, inits, last = [], {}, "x"
    for i in range(8):
        inits[f"W{i}"] = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [last, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
        last = f"m{i}"
    onnx.save(build_model(nodes, [float_input("x", ["N", 64, 256])], [last], inits),
              tmp_path / "slow.onnx")
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((2000, 64, 256)).astype(np.float32))
    out = tmp_path / "out.stats"
    process = subprocess.Popen(
        [sys.executable, "-m", "qcal.cli", "collect", str(tmp_path / "slow.onnx"), "--ray",
         "--workers", "2", "--data", str(tmp_path / "data.npz"), "--no-histograms", "-o",
         str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not _shards_running() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()[1].decode()
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code, err.decode()
    assert f"interrupted by {signal.Signals(signum).name}" in err.decode()
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    time.sleep(2)
    assert not _shards_running()  # the local Ray went with the run


def _shards_running() -> bool:
    """Whether a Ray worker process is running a shard (Ray names it after the task)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"ray::_collect_shard" in cmdline.read_bytes():
                return True
        except OSError:
            continue  # the process ended while looking
    return False
