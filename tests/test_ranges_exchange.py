"""Ranges for other tools: TensorRT's calibration cache and onnxruntime's TensorQuantOverrides
and calibration cache, written by `calibrate --write-ranges`, read back by `--ranges`, and fed to
onnxruntime's own `quantize_static`."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from qcal.calibration.statistics import format_ranges
from qcal.calibration.statistics._exchange import parse_ranges
from qcal.cli import main
from qcal.numerics.errors import StatisticsError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
CALIB = ROOT / "sample_models" / "digits_cnn.calib.npz"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ranges")
    result = run("calibrate", DIGITS, "-q", "--min-product-macs", "0", "-o", folder / "q.onnx",
                 "--report", folder / "q.json",
                 "--write-ranges", f"tensorrt={folder / 'trt.cache'}",
                 "--write-ranges", f"onnxruntime-overrides={folder / 'overrides.json'}",
                 "--write-ranges", f"onnxruntime-cache={folder / 'cache.json'}",
                 "--write-ranges", f"onnxruntime-table={folder / 'table'}")
    assert result.exit_code == 0, result.output
    return folder


def activation_ranges(report: Path) -> dict[str, tuple[float, float]]:
    tensors = json.loads(report.read_text())["tensors"]
    return {t["name"]: (t["range"]["min"][0], t["range"]["max"][0])
            for t in tensors if t["role"] == "activation"}


def test_tensorrt_cache_holds_amax_over_127_as_big_endian_hex(exported: Path) -> None:
    lines = (exported / "trt.cache").read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    ranges = activation_ranges(exported / "q.json")
    assert len(lines) == len(ranges) + 1
    for line in lines[1:]:
        name, value = line.split(": ")
        scale = struct.unpack(">f", bytes.fromhex(value))[0]
        lo, hi = ranges[name]
        assert scale == np.float32(max(abs(lo), abs(hi))) / np.float32(127)


@pytest.mark.parametrize("name", ["overrides.json", "cache.json", "table/calibration.json"])
def test_onnxruntime_files_round_trip_to_the_same_model(exported: Path, tmp_path: Path,
                                                        name: str) -> None:
    result = run("calibrate", DIGITS, "-q", "--min-product-macs", "0", "--ranges", exported / name,
                 "-o", tmp_path / "r.onnx", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.onnx").read_bytes() == (exported / "q.onnx").read_bytes()
    source = json.loads((tmp_path / "r.json").read_text())["data"]["statistics"]
    assert source["format"] == ("onnxruntime-overrides" if name == "overrides.json"
                                else "onnxruntime-cache")


def test_onnxruntime_table_is_written_by_onnxruntime(exported: Path, tmp_path: Path) -> None:
    """The folder holds write_calibration_table's three files; its text table reads back as the
    symmetric ranges TensorRT takes from it."""
    folder = exported / "table"
    assert sorted(p.name for p in folder.iterdir()) == [
        "calibration.cache", "calibration.flatbuffers", "calibration.json"]
    ranges = activation_ranges(exported / "q.json")
    lines = (folder / "calibration.cache").read_text().splitlines()
    assert {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines} == {
        name: max(lo, hi) for name, (lo, hi) in ranges.items()}
    kind, read = parse_ranges((folder / "calibration.cache").read_bytes(), "x")
    assert kind == "onnxruntime-text"
    assert read == {name: (-max(lo, hi), max(lo, hi)) for name, (lo, hi) in ranges.items()}
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    result = run("calibrate", DIGITS, "-q", "-o", tmp_path / "q.onnx", "--report",
                 tmp_path / "q.json", "--write-ranges", f"onnxruntime-table={not_a_folder}")
    assert result.exit_code == 6 and not (tmp_path / "q.onnx").exists()


def test_tensorrt_cache_round_trips(tmp_path: Path) -> None:
    """Read back as [-127 s, 127 s]: written again, the scales are the same bits."""
    first = run("calibrate", DIGITS, "-q", "--preset", "pytorch-symmetric", "-o", tmp_path / "q.onnx",
                "--report", tmp_path / "q.json", "--write-ranges", f"tensorrt={tmp_path / 'trt.cache'}")
    assert first.exit_code == 0, first.output
    result = run("calibrate", DIGITS, "-q", "--ranges", tmp_path / "trt.cache", "--preset",
                 "pytorch-symmetric", "-o", tmp_path / "r.onnx", "--report", tmp_path / "r.json",
                 "--write-ranges", f"tensorrt={tmp_path / 'again.cache'}")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "again.cache").read_bytes() == (tmp_path / "trt.cache").read_bytes()


def _reader(count: int) -> Any:
    from onnxruntime.quantization import CalibrationDataReader

    images = np.load(CALIB)["image"][:count]

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = iter([{"image": images[i : i + 1]} for i in range(count)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    return Reader()


def _ort_scale(lo: float, hi: float) -> tuple[np.float32, int]:
    """onnxruntime's uint8 asymmetric parameters of a range (computed here independently)."""
    rmin, rmax = min(lo, 0.0), max(hi, 0.0)
    scale = np.float32((rmax - rmin) / 255.0)
    return scale, round(-rmin / float(scale))


