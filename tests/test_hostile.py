"""Hostile input, end to end through `qcal calibrate`.

Every broken model, data file, option or output path is refused with one line naming the
culprit and the exit code the README documents, and leaves the file system as it found it: no
partial output, no temp file beside the outputs, in the current folder or in the temp folder.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.cli import main
from qcal.numerics import errors

CONFIG = errors.ConfigError.exit_code
MODEL = errors.ModelError.exit_code
DATA = errors.DataError.exit_code
OUTPUT = errors.OutputError.exit_code
USAGE = errors.EXIT_USAGE

# ------------------------------------------------------------------------------- test models


def conv_model(seed: int = 0, *, batch: int | str = "N") -> onnx.ModelProto:
    """x[N,8,8,8] -> Conv -> Relu -> GlobalAveragePool -> Flatten -> MatMul -> y[N,5]. 8 input
    channels: with fewer the Conv stays float and the baseline run fails the coverage floor."""
    rng = np.random.default_rng(seed)
    inits = {
        "W": rng.standard_normal((4, 8, 3, 3)).astype(np.float32),
        "B": rng.standard_normal(4).astype(np.float32),
        "G": rng.standard_normal((4, 5)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "G"], ["y"], name="mm"),
    ]
    return build_model(nodes, [float_input("x", [batch, 8, 8, 8])], ["y"], inits)


def two_input_model() -> onnx.ModelProto:
    """y = x + Cast(ids) with ids int64: two inputs of different types."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["idf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "idf"], ["y"], name="add"),
    ]
    inputs = [
        float_input("x", ["N", 4]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4]),
    ]
    return build_model(nodes, inputs, ["y"])


def images(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8, 8, 8)).astype(np.float32)


def raw_model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    opsets: tuple[tuple[str, int], ...] = (("", 13),),
) -> onnx.ModelProto:
    """A model built without the checker (some of these are meant to fail it)."""
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return model


# ------------------------------------------------------------------------------------ harness


@dataclass(frozen=True)
class Case:
    """One hostile run: `setup` writes files into the folder and returns the extra arguments."""

    setup: Callable[[Path], list[Any]]
    exit_code: int
    needles: tuple[str, ...]


def _save(folder: Path, model: onnx.ModelProto, name: str = "m.onnx") -> Path:
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _model_with_data(folder: Path, model: onnx.ModelProto | None = None, n: int = 4) -> list[Any]:
    """The conv model and an .npz of `n` samples: the arguments of a run that would succeed."""
    path = _save(folder, model or conv_model())
    np.savez(folder / "calib.npz", x=images(n))
    return [path, "--data", folder / "calib.npz"]


def _with_npz(folder: Path, **arrays: np.ndarray) -> list[Any]:
    np.savez(folder / "bad.npz", **arrays)
    return [_save(folder, conv_model()), "--data", folder / "bad.npz"]


