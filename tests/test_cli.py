"""The `qcal` command as a user meets it: real sample models, real files, exit codes."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from qcal.cli import main
from qcal.graph.placement import SMALL_PRODUCT
from qcal.numerics import errors

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
DIGITS = SAMPLES / "digits_cnn.onnx"
TRANSFORMER = SAMPLES / "transformer_block.onnx"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def without_timings(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "timings_seconds"}


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    out = tmp_path_factory.mktemp("digits")
    model, report = out / "q.onnx", out / "q.json"
    result = run("calibrate", DIGITS, "-o", model, "--report", report)
    return model, report, result


def test_default_calibration_of_the_digits_cnn(digits_run: tuple[Path, Path, Any]) -> None:
    model_path, report_path, result = digits_run
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(onnx.load(model_path), full_check=True)
    report = json.loads(report_path.read_text())
    ev = report["evaluation"]
    assert ev["data"].endswith("digits_cnn.eval.npz") and ev["labels"].endswith("labels.npy")
    logits = ev["outputs"][0]
    # The README promises a drop of under one point on the held-out digits.
    assert logits["float_accuracy"] - logits["quantized_accuracy"] < 0.01
    assert logits["float_accuracy"] > 0.95
    # Recompute the quantized accuracy independently with onnxruntime.
    eval_data = np.load(SAMPLES / "digits_cnn.eval.npz")
    labels = np.load(SAMPLES / "digits_cnn.eval.labels.npy")
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    predicted = session.run(None, {"image": eval_data["image"]})[0].argmax(axis=1)
    assert np.mean(predicted == labels) == pytest.approx(logits["quantized_accuracy"], abs=1e-6)
    assert "quantized" in result.output and str(model_path) in result.output


def test_the_qdq_model_is_quantized_where_the_rules_say(digits_run: tuple[Path, Path, Any]) -> None:
    model = onnx.load(digits_run[0])
    ops = [n.op_type for n in model.graph.node]
    conv_like = sum(op in ("Conv", "Gemm") for op in ops)
    assert conv_like > 0
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    # The stem Conv reads the image's one channel: placement "auto" keeps it float (its
    # integer kernel is the slower), its weight a float initializer.
    stem = next(n for n in model.graph.node if n.op_type == "Conv")
    assert stem.input[0] == model.graph.input[0].name and inits[stem.input[1]].dims[1] == 1
    assert inits[stem.input[1]].data_type == onnx.TensorProto.FLOAT
    # The dense head (64 -> 64 -> 10: 4096 and 640 multiply-adds per digit) is under the size a
    # MatMul/Gemm must have for its integer kernel to pay: float too, saying why.
    reasons = {n["name"]: n["reason"] for n in json.loads(digits_run[1].read_text())["nodes"]}
    dense = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(dense) == 2
    for node in dense:
        assert inits[node.input[1]].data_type == onnx.TensorProto.FLOAT
        assert reasons[node.name].startswith(SMALL_PRODUCT)
    # every other Conv reads its weight through a DequantizeLinear of an integer initializer
    for node in model.graph.node:
        if node.op_type == "Conv" and node.name != stem.name:
            dq = producers[node.input[1]]
            assert dq.op_type == "DequantizeLinear"
            assert inits[dq.input[0]].data_type == onnx.TensorProto.INT8


def test_rerun_is_byte_identical(tmp_path: Path, digits_run: tuple[Path, Path, Any]) -> None:
    model, report = tmp_path / "again.onnx", tmp_path / "again.json"
    assert run("calibrate", DIGITS, "-o", model, "--report", report, "-q").exit_code == 0
    assert model.read_bytes() == digits_run[0].read_bytes()
    first = json.loads(digits_run[1].read_text())
    second = json.loads(report.read_text())
    first["output_model"]["path"] = second["output_model"]["path"]
    assert without_timings(first) == without_timings(second)


def test_report_validates_against_the_shipped_schema(digits_run: tuple[Path, Path, Any]) -> None:
    import jsonschema

    from qcal.report import report_schema

    jsonschema.validate(json.loads(digits_run[1].read_text()), report_schema())


def test_default_output_paths_are_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("calibrate", "--min-product-macs", "0", TRANSFORMER, "--method", "minmax")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "transformer_block.qdq.onnx").is_file()
    assert (tmp_path / "transformer_block.qcal.json").is_file()
    assert not (SAMPLES / "transformer_block.qdq.onnx").exists()


@pytest.mark.parametrize(("output", "report"), [("out/m.int8.onnx", "out/m.int8.qcal.json"),
                                                ("out/m.qdq.onnx", "out/m.qcal.json")])
def test_the_report_goes_beside_the_model_output_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, report: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    result = run("calibrate", "--min-product-macs", "0", TRANSFORMER, "--method", "minmax",
                 "-o", output)
    assert result.exit_code == 0, result.output
    assert (tmp_path / output).is_file() and (tmp_path / report).is_file()
    assert json.loads((tmp_path / report).read_text())["output_model"]["path"].endswith(output)
    assert not (tmp_path / "transformer_block.qcal.json").exists()
    # a second model of the same input, written elsewhere, gets a report of its own
    again = run("calibrate", "--min-product-macs", "0", TRANSFORMER, "--method", "minmax",
                "-o", "other.onnx")
    assert again.exit_code == 0, again.output
    assert (tmp_path / "other.qcal.json").is_file()


def _npz_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "samples"
    folder.mkdir()
    images = np.load(SAMPLES / "digits_cnn.calib.npz")["image"][:12]
    for i, image in enumerate(images):
        np.savez(folder / f"{i:03d}.npz", image=image[None])
    return folder


def _zoo_dir(tmp_path: Path) -> Path:
    images = np.load(SAMPLES / "digits_cnn.calib.npz")["image"][:5]
    for k, image in enumerate(images):
        folder = tmp_path / "zoo" / f"test_data_set_{k}"
        folder.mkdir(parents=True)
        tensor = onnx.numpy_helper.from_array(image[None], name="image")
        (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    return tmp_path / "zoo"


@pytest.mark.parametrize("layout", ["npz", "npz-dir", "onnx-test-data"])
def test_every_data_format(tmp_path: Path, layout: str) -> None:
    data = {"npz": lambda: SAMPLES / "digits_cnn.calib.npz", "npz-dir": lambda: _npz_dir(tmp_path),
            "onnx-test-data": lambda: _zoo_dir(tmp_path)}[layout]()
    report = tmp_path / "r.json"
    result = run("calibrate", DIGITS, "--data", data, "-o", tmp_path / "q.onnx", "--report", report, "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["data"]["kind"] == layout


def test_synthetic_data_is_announced_loudly(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = run("calibrate", DIGITS, "--synthetic", "8", "-o", tmp_path / "q.onnx", "--report", report)
    assert result.exit_code == 0, result.output
    assert "SYNTHETIC" in result.output
    content = json.loads(report.read_text())
    assert content["data"]["synthetic"] is True
    assert any("SYNTHETIC" in w for w in content["warnings"])


def test_batch_size_does_not_change_a_minmax_result(tmp_path: Path) -> None:
    outs = []
    for batch in ("1", "7"):
        out = tmp_path / f"b{batch}.onnx"
        result = run("calibrate", DIGITS, "--batch-size", batch, "-o", out, "--report",
                     tmp_path / f"b{batch}.json", "-q")
        assert result.exit_code == 0, result.output
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_config_file_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "qcal.toml"
    config.write_text('batch-size = 4\nlimit = 16\nexclude-op-types = ["Gemm"]\n')
    report = tmp_path / "r.json"
    result = run("calibrate", DIGITS, "--config", config, "--limit", "8", "-o", tmp_path / "q.onnx",
                 "--report", report, "-q")
    assert result.exit_code == 0, result.output
    content = json.loads(report.read_text())
    assert content["config"]["limit"] == 8  # the flag wins
    assert content["config"]["batch_size"] == 4  # the file fills the rest
    assert content["data"]["samples"] == 8
    gemms = [n for n in content["nodes"] if n["op_type"] == "Gemm"]
    assert gemms and not any(n["quantized"] for n in gemms)


# ---------------------------------------------------------------------------------------------
# Errors: one line naming the culprit, the documented exit code, no output left behind.

def _assert_error(result: Any, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    message = result.stderr if hasattr(result, "stderr") else result.output
    assert "Traceback" not in message
    for needle in needles:
        assert needle in message, message


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("make_model", "needle"),
    [
        (lambda d: d / "missing.onnx", "missing.onnx"),
        (lambda d: _write(d / "empty.onnx", b""), "empty.onnx"),
        (lambda d: _write(d / "junk.onnx", b"not a model at all"), "junk.onnx"),
        (lambda d: _write(d / "cut.onnx", DIGITS.read_bytes()[:5000]), "cut.onnx"),
    ],
)
def test_bad_models(tmp_path: Path, make_model: Any, needle: str) -> None:
    model = make_model(tmp_path)
    out = tmp_path / "q.onnx"
    result = run("calibrate", model, "--synthetic", "2", "-o", out, "--report", tmp_path / "r.json")
    _assert_error(result, errors.ModelError.exit_code, needle)
    assert not out.exists() and not (tmp_path / "r.json").exists()


def test_error_cases(tmp_path: Path) -> None:
    out, rep = tmp_path / "q.onnx", tmp_path / "r.json"
    common = ["-o", out, "--report", rep]
    _assert_error(run("calibrate", DIGITS, "--preset", "nope", *common), errors.ConfigError.exit_code, "nope")
    _assert_error(run("calibrate", DIGITS, "--preset-option", "bogus_knob=1", *common),
                  errors.ConfigError.exit_code, "bogus_knob")
    _assert_error(run("calibrate", DIGITS, "--limit", "0", *common), errors.ConfigError.exit_code, "limit")
    _assert_error(run("calibrate", DIGITS, "--data", tmp_path / "none.npz", *common),
                  errors.DataError.exit_code, "none.npz")
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, pixels=np.zeros((2, 1, 8, 8), np.float32))
    _assert_error(run("calibrate", DIGITS, "--data", wrong, *common), errors.DataError.exit_code, "image")
    bad_cfg = tmp_path / "c.toml"
    bad_cfg.write_text("frobnicate = 1\n")
    _assert_error(run("calibrate", DIGITS, "--config", bad_cfg, *common), errors.ConfigError.exit_code,
                  "frobnicate")
    _assert_error(run("calibrate", DIGITS, "--bogus-flag"), 2)
    assert not out.exists() and not rep.exists()


def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path: Path) -> None:
    """--debug adds the traceback; a bad input still exits with its own code (5 for data), not
    1, which the README keeps for bugs."""
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, pixels=np.zeros((2, 1, 8, 8), np.float32))
    result = run("calibrate", DIGITS, "--data", wrong, "-o", tmp_path / "q.onnx", "--debug")
    assert result.exit_code == errors.DataError.exit_code, result.output
    assert "Traceback (most recent call last)" in result.stderr
    assert "error (" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "q.onnx").exists()


def test_output_errors(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    shutil.copy(DIGITS, model)
    shutil.copy(SAMPLES / "digits_cnn.calib.npz", tmp_path / "m.calib.npz")
    code = errors.OutputError.exit_code
    _assert_error(run("calibrate", model, "-o", model, "--report", tmp_path / "r.json"), code, "m.onnx")
    _assert_error(run("calibrate", model, "-o", tmp_path / "no" / "q.onnx"), code, "does not exist")
    existing = tmp_path / "exists.onnx"
    existing.write_bytes(b"keep me")
    _assert_error(run("calibrate", model, "-o", existing, "--report", tmp_path / "r.json"), code, "--force")
    assert existing.read_bytes() == b"keep me" and not (tmp_path / "r.json").exists()
    if os.geteuid() != 0:  # root ignores directory permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        _assert_error(run("calibrate", model, "-o", ro / "q.onnx"), code, "not writable")



def test_an_output_that_cannot_be_written_fails_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A large model takes seconds and gigabytes to load: a typo in -o costs neither.
    import qcal._collection
    import qcal.pipeline

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qcal.pipeline, "load_model", never)
    monkeypatch.setattr(qcal._collection, "load_model", never)
    for command in ("calibrate", "collect"):
        result = CliRunner().invoke(main, [command, str(DIGITS), "-o", str(tmp_path / "no" / "q.onnx")])
        assert result.exit_code == errors.OutputError.exit_code, (command, result.output)
        assert "does not exist" in result.output
    existing = tmp_path / "q.qcal.json"
    existing.write_text("keep me")
    result = CliRunner().invoke(main, ["calibrate", str(DIGITS), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == errors.OutputError.exit_code, result.output
    assert "--force" in result.output and existing.read_text() == "keep me"

def test_a_failing_stage_leaves_no_partial_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qcal.pipeline

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise errors.DataError("evaluation exploded")

    monkeypatch.setattr(qcal.pipeline, "compare_models", broken)
    out, rep = tmp_path / "q.onnx", tmp_path / "r.json"
    _assert_error(run("calibrate", DIGITS, "-o", out, "--report", rep), errors.DataError.exit_code, "exploded")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_signal_stops_the_run_and_leaves_nothing(tmp_path: Path, signum: int, code: int) -> None:
    """Ctrl-C, and SIGTERM/SIGHUP as CI systems and closing terminals send them."""
    out, rep = tmp_path / "q.onnx", tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcal.cli", "calibrate", str(DIGITS), "--synthetic", "200000",
         "-o", str(out), "--report", str(rep), "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    )
    _wait_until_calibrating(proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err.decode()
    assert signal.Signals(signum).name in err.decode()
    assert list(tmp_path.iterdir()) == []


def _wait_until_calibrating(proc: subprocess.Popen[bytes], cpu_seconds: float = 3.0) -> None:
    """Until the process has spent `cpu_seconds` of CPU (imports done, data streaming)."""
    ticks = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if (int(fields[11]) + int(fields[12])) / ticks >= cpu_seconds:
            return
        time.sleep(0.1)


def test_readme_lists_every_exit_code() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Exit codes"):]
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)}
    codes = {errors.EXIT_OK, errors.EXIT_INTERNAL, errors.EXIT_USAGE}
    codes |= {cls.exit_code for cls in vars(errors).values()
              if isinstance(cls, type) and issubclass(cls, errors.QcalError)}
    assert codes <= listed, f"missing from README: {sorted(codes - listed)}"


def test_inspect(tmp_path: Path) -> None:
    result = run("inspect", DIGITS)
    assert result.exit_code == 0, result.output
    assert "image" in result.output and "Conv" in result.output
    as_json = json.loads(run("inspect", DIGITS, "--json").output)
    assert as_json["inputs"][0]["name"] == "image"
    assert any(n["quantized"] for n in as_json["nodes"])
    _assert_error(run("inspect", tmp_path / "nothing.onnx"), errors.ModelError.exit_code, "nothing.onnx")


def test_presets_lists_every_preset() -> None:
    from qcal.numerics.presets import PRESETS

    result = run("presets")
    assert result.exit_code == 0
    for name in PRESETS:
        assert name in result.output
    listing = json.loads(run("presets", "--json").output)
    assert set(listing) == set(PRESETS)


def test_compare(tmp_path: Path, digits_run: tuple[Path, Path, Any]) -> None:
    out = tmp_path / "cmp.json"
    result = run("compare", DIGITS, digits_run[0], "--data", SAMPLES / "digits_cnn.eval.npz",
                 "--labels", SAMPLES / "digits_cnn.eval.labels.npy", "--json", out)
    assert result.exit_code == 0, result.output
    content = json.loads(out.read_text())
    assert content["samples"] == 450
    assert content["outputs"][0]["top1_agreement"] > 0.97
    report = json.loads(digits_run[1].read_text())
    assert content["outputs"][0]["quantized_accuracy"] == report["evaluation"]["outputs"][0]["quantized_accuracy"]


def test_bias_scales_are_input_scale_times_weight_scale(digits_run: tuple[Path, Path, Any]) -> None:
    report = json.loads(digits_run[1].read_text())
    tensors = {t["name"]: t for t in report["tensors"]}
    model = onnx.load(digits_run[0])
    producers = {o: n for n in model.graph.node for o in n.output}
    biases = [t for t in report["tensors"] if t["role"] == "bias"]
    # One per Conv/Gemm but the stem Conv, which reads the image's one channel, and the small
    # head Gemm: placement "auto" keeps both float, their biases with them.
    layers = {n["name"] for n in report["nodes"] if n["op_type"] in ("Conv", "Gemm")}
    floated = {n["name"] for n in report["nodes"] if n["name"] in layers and not n["quantized"]}
    assert {n["op_type"] for n in report["nodes"] if n["name"] in floated} == {"Conv", "Gemm"}
    assert sorted(b["consumers"][0] for b in biases) == sorted(layers - floated)
    for bias in biases:
        node = next(n for n in model.graph.node if n.name == bias["consumers"][0])
        x_dq, w_dq = producers[node.input[0]], producers[node.input[1]]
        x_name = producers[x_dq.input[0]].input[0]  # the float tensor the QuantizeLinear reads
        weight = next(t for t in report["tensors"]
                      if t["role"] == "weight" and node.name in t["consumers"])
        x_scale = np.float32(tensors[x_name]["onnx"]["scale"][0])
        expected = x_scale * np.asarray(weight["onnx"]["scale"], np.float32)
        np.testing.assert_array_equal(np.asarray(bias["onnx"]["scale"], np.float32), expected)
        assert bias["onnx"]["type"] == "int32" and set(bias["onnx"]["zero_point"]) == {0}
        assert w_dq.op_type == "DequantizeLinear"


def test_compare_never_writes_over_an_input_nor_into_a_missing_folder(
    tmp_path: Path, digits_run: tuple[Path, Path, Any]
) -> None:
    copy = tmp_path / "q.onnx"
    shutil.copy(digits_run[0], copy)
    before = copy.read_bytes()
    data = SAMPLES / "digits_cnn.eval.npz"
    over_input = run("compare", DIGITS, copy, "--data", data, "--json", copy)
    _assert_error(over_input, errors.OutputError.exit_code, "same file as the input")
    assert copy.read_bytes() == before
    missing = run("compare", DIGITS, copy, "--data", data, "--json", tmp_path / "no" / "c.json")
    _assert_error(missing, errors.OutputError.exit_code, "does not exist")


def test_compare_refuses_models_whose_outputs_differ(tmp_path: Path) -> None:
    model = onnx.load(DIGITS)
    model.graph.output[0].name = "renamed"
    model.graph.node[-1].output[0] = "renamed"
    other = tmp_path / "other.onnx"
    onnx.save(model, other)
    result = run("compare", DIGITS, other, "--data", SAMPLES / "digits_cnn.eval.npz")
    _assert_error(result, errors.ModelError.exit_code, "no output")


def test_a_model_with_nothing_to_quantize_says_so_and_fails_the_coverage_gates(
    tmp_path: Path,
) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["y"], name="tanh")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    base = ["calibrate", path, "--data", tmp_path / "d.npz", "-o", tmp_path / "q.onnx",
            "--report", tmp_path / "q.json", "--force"]
    # the written model is the float model: by default that fails the coverage floor, after
    # writing both files (a CI job read exit 0 for a logistic regression left as it was)
    plain = run(*base)
    _assert_error(plain, errors.AccuracyGateError.exit_code, "coverage")
    report = json.loads((tmp_path / "q.json").read_text())
    assert any(w.startswith("nothing was quantized") for w in report["warnings"])
    assert "nothing was quantized" in " ".join(plain.output.split())
    assert "the model has none, and no other node of it is quantized" in " ".join(
        plain.output.split())
    # the output is the float model: the two are not timed against each other
    assert not any(key.startswith("latency_") for key in report["timings_seconds"])
    unchecked = run(*base, "--no-fallback")  # no floor: said, not failed
    assert unchecked.exit_code == 0, unchecked.output
    gated = run(*base, "--no-fallback", "--fail-if-coverage-below", "1")
    _assert_error(gated, errors.AccuracyGateError.exit_code, "quantized share")


def test_output_may_not_overwrite_the_config_file_even_with_force(tmp_path: Path) -> None:
    config = tmp_path / "qcal.toml"
    config.write_text('method = "minmax"\n')
    before = config.read_bytes()
    result = run("calibrate", DIGITS, "--config", config, "-o", config, "--report",
                 tmp_path / "r.json", "--force")
    _assert_error(result, errors.OutputError.exit_code, "same file as the input")
    assert config.read_bytes() == before and not (tmp_path / "r.json").exists()


def test_a_nan_inside_a_weight_is_the_model_s_fault(tmp_path: Path) -> None:
    from onnx import numpy_helper

    model = onnx.load(DIGITS)
    weight = next(t for t in model.graph.initializer if len(t.dims) == 4)
    values = numpy_helper.to_array(weight).copy()
    values.flat[0] = np.nan
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    path = tmp_path / "nan.onnx"
    onnx.save(model, path)
    result = run("calibrate", path, "--data", SAMPLES / "digits_cnn.calib.npz", "-o",
                 tmp_path / "q.onnx", "--report", tmp_path / "q.json")
    _assert_error(result, errors.ModelError.exit_code, f"weight {weight.name!r}")
    assert not (tmp_path / "q.onnx").exists()


def test_the_summary_folds_the_fallback_reasons_and_the_rarest_ones() -> None:
    """Per-tensor fallback reasons are one line; beyond a dozen reasons the rest are one line."""
    from qcal._cli_output import _float_reasons

    reasons = {f"'t{i}' kept float by the accuracy fallback: jump {i}": 1 for i in range(40)}
    reasons |= {f"no quantization rule for op Op{i}": 20 - i for i in range(15)}
    rows = _float_reasons(reasons)
    assert len(rows) == 12
    assert rows[0][0] == 40 and "accuracy fallback" in rows[0][1]
    assert rows[1] == (20, "no quantization rule for op Op0")
    assert sum(n for n, _ in rows) == sum(reasons.values())
    assert "5 other reasons" in rows[-1][1]


def test_the_summary_counts_reasons_that_differ_only_in_names_as_one() -> None:
    """Four statistics kept float for the same reason, each naming its own node, are one line,
    named by the first; a reason alone of its kind keeps its name."""
    from qcal._cli_output import _float_reasons

    reasons = {f"computes a normalization statistic (ReduceMean 'mean.{i}'); default "
               "exclusion": 1 for i in range(4)}
    reasons["embedding lookup in 'table'"] = 1
    reasons["no quantization rule for op Sqrt"] = 3
    assert _float_reasons(reasons) == [
        (4, ("computes a normalization statistic (ReduceMean 'mean.0'); default exclusion "
             "(and 3 more like it)")),
        (3, "no quantization rule for op Sqrt"),
        (1, "embedding lookup in 'table'"),
    ]


def test_a_missed_accuracy_floor_reads_as_a_verdict() -> None:
    from qcal.accuracy.gates import GateResult

    line = GateResult("accuracy-floor", "accuracy floor above the coverage floor (see README) "
                      "(1 yes, 0 no)", 0.0, 0.0, False).describe()
    assert line == ("accuracy floor above the coverage floor (see README) "
                    "(always checked): FAILED")


def test_fail_if_slower_is_a_gate_on_the_measured_latency_ratio(tmp_path: Path) -> None:
    """No assumption on this machine's speed: a ratio no model can stay under fails the gate
    (exit 7, both files written, the ratio at 1 and 2 threads recorded); one every model stays
    under passes it."""
    def run(ratio: str, name: str) -> tuple[int, dict[str, Any]]:
        result = CliRunner().invoke(main, [
            "calibrate", str(DIGITS), "--data", str(SAMPLES / "digits_cnn.calib.npz"),
            "--limit", "8", "-o", str(tmp_path / f"{name}.onnx"),
            "--report", str(tmp_path / f"{name}.json"), "-q", "--fail-if-slower", ratio])
        return result.exit_code, json.loads((tmp_path / f"{name}.json").read_text())

    code, report = run("1e-6", "strict")
    assert code == errors.AccuracyGateError.exit_code and (tmp_path / "strict.onnx").exists()
    (gate,) = [g for g in report["gates"] if g["option"] == "fail-if-slower"]
    timings = report["timings_seconds"]
    ratios = [timings[f"latency_quantized_{t}"] / timings[f"latency_float_{t}"]
              for t in ("1_thread", "2_threads")]
    rounding = 1e-6 / min(timings[k] for k in timings if k.startswith("latency_"))  # µs figures
    assert not gate["passed"] and gate["value"] == pytest.approx(max(ratios), rel=3 * rounding)
    code, report = run("1e6", "loose")
    assert code == 0 and [g["passed"] for g in report["gates"]
                          if g["option"] == "fail-if-slower"] == [True]


@pytest.mark.parametrize(("value", "message"), [("0", "not a positive ratio"),
                                                ("-1", "not a positive ratio"),
                                                ("nan", "NaN is not a value")])
def test_fail_if_slower_needs_a_positive_ratio(tmp_path: Path, value: str, message: str) -> None:
    result = CliRunner().invoke(main, [
        "calibrate", str(DIGITS), "--data", str(SAMPLES / "digits_cnn.calib.npz"),
        "-o", str(tmp_path / "q.onnx"), "--fail-if-slower", value])
    assert result.exit_code == errors.ConfigError.exit_code and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_fail_if_slower_inf_is_off() -> None:
    from qcal.config import CalibrationConfig

    assert CalibrationConfig(fail_if_slower=math.inf).fail_if_slower is None


def test_every_command_and_option_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = []
    for name, command in sorted(main.commands.items()):
        if f"qcal {name}" not in readme:
            missing.append(f"qcal {name}")
        for param in command.params:
            flags = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
            # a --x/--no-x pair is documented by either side
            if flags and flags != ["--help"] and not any(f in readme for f in flags):
                missing.append(f"qcal {name} {flags[0]}")
    assert missing == []


@pytest.mark.parametrize(("message", "said"), [
    (("... NOT reached: it would need more than 30 % of compute in float (coverage floor 70 %); "
      "the model is handed over as planned (the closest checked kept 3 tensor(s) float, "
      "short too)"),
     "did not reach it with 70 % of compute quantized"),
    (("... NOT reached even with all 2 sensitive tensor(s) in float; the model is handed over "
      "as planned (the closest checked kept 2 tensor(s) float, short too)"),
     "every tensor found harmful did not reach it"),
])
def test_a_missed_floor_says_why_the_search_stopped(message: str, said: str) -> None:
    """The coverage floor, or no tensor left to blame: the verdict says which."""
    from qcal._verdict import quality_verdict

    report = {
        "evaluation": {"outputs": [{"name": "y", "sqnr_db": 30.0, "top1_agreement": 0.9,
                                    "nonfinite_introduced": 0}]},
        "gates": [{"option": "accuracy-floor", "passed": False}],
        "config": {"min_coverage": 70.0, "fallback": True, "target_sqnr": None,
                   "max_agreement_drop": None},
        "fallback": {"reached": False, "message": message},
    }
    verdict = quality_verdict(report)
    assert verdict is not None and verdict.level == "below-floor" and said in verdict.detail
