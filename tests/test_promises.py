"""Bad input meets a clear error with its documented exit code and no output, never an internal
error; the library never prints. Cases a new user ran into."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.cli import main

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def _qcal(*args: str | Path, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


def _digits(folder: Path) -> Path:
    for path in SAMPLES.glob("digits_cnn*"):
        shutil.copy(path, folder / path.name)
    return folder / "digits_cnn.onnx"


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_folder_the_output_cannot_be_written_in_is_found_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root the access bits say yes where a write fails (a read-only or virtual mount)."""
    from qcal.graph.files import atomic

    model = _digits(tmp_path)
    real = atomic.tempfile.mkstemp

    def refused(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs.get("dir", "")).name == "locked":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*args, **kwargs)

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refused)
    (tmp_path / "locked").mkdir()
    for option in ("-o", "--report", "--summary-md"):
        outputs = {"-o": tmp_path / "q.onnx", "--report": tmp_path / "q.json"}
        outputs[option] = tmp_path / "locked" / "out"
        result = _qcal("calibrate", model, *(x for pair in outputs.items() for x in pair), "-q")
        assert result.exit_code == 6, result.output
        assert "cannot write in directory" in result.output and "locked" in result.output
    assert not list((tmp_path / "locked").iterdir())
    # the CI job page, appended to at the end: found unwritable at the start
    result = _qcal("calibrate", model, "-o", tmp_path / "q.onnx", "--report", tmp_path / "r.json",
                   "-q", env={"GITHUB_STEP_SUMMARY": str(tmp_path / "missing" / "page.md")})
    assert result.exit_code == 6 and "GITHUB_STEP_SUMMARY" in result.output
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "r.json").exists()


def test_labels_given_as_an_npz_archive_are_bad_data(tmp_path: Path) -> None:
    model = _digits(tmp_path)
    result = _qcal("calibrate", model, "--labels", tmp_path / "digits_cnn.eval.npz", "-o",
                   tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q")
    assert result.exit_code == 5 and "not an .npz archive" in result.output


def test_a_model_without_outputs_is_a_bad_model(tmp_path: Path) -> None:
    graph = helper.make_graph([], "empty", [], [])
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                 tmp_path / "empty.onnx")
    result = _qcal("calibrate", path, "--synthetic", "4", "-o", tmp_path / "q.onnx",
                   "--report", tmp_path / "q.json", "-q")
    assert result.exit_code == 4 and "declares no outputs" in result.output


def _symbolic_matmul(tmp_path: Path) -> Path:
    """x: [A, B], every dimension symbolic; only the weight says B is 4."""
    weight = numpy_helper.from_array(np.ones((4, 8), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["A", "B"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["A", 8])], [weight])
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                 tmp_path / "m.onnx")


def test_evaluation_data_onnxruntime_cannot_run_is_bad_data(tmp_path: Path) -> None:
    model = _symbolic_matmul(tmp_path)
    np.savez(tmp_path / "ok.npz", x=np.ones((4, 3, 4), np.float32))
    np.savez(tmp_path / "bad.npz", x=np.ones((4, 3, 5), np.float32))
    for args in (("compare", model, model, "--data", tmp_path / "bad.npz"),
                 ("calibrate", model, "--data", tmp_path / "ok.npz", "--eval-data",
                  tmp_path / "bad.npz", "-o", tmp_path / "q.onnx", "--report",
                  tmp_path / "q.json", "-q")):
        result = _qcal(*args)
        assert result.exit_code == 5, result.output
        assert "onnxruntime failed on evaluation sample 0" in result.output
    assert not (tmp_path / "q.onnx").exists()


def test_a_bias_holding_nan_is_the_models_fault(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    bias = np.zeros(8, np.float32)
    bias[2] = np.nan
    inits = [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "W"),
             numpy_helper.from_array(bias, "B")]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["y"], name="gemm", transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], inits)
    model = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                  tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 16)).astype(np.float32))
    result = _qcal("calibrate", "--min-product-macs", "0", model, "--data", tmp_path / "d.npz", "-o", tmp_path / "q.onnx",
                   "--report", tmp_path / "q.json", "-q")
    assert result.exit_code == 4 and "bias 'B'" in result.output
    assert not (tmp_path / "q.onnx").exists()


def test_synthetic_data_for_a_huge_declared_shape_is_refused(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2**40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2**40])])
    model = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                  tmp_path / "m.onnx")
    result = _qcal("calibrate", model, "--synthetic", "2", "-o", tmp_path / "q.onnx",
                   "--report", tmp_path / "q.json", "-q")
    assert result.exit_code == 5 and "input 'x'" in result.output