def _with_two_inputs(folder: Path, **arrays: np.ndarray) -> list[Any]:
    np.savez(folder / "bad.npz", **arrays)
    return [_save(folder, two_input_model()), "--data", folder / "bad.npz"]


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file and folder under `root`: size and content hash (folders: -1, "")."""
    found: dict[str, tuple[int, str]] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink() or not path.is_file():
            found[key] = (-1, "")
        else:
            found[key] = (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def _run_hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case) -> str:
    """Run the case; check exit code, one-line message and untouched files. Returns the message."""
    folder, cwd, system_tmp, out = (tmp_path / n for n in ("in", "cwd", "tmp", "out"))
    for made in (folder, cwd, system_tmp, out):
        made.mkdir()
    args = [str(a) for a in case.setup(folder)]
    if "-o" not in args:
        args += ["-o", str(out / "q.onnx")]
    if "--report" not in args:
        args += ["--report", str(out / "q.json")]
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(main, ["calibrate", *args])
    message = result.stderr.strip()
    assert result.exit_code == case.exit_code, (result.exit_code, message, result.output)
    assert "Traceback" not in result.output + message
    if case.exit_code != USAGE:  # click's usage errors are its own multi-line text
        assert len(message.splitlines()) == 1, message
        assert message.startswith("error"), message
    for needle in case.needles:
        assert needle in message, (needle, message)
    assert _snapshot(tmp_path) == before
    return message


# -------------------------------------------------------------------------------- the models


def _external(folder: Path, location: str = "w.bin") -> Path:
    """The conv model with its weights in an external file, then pointed at `location`."""
    model = conv_model()
    path = folder / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="w.bin", size_threshold=0)
    stored = onnx.load_model(path, load_external_data=False)
    for tensor in stored.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(stored.SerializeToString())
    return path


def _external_args(folder: Path, location: str) -> list[Any]:
    np.savez(folder / "calib.npz", x=images(2))
    return [_external(folder, location), "--data", folder / "calib.npz"]


def _truncated_external(folder: Path) -> list[Any]:
    args = _external_args(folder, "w.bin")
    data = (folder / "w.bin").read_bytes()
    (folder / "w.bin").write_bytes(data[: len(data) // 2])
    return args


def _symlinked_external(folder: Path) -> list[Any]:
    args = _external_args(folder, "link.bin")
    outside = folder.parent / "outside.bin"
    (folder / "w.bin").rename(outside)
    (folder / "link.bin").symlink_to(outside)
    return args


def _escaping_external(folder: Path) -> list[Any]:
    args = _external_args(folder, "../w.bin")
    (folder / "w.bin").rename(folder.parent / "w.bin")
    return args


def _checker_failure(folder: Path) -> list[Any]:
    model = conv_model()
    model.graph.node[1].attribute.append(helper.make_attribute("bogus", 1))
    return [_save(folder, model), "--synthetic", "2"]


def _cyclic(folder: Path) -> list[Any]:
    # no order puts these nodes after what they read (an unsorted graph is sorted on loading)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [
        helper.make_node("Add", ["t", "x"], ["y"], name="second"),
        helper.make_node("Relu", ["y"], ["t"], name="first"),
    ]
    return [_save(folder, raw_model(nodes, [float_input("x", ["N", 4])], [y])), "--synthetic", "2"]


def _already_quantized(folder: Path) -> list[Any]:
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="ql"),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dql"),
    ]
    constants = [
        numpy_helper.from_array(np.float32(0.1), "s"),
        numpy_helper.from_array(np.uint8(128), "z"),
    ]
    model = raw_model(nodes, [float_input("x", ["N", 4])], [y], constants)
    return [_save(folder, model), "--synthetic", "2"]


def _unknown_operator(folder: Path) -> list[Any]:
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [
        helper.make_node("Frobnicate", ["x"], ["t"], name="frob", domain="acme.ops"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    model = raw_model(nodes, [float_input("x", ["N", 4])], [y], opsets=(("", 13), ("acme.ops", 1)))
    return [_save(folder, model), "--synthetic", "2"]


def _sequence_input(folder: Path) -> list[Any]:
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    nodes = [helper.make_node("SequenceAt", ["seq", "i"], ["y"], name="at")]
    inputs = [
        helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, ["N", 4]),
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
    ]
    return [_save(folder, raw_model(nodes, inputs, [y])), "--synthetic", "2"]


def _ir_too_new(folder: Path) -> list[Any]:
    model = conv_model()
    model.ir_version = 99
    return [_save(folder, model), "--synthetic", "2"]


# ---------------------------------------------------------------------------------- the data


def _nan_input(folder: Path) -> list[Any]:
    x = images(5)
    x[3, 1, 2, 2] = np.nan
    return _with_npz(folder, x=x)


def _inf_input(folder: Path) -> list[Any]:
    x = images(5)
    x[2, 0, 0, 0] = np.inf
    return _with_npz(folder, x=x)


def _overflow_inside(folder: Path) -> list[Any]:
    """Finite data, but a tensor inside the model overflows to inf: its range is refused."""
    nodes = [
        helper.make_node("Mul", ["x", "big"], ["huge"], name="scale_up"),
        helper.make_node("MatMul", ["huge", "w"], ["y"], name="project"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 4])], ["y"],
        {"big": np.array([3e38], np.float32), "w": np.eye(4, dtype=np.float32)},
    )
    np.savez(folder / "calib.npz", x=np.full((3, 4), 10.0, np.float32))
    # a product this small stays float unless asked for (--min-product-macs)
    return [_save(folder, model), "--data", folder / "calib.npz", "--min-product-macs", "0"]


def _object_array(folder: Path) -> list[Any]:
    objects = np.empty(2, dtype=object)
    objects[:] = [np.zeros(3), "pickled"]
    np.savez(folder / "bad.npz", x=objects, allow_pickle=True)
    return [_save(folder, conv_model()), "--data", folder / "bad.npz"]


def _object_array_in_dir(folder: Path) -> list[Any]:
    samples = folder / "samples"
    samples.mkdir()
    np.savez(samples / "000.npz", x=images(1))
    np.savez(samples / "001.npz", x=np.array([[1.0]], dtype=object), allow_pickle=True)
    return [_save(folder, conv_model()), "--data", samples]


def _npz_not_a_zip(folder: Path) -> list[Any]:
    (folder / "bad.npz").write_bytes(b"PK\x03\x04 but not really")
    return [_save(folder, conv_model()), "--data", folder / "bad.npz"]


def _truncated_member(folder: Path) -> list[Any]:
    np.savez(folder / "full.npz", x=images(6))
    data = (folder / "full.npz").read_bytes()
    (folder / "bad.npz").write_bytes(data[: len(data) * 2 // 3])
    (folder / "full.npz").unlink()
    return [_save(folder, conv_model()), "--data", folder / "bad.npz"]


def _unequal_sample_counts(folder: Path) -> list[Any]:
    return _with_two_inputs(folder, x=np.zeros((3, 4), np.float32), ids=np.zeros((5, 4), np.int64))


def _fixed_batch_not_filled(folder: Path) -> list[Any]:
    np.savez(folder / "bad.npz", x=images(4))  # samples x[i:i+1] have batch 1; the model wants 2
    return [_save(folder, conv_model(batch=2)), "--data", folder / "bad.npz"]


def _runtime_failure(folder: Path) -> list[Any]:
    """Data that passes every header check but cannot run: the Reshape fails in onnxruntime."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape_to_4")]
    model = build_model(
        nodes, [float_input("x", ["N", "K"])], ["y"], {"shape": np.array([-1, 4], np.int64)}
    )
    np.savez(folder / "calib.npz", x=np.ones((2, 1, 3), np.float32))
    return [_save(folder, model), "--data", folder / "calib.npz"]