def _qdq_scales(model_path: Path) -> dict[str, tuple[float, int]]:
    model = onnx.load(model_path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            found[node.input[0]] = (float(inits[node.input[1]]), int(inits[node.input[2]]))
    return found


def test_onnxruntime_quantize_static_uses_the_overrides(exported: Path, tmp_path: Path) -> None:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    ranges = activation_ranges(exported / "q.json")
    # Ranges well away from what the data gives, so that using them cannot be a coincidence.
    widened = {name: (lo - 1.5, hi * 3.0 + 2.0) for name, (lo, hi) in ranges.items()}
    path = tmp_path / "overrides.json"
    path.write_bytes(format_ranges("onnxruntime-overrides", widened))
    # onnxruntime's override code takes .dtype of rmin/rmax: JSON floats become float32.
    overrides = {name: [{k: np.float32(v) for k, v in entry[0].items()}]
                 for name, entry in json.loads(path.read_text()).items()}
    out = tmp_path / "ort.onnx"
    quantize_static(str(DIGITS), str(out), _reader(8), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"TensorQuantOverrides": overrides})
    scales = _qdq_scales(out)
    # onnxruntime gives a MaxPool's output its input's parameters, whatever the overrides say
    tied = {t for n in onnx.load(DIGITS).graph.node if n.op_type == "MaxPool"
            for t in (*n.input, *n.output)}
    checked = 0
    for name, (lo, hi) in widened.items():
        if name not in scales or name in tied:
            continue  # onnxruntime leaves some tensors unquantized by its own rules
        scale, zero_point = _ort_scale(np.float32(lo), np.float32(hi))
        assert scales[name][0] == pytest.approx(float(scale), rel=1e-6)
        assert scales[name][1] == zero_point
        checked += 1
    assert checked >= 3


def test_onnxruntime_reads_the_cache(exported: Path) -> None:
    """onnxruntime's own reader of calibration caches gives back qcal's ranges, bit for bit."""
    from onnxruntime.quantization import CalibrationMethod

    calibrate = pytest.importorskip("onnxruntime.quantization.calibrate")
    if not hasattr(calibrate, "load_tensors_data"):
        pytest.skip("this onnxruntime has no JSON calibration cache (load_tensors_data)")
    load_tensors_data = calibrate.load_tensors_data

    loaded = load_tensors_data(exported / "cache.json")
    assert loaded.calibration_method == CalibrationMethod.MinMax
    ranges = activation_ranges(exported / "q.json")
    assert set(loaded.data) == set(ranges)
    for name, (lo, hi) in ranges.items():
        lowest, highest = loaded.data[name].range_value
        assert (lowest.dtype, float(lowest), float(highest)) == (np.float32, lo, hi)


@pytest.mark.parametrize(("text", "needle"), [
    ("TRT-8601-EntropyCalibration2\nx: zz\n", "line 2"),
    ('{"x": [{"scale": 0.1, "zero_point": 0}]}', "not ranges"),
    ('{"x": [{"rmin": 1.0, "rmax": 0.0}]}', "not a finite range"),
    ('{"x": [{"rmin": 0.0, "rmax": 1e40}]}', "float32"),
    ("x notanumber\n", "line 1"),
    ("{}", "no tensor ranges"),
])
def test_malformed_ranges_are_refused(text: str, needle: str) -> None:
    with pytest.raises(StatisticsError, match=needle):
        parse_ranges(text.encode(), "f")


def test_ranges_and_other_methods_or_missing_tensors_exit_8(exported: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.onnx"
    result = run("calibrate", DIGITS, "-q", "--ranges", exported / "trt.cache", "--method",
                 "entropy", "-o", out, "--report", tmp_path / "r.json")
    assert result.exit_code == 8 and "--method entropy" in result.output
    partial = tmp_path / "partial.cache"
    partial.write_text("\n".join((exported / "trt.cache").read_text().splitlines()[:3]) + "\n")
    result = run("calibrate", DIGITS, "-q", "--ranges", partial, "-o", out, "--report",
                 tmp_path / "r.json")
    assert result.exit_code == 8 and "--exclude-tensors" in result.output and not out.exists()