def test_the_library_never_prints(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Its log records (a Fortran-order .npy read whole) go to no last-resort handler."""
    from qcal import CalibrationConfig
    from qcal.pipeline import calibrate

    model = _digits(tmp_path)
    images = np.load(tmp_path / "digits_cnn.calib.npz")["image"][:8]
    np.save(tmp_path / "images.npy", np.asfortranarray(images))
    root = logging.getLogger()
    before = list(root.handlers)
    for handler in before:  # as a bare script has it: no handler anywhere
        root.removeHandler(handler)
    try:
        calibrate(model, CalibrationConfig(data=tmp_path / "images.npy", allow_slower=True))
    finally:
        for handler in before:
            root.addHandler(handler)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_preset_grid_too_narrow_for_a_tensor_is_a_configuration_error(tmp_path: Path) -> None:
    """TensorFlow's 1-bit grid (valid by its own rules) gives some tensor an infinite scale:
    a clear exit 3 naming preset and tensor, where the report could not be written (exit 1)."""
    model = _digits(tmp_path)
    result = _qcal("calibrate", model, "--preset", "tensorflow", "--preset-option", "num_bits=1",
                   "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q")
    assert result.exit_code == 3, result.output
    assert "preset 'tensorflow'" in result.output and "is not finite" in result.output
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "q.json").exists()


def test_opset_21_enables_16_bit_activations(tmp_path: Path) -> None:
    """The README's `--opset 21` for int16: it was refused ("needs opset 21, got 13") by a
    check of the preset's parameters made at the default opset."""
    model = _digits(tmp_path)
    args = ["calibrate", model, "--preset", "horizon", "--preset-option", "dtype=qint16",
            "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q", "--force"]
    result = _qcal(*args)
    assert result.exit_code == 3 and "needs opset 21" in result.output
    result = _qcal(*args, "--opset", "21")
    assert result.exit_code == 0, result.output
    codes = {t.data_type for t in onnx.load(tmp_path / "q.onnx").graph.initializer
             if t.name.endswith("_zero_point")}
    assert TensorProto.INT16 in codes


def test_signed_activations_at_opset_21_keep_bias_correction(tmp_path: Path) -> None:
    """TensorFlow's int8 activations at `--opset 21`: onnxruntime's QDQ rewrites of the graph
    that sums the layers' codes (bias correction) made a QuantizeLinear of mismatched types,
    and qcal exited 4 blaming the user's model."""
    model = _digits(tmp_path)
    result = _qcal("calibrate", model, "--preset", "tensorflow", "--opset", "21",
                   "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q",
                   "--no-fallback", "--allow-slower")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["config"]["bias_correction"] is True
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    sample = np.load(tmp_path / "digits_cnn.eval.npz")
    name = session.get_inputs()[0].name
    assert np.isfinite(session.run(None, {name: sample[name][:1]})[0]).all()


def test_an_int4_read_onnxruntime_refuses_keeps_its_node_float(tmp_path: Path) -> None:
    """4-bit activations at `--opset 21`: onnxruntime refuses the MaxPool it would run on int4
    codes ("... in node (pool) is invalid"). What it reads is kept float and said so; it exited
    4 blaming the model, since the message's lower-case "node (...)" went unread."""
    model = _digits(tmp_path)
    result = _qcal("calibrate", model, "--preset", "tensorflow", "--preset-option",
                   "num_bits=4", "--opset", "21", "-o", tmp_path / "q.onnx",
                   "--report", tmp_path / "q.json", "-q", "--no-fallback", "--allow-slower")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q.json").read_text())
    repaired = [n for n in report["nodes"] if "onnxruntime cannot run it quantized" in n["reason"]]
    assert repaired and not any(n["quantized"] for n in repaired)
    ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])


def test_calibration_data_onnxruntime_cannot_run_is_named(tmp_path: Path) -> None:
    """Data that fits every declared (symbolic) dimension but not the weights: the error names
    the file, or says synthetic data set the free dimensions to 1."""
    model = _symbolic_matmul(tmp_path)
    np.savez(tmp_path / "bad.npz", x=np.ones((4, 3, 5), np.float32))
    outputs = ["-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q"]
    result = _qcal("calibrate", model, "--data", tmp_path / "bad.npz", *outputs)
    assert result.exit_code == 5 and "bad.npz: onnxruntime failed on calibration" in result.output
    result = _qcal("calibrate", model, "--synthetic", "4", *outputs)
    assert result.exit_code == 5 and "synthetic data (every free dimension 1" in result.output


def test_an_onnxruntime_table_folder_is_written_again_with_force(tmp_path: Path) -> None:
    """The README's folder (created if missing): an existing one, empty or written by the run
    before, was refused as "is a directory" even with --force."""
    model = _digits(tmp_path)
    (tmp_path / "tbl").mkdir()
    args = ["calibrate", model, "--write-ranges", f"onnxruntime-table={tmp_path / 'tbl'}", "-o",
            tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q"]
    assert _qcal(*args).exit_code == 0
    assert (tmp_path / "tbl" / "calibration.json").is_file()
    again = _qcal(*args)
    assert again.exit_code == 6 and "already exists" in again.output
    assert _qcal(*args, "--force").exit_code == 0