def _empty_dir(folder: Path) -> list[Any]:
    (folder / "samples").mkdir()
    return [_save(folder, conv_model()), "--data", folder / "samples"]


def _labels(folder: Path, labels: np.ndarray) -> list[Any]:
    np.save(folder / "labels.npy", labels)
    return [*_model_with_data(folder), "--labels", folder / "labels.npy"]


# ------------------------------------------------------------------------------- the outputs


def _output_is_model(folder: Path) -> list[Any]:
    args = _model_with_data(folder)
    return [*args, "-o", args[0], "--force"]


def _output_is_data(folder: Path) -> list[Any]:
    args = _model_with_data(folder)
    return [*args, "-o", folder / "calib.npz", "--force"]


def _report_is_labels(folder: Path) -> list[Any]:
    args = _labels(folder, np.zeros(4, np.int64))
    return [*args, "--report", folder / "labels.npy", "--force"]


def _output_is_external_data(folder: Path) -> list[Any]:
    return [*_external_args(folder, "w.bin"), "-o", folder / "w.bin", "--force"]


def _existing(folder: Path, option: str) -> list[Any]:
    target = folder / "existing"
    target.write_bytes(b"keep me")
    return [*_model_with_data(folder), option, target]


def _under_a_file(folder: Path) -> list[Any]:
    (folder / "plain.txt").write_text("a file, not a folder")
    return [*_model_with_data(folder), "-o", folder / "plain.txt" / "q.onnx"]


def _read_only_dir(folder: Path) -> list[Any]:
    locked = folder / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return [*_model_with_data(folder), "-o", locked / "q.onnx"]


def _config(folder: Path, text: str, *extra: Any) -> list[Any]:
    (folder / "qcal.toml").write_text(text)
    return [*_model_with_data(folder), "--config", folder / "qcal.toml", *extra]


def _flags(*flags: Any) -> Callable[[Path], list[Any]]:
    return lambda folder: [*_model_with_data(folder), *flags]


CASES: dict[str, Case] = {
    # the model file
    "model-missing": Case(
        lambda d: [d / "absent.onnx", "--synthetic", "2"], MODEL, ("absent.onnx", "not found")
    ),
    "model-empty": Case(
        lambda d: [_write(d / "empty.onnx", b""), "--synthetic", "2"],
        MODEL,
        ("empty.onnx", "empty"),
    ),
    "model-truncated": Case(
        lambda d: [
            _write(d / "cut.onnx", conv_model().SerializeToString()[:700]),
            "--synthetic",
            "2",
        ],
        MODEL,
        ("cut.onnx", "not an ONNX model"),
    ),
    "model-text": Case(
        lambda d: [_write(d / "notes.onnx", b"hello, world\n"), "--synthetic", "2"],
        MODEL,
        ("notes.onnx",),
    ),
    "model-is-an-npz": Case(
        lambda d: [_npz_as_model(d), "--synthetic", "2"],
        MODEL,
        ("weights.onnx", "not an ONNX model"),
    ),
    "model-is-a-folder": Case(
        lambda d: [_mkdir(d / "dir.onnx"), "--synthetic", "2"],
        MODEL,
        ("dir.onnx", "not a regular file"),
    ),
    "model-fails-checker": Case(_checker_failure, MODEL, ("m.onnx", "onnx.checker", "bogus")),
    "model-cyclic": Case(_cyclic, MODEL, ("m.onnx", "topologically sorted")),
    "model-ir-too-new": Case(_ir_too_new, MODEL, ("m.onnx", "ir_version 99")),
    "model-already-quantized": Case(_already_quantized, MODEL, ("'ql'", "already quantized")),
    "model-unknown-operator": Case(_unknown_operator, MODEL, ("Frobnicate",)),
    "model-sequence-input": Case(_sequence_input, MODEL, ("'seq'", "only tensor inputs")),
    "external-missing": Case(
        lambda d: _external_args(d, "gone.bin"), MODEL, ("'gone.bin'", "not found")
    ),
    "external-truncated": Case(_truncated_external, MODEL, ("'w.bin'", "truncated")),
    "external-absolute": Case(
        lambda d: _external_args(d, "/etc/passwd"), MODEL, ("'/etc/passwd'", "absolute")
    ),
    "external-dotdot": Case(
        _escaping_external, MODEL, ("'../w.bin'", "outside the model's folder")
    ),
    "external-symlink": Case(_symlinked_external, MODEL, ("'link.bin'",)),
    # the data
    "data-missing": Case(
        lambda d: [_save(d, conv_model()), "--data", d / "absent.npz"],
        DATA,
        ("absent.npz", "not found"),
    ),
    "data-unsupported-file": Case(
        lambda d: [_save(d, conv_model()), "--data", _write(d / "data.csv", b"1,2,3\n")],
        DATA,
        ("data.csv", "unsupported"),
    ),
    "data-npz-not-a-zip": Case(_npz_not_a_zip, DATA, ("bad.npz", "not a readable .npz")),
    "data-object-array": Case(_object_array, DATA, ("bad.npz", "'x'", "Python objects")),
    "data-object-array-in-folder": Case(
        _object_array_in_dir, DATA, ("001.npz", "'x'", "Python objects")
    ),
    "data-wrong-name": Case(
        lambda d: _with_npz(d, image=images(2)),
        DATA,
        ("missing input 'x'", "'image' is not a model input"),
    ),
    "data-missing-input": Case(
        lambda d: _with_two_inputs(d, x=np.zeros((2, 4), np.float32)),
        DATA,
        ("missing input 'ids'",),
    ),
    "data-extra-input": Case(
        lambda d: _with_npz(d, x=images(2), mask=np.ones((2, 8))),
        DATA,
        ("'mask' is not a model input",),
    ),
    "data-wrong-dtype": Case(
        lambda d: _with_npz(d, x=images(2).astype(np.float64)), DATA, ("'x'", "float64", "float32")
    ),
    "data-int32-for-int64": Case(
        lambda d: _with_two_inputs(
            d, x=np.zeros((2, 4), np.float32), ids=np.zeros((2, 4), np.int32)
        ),
        DATA,
        ("'ids'", "int32", "int64"),
    ),
    "data-wrong-rank": Case(lambda d: _with_npz(d, x=images(2)[:, 0]), DATA, ("'x'", "rank 3")),
    "data-wrong-fixed-dim": Case(
        lambda d: _with_npz(d, x=np.zeros((2, 8, 9, 8), np.float32)),
        DATA,
        ("'x'", "size 9 on axis 2"),
    ),
    "data-unequal-sample-counts": Case(
        _unequal_sample_counts, DATA, ("different numbers of samples",)
    ),
    "data-batch-cannot-stack": Case(
        _fixed_batch_not_filled, DATA, ("'x'", "size 1 on axis 0", "expects 2")
    ),
    "data-nan": Case(_nan_input, DATA, ("input 'x'", "NaN", "sample 3")),
    "data-inf": Case(_inf_input, DATA, ("finite", "NaN")),
    "data-overflow-inside-model": Case(_overflow_inside, DATA, ("tensor 'huge'", "finite")),
    "data-empty-npz": Case(lambda d: _with_npz(d, x=images(0)), DATA, ("bad.npz", "no samples")),
    "data-empty-folder": Case(_empty_dir, DATA, ("samples", "no calibration data")),
    "data-none-found": Case(
        lambda d: [_save(d, conv_model())], DATA, ("m.onnx", "no calibration data")
    ),
    "data-truncated-member": Case(_truncated_member, DATA, ("bad.npz",)),
    "data-fails-in-onnxruntime": Case(
        _runtime_failure, DATA, ("calibration sample 0", "reshape_to_4")
    ),
    "labels-not-integers": Case(lambda d: _labels(d, np.zeros(4)), DATA, ("labels.npy", "integer")),
    "labels-wrong-count": Case(lambda d: _labels(d, np.zeros(9, np.int64)), DATA, ("9 labels",)),
    "limit-zero": Case(_flags("--limit", "0"), CONFIG, ("limit",)),
    # the outputs
    "output-is-the-model": Case(_output_is_model, OUTPUT, ("m.onnx", "same file as the input")),
    "output-is-the-data": Case(_output_is_data, OUTPUT, ("calib.npz", "same file as the input")),
    "output-is-external-data": Case(
        _output_is_external_data, OUTPUT, ("w.bin", "same file as the input")
    ),
    "report-is-the-labels": Case(
        _report_is_labels, OUTPUT, ("labels.npy", "same file as the input")
    ),
    "report-is-the-output": Case(
        lambda d: [*_model_with_data(d), "-o", d / "same", "--report", d / "same"],
        CONFIG,
        ("same path",),
    ),
    "output-exists": Case(lambda d: _existing(d, "-o"), OUTPUT, ("existing", "--force")),
    "report-exists": Case(lambda d: _existing(d, "--report"), OUTPUT, ("existing", "--force")),
    "output-folder-missing": Case(
        _flags("-o", "/nonexistent-qcal-folder/q.onnx"), OUTPUT, ("does not exist",)
    ),
    "output-under-a-file": Case(_under_a_file, OUTPUT, ("plain.txt", "is a file, not a directory")),
    "output-is-a-folder": Case(
        lambda d: [*_model_with_data(d), "-o", d], OUTPUT, ("is a directory",)
    ),
    "output-read-only-folder": Case(_read_only_dir, OUTPUT, ("locked", "not writable")),
    # options and config
    "preset-unknown": Case(_flags("--preset", "tensorflowish"), CONFIG, ("tensorflowish",)),
    "preset-option-unknown": Case(
        _flags("--preset-option", "warp_speed=1"), CONFIG, ("warp_speed",)
    ),
    "preset-option-wrong-type": Case(
        _flags("--preset-option", "reduce_range=maybe"), CONFIG, ("reduce_range",)
    ),
    "preset-option-malformed": Case(
        _flags("--preset-option", "reduce_range"), CONFIG, ("KEY=VALUE",)
    ),
    "synthetic-and-data": Case(_flags("--synthetic", "3"), CONFIG, ("synthetic",)),
    "quantized-bins-above-bins": Case(
        _flags("--bins", "64", "--quantized-bins", "128"), CONFIG, ("quantized-bins",)
    ),
    "batch-size-zero": Case(_flags("--batch-size", "0"), CONFIG, ("batch-size",)),
    "opset-out-of-range": Case(_flags("--opset", "99"), CONFIG, ("opset", "99")),
    "provider-unavailable": Case(
        _flags("--provider", "WarpDriveExecutionProvider"), CONFIG, ("WarpDriveExecutionProvider",)
    ),
    "exclude-unknown-tensor": Case(_flags("--exclude-tensors", "nowhere"), CONFIG, ("'nowhere'",)),
    "op-types-without-rule": Case(_flags("--op-types", "Frobnicate"), CONFIG, ("'Frobnicate'",)),
    "method-unknown": Case(_flags("--method", "vibes"), USAGE, ()),
    "config-missing": Case(
        lambda d: [*_model_with_data(d), "--config", d / "absent.toml"], CONFIG, ("absent.toml",)
    ),
    "config-not-toml": Case(
        lambda d: _config(d, "preset = [\n"), CONFIG, ("qcal.toml", "invalid TOML")
    ),
    "config-unknown-key": Case(
        lambda d: _config(d, "frobnicate = 1\n"), CONFIG, ("qcal.toml", "'frobnicate'")
    ),
    "config-wrong-type": Case(
        lambda d: _config(d, 'batch-size = "big"\n'), CONFIG, ("qcal.toml", "batch_size", "integer")
    ),
    "config-output-wrong-type": Case(
        lambda d: _config(d, "output = 3\n"), CONFIG, ("qcal.toml", "output", "path")
    ),
    "config-force-wrong-type": Case(
        lambda d: _config(d, 'force = "yes"\n'), CONFIG, ("qcal.toml", "force")
    ),
    "config-tensor-skip-wrong-type": Case(
        lambda d: _config(d, '[tensors.r]\nskip = "yes"\n'), CONFIG, ("tensors.r.skip",)
    ),
    "config-tensor-percentile-range": Case(
        lambda d: _config(d, "[tensors.r]\npercentile = 250.0\n"),
        CONFIG,
        ("tensors.r.percentile", "250"),
    ),
    "config-tensor-unknown-key": Case(
        lambda d: _config(d, "[tensors.r]\nbits = 4\n"), CONFIG, ("tensors.r", "'bits'")
    ),
    "config-tensor-not-activation": Case(
        lambda d: _config(d, '[tensors.nowhere]\nmethod = "entropy"\n'),
        CONFIG,
        ("tensors.nowhere",),
    ),
}


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _npz_as_model(folder: Path) -> Path:
    np.savez(folder / "weights.npz", x=images(1))
    return (folder / "weights.npz").rename(folder / "weights.onnx")


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_is_refused_cleanly(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "output-read-only-folder" and os.geteuid() == 0:
        pytest.skip("root ignores folder permissions (output-under-a-file covers the path check)")
    _run_hostile(tmp_path, monkeypatch, CASES[name])


def test_there_are_enough_hostile_cases() -> None:
    assert len(CASES) >= 40


def test_the_same_data_without_the_fault_calibrates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness itself: the baseline files calibrate, so each case fails for its fault only."""
    monkeypatch.chdir(tmp_path)
    args = [str(a) for a in _model_with_data(tmp_path)]
    result = CliRunner().invoke(
        main, ["calibrate", *args, "-o", "q.onnx", "--report", "q.json", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q.onnx").is_file() and (tmp_path / "q.json").is_file()


def test_finite_data_after_a_nan_free_run_names_the_sample_of_the_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batching changes which samples a batch holds; the message still names the right range
    (all five samples calibrate: none is held out)."""
    case = Case(lambda d: [*_nan_input(d), "--batch-size", "2", "--no-fallback"], DATA,
                ("input 'x'", "samples 2-3"))
    _run_hostile(tmp_path, monkeypatch, case)


# ------------------------------------------------------------------------------------ SIGINT


def _wait_until_calibrating(proc: subprocess.Popen[bytes], cpu_seconds: float = 3.0) -> None:
    """Wait until `proc` has used `cpu_seconds` of CPU (imports and set-up take about one), so
    the interrupt lands in calibration however loaded the machine is; without /proc, sleep."""
    stat = Path(f"/proc/{proc.pid}/stat")
    if not stat.exists():
        time.sleep(4)
        return
    deadline = time.monotonic() + 120
    tick = os.sysconf("SC_CLK_TCK")
    while time.monotonic() < deadline and proc.poll() is None:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        if (int(fields[11]) + int(fields[12])) / tick >= cpu_seconds:  # utime + stime
            return
        time.sleep(0.1)


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_sigint_mid_calibration_exits_130_and_leaves_nothing(tmp_path: Path, method: str) -> None:
    folder, out, cwd, system_tmp = (tmp_path / n for n in ("in", "out", "cwd", "tmp"))
    for made in (folder, out, cwd, system_tmp):
        made.mkdir()
    model = _save(folder, conv_model())
    before = _snapshot(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qcal.cli",
            "calibrate",
            str(model),
            "--synthetic",
            "10000000",
            "--method",
            method,
            "-o",
            str(out / "q.onnx"),
            "--report",
            str(out / "q.json"),
            "-q",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(system_tmp)},
    )
    _wait_until_calibrating(proc)
    assert proc.poll() is None, "finished before the interrupt"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0]
    after = _snapshot(tmp_path)
    after.pop("tmp/.ses", None)  # onnxruntime's own session-id file, written when it is imported
    assert after == before


_STUCK_WORKER = """
import os, pathlib, sys, threading
import qcal.calibration.collect as collect
def update(*args, **kwargs):
    pathlib.Path(os.environ["STUCK_MARK"]).touch()
    threading.Event().wait()  # a worker that never returns (a lock the interrupt left held)
collect._update_observers = update
collect._update_reduced = update
from qcal.cli import main
sys.argv = ["qcal", *sys.argv[1:]]
main()
"""


def test_an_interrupt_does_not_wait_for_a_stuck_worker(tmp_path: Path) -> None:
    """Ctrl-C can land while the main thread holds a lock a statistics worker then waits on
    forever (seen once as a hung CI job). The interrupt must still end the run: exit 130, one
    line, nothing written, without joining the stuck worker."""
    model = _save(tmp_path, conv_model())
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_WORKER, "calibrate", str(model), "--synthetic", "64",
         "-o", str(tmp_path / "q.onnx"), "--report", str(tmp_path / "q.json"), "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "STUCK_MARK": str(tmp_path / "stuck")})
    deadline = time.monotonic() + 120
    while not (tmp_path / "stuck").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the worker never ran"
        time.sleep(0.05)
    time.sleep(0.2)  # the main thread is now waiting on the worker's batch
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the interrupted run waited for its stuck worker")
    assert proc.returncode == 130, err.decode()
    assert "interrupted" in err.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "stuck"]


@pytest.mark.parametrize("low", [-1.0, 0.0])
def test_a_range_reaching_the_float32_maximum_is_refused_naming_the_tensor(
    tmp_path: Path, low: float
) -> None:
    """Finite values near the float32 maximum (padding sentinels) leave no finite step (a width
    past float32) or a grid whose end overflows: the data is at fault (exit 5, the tensor
    named), and nothing is written."""
    big = np.float32(np.finfo(np.float32).max)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    model = build_model(nodes, [float_input("x", ["N", 2])], [float_input("h", ["N", 2])],
                        {"w": np.array([[1.0, -0.9], [0.0, 1.0]], np.float32)})
    onnx.save(model, tmp_path / "m.onnx")
    x = np.array([[[big, 0.5]], [[low * big, -0.2]]], np.float32)  # sentinels
    np.savez(tmp_path / "d.npz", x=x)
    result = CliRunner().invoke(main, ["calibrate", "--min-product-macs", "0", str(tmp_path / "m.onnx"), "--data",
                                       str(tmp_path / "d.npz"), "-o", str(tmp_path / "q.onnx"),
                                       "--report", str(tmp_path / "q.json"), "-q"])
    assert result.exit_code == errors.DataError.exit_code
    assert "tensor 'x'" in result.stderr and "reaches the float32 maximum" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "m.onnx"]
