"""Models with external data: loaded, calibrated and written with external data of their own
(``<output>.data``, staged under temporary names and renamed into place).

The slow test builds a model of over 2 GiB (two large MatMul weights, written straight to an
external file, never whole in memory) and calibrates it in a subprocess, measuring its peak
memory. The fast tests check the same output path on small models, with the size at which
output goes external (`qcal.graph.files.save.EXTERNAL_DATA_THRESHOLD_BYTES`) lowered.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import TensorProto, helper

import qcal.calibration.runtime
import qcal.graph.files.save
from qcal.accuracy import latency
from qcal.cli import main
from qcal.graph.files.load import load_model
from qcal.numerics import errors

# ------------------------------------------------------------------------------------ helpers


def external_tensor(
    name: str, shape: tuple[int, ...], data_file: Path, offset: int
) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    length = int(np.prod(shape)) * 4
    for key, value in (
        ("location", data_file.name),
        ("offset", str(offset)),
        ("length", str(length)),
    ):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def write_weights(data_file: Path, shapes: list[tuple[int, int]], seed: int) -> list[int]:
    """Random float32 weights (scaled 1/sqrt(fan-in)) appended row block by row block; offsets."""
    rng = np.random.default_rng(seed)
    offsets = []
    with data_file.open("wb") as fh:
        for rows, cols in shapes:
            offsets.append(fh.tell())
            for start in range(0, rows, 1024):
                block = rng.standard_normal((min(1024, rows - start), cols), dtype=np.float32)
                block *= np.float32(1 / np.sqrt(rows))
                fh.write(block.tobytes())
    return offsets


def mlp_with_external_weights(folder: Path, sizes: list[int], seed: int = 0) -> Path:
    """x -> MatMul -> Relu -> MatMul -> ... -> y, weights in `weights.bin` beside the model."""
    data_file = folder / "weights.bin"
    shapes = list(itertools.pairwise(sizes))
    offsets = write_weights(data_file, shapes, seed)
    nodes, inits, current = [], [], "x"
    for i, (shape, offset) in enumerate(zip(shapes, offsets)):
        inits.append(external_tensor(f"W{i}", shape, data_file, offset))
        nodes.append(helper.make_node("MatMul", [current, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        current = f"h{i}"
        if i < len(shapes) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"r{i}"], name=f"relu{i}"))
            current = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [float_input("x", ["N", sizes[0]])],
        [float_input(current, ["N", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(path))
    return path


def calibrate(*args: str | Path) -> Any:
    """`qcal calibrate` without the accuracy floor: these models have random weights, and the
    tests are about files, not accuracy."""
    return CliRunner().invoke(main, ["calibrate", "--min-product-macs", "0", "--no-fallback", *[str(a) for a in args]])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ fast tests


@pytest.fixture
def small_external(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "in"
    folder.mkdir()
    model = mlp_with_external_weights(folder, [64, 128, 10])
    np.savez(
        folder / "d.npz", x=np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    )
    return model, folder / "d.npz"


def test_a_model_with_external_data_is_written_with_external_data(
    small_external: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = small_external
    out = tmp_path / "out"
    out.mkdir()
    result = calibrate(
        model, "--data", data, "-o", out / "q.onnx", "--report", out / "q.json", "-q"
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["q.json", "q.onnx", "q.onnx.data"]
    report = json.loads((out / "q.json").read_text())
    external = report["output_model"]["external_data"]
    assert external == {
        "path": str(out / "q.onnx.data"),
        "size_bytes": (out / "q.onnx.data").stat().st_size,
        "sha256": sha256(out / "q.onnx.data"),
    }
    assert report["output_model"]["sha256"] == sha256(out / "q.onnx")
    stored = onnx.load(out / "q.onnx", load_external_data=False)
    codes = [t for t in stored.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert codes and {t.data_type for t in codes} == {TensorProto.INT8}
    for tensor in codes:
        entries = {e.key: e.value for e in tensor.external_data}
        assert entries["location"] == "q.onnx.data"
        assert int(entries["offset"]) % qcal.graph.files.save.ALIGNMENT_BYTES == 0
    onnx.checker.check_model(str(out / "q.onnx"), full_check=True)
    session = ort.InferenceSession(str(out / "q.onnx"), providers=["CPUExecutionProvider"])
    x = np.load(data)["x"]
    float_session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    expected, got = float_session.run(None, {"x": x})[0], session.run(None, {"x": x})[0]
    assert np.sqrt(np.mean((got - expected) ** 2)) < 0.1 * np.sqrt(np.mean(expected**2))


def test_a_model_of_small_weights_in_files_is_timed_on_repacked_weights(
    small_external: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights in a file of their own (as torch.onnx's dynamo exporter writes them), but small:
    the model is timed against float like any other (the not-slower gate holds), on sessions
    that repack the mapped weights as a deployment does (unpacked, integer kernels ran a
    MobileNetV3 at 1.6x float where it runs at 0.9x)."""
    from qcal.graph.files import large

    sessions: list[tuple[bool, bool]] = []
    original = qcal.calibration.runtime._mapping_weights

    def spy(model: onnx.ModelProto, *args: Any, **kwargs: Any) -> bytes | None:
        sessions.append((large.has_external_data(model), kwargs.get("repack", False)))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(qcal.calibration.runtime, "_mapping_weights", spy)
    monkeypatch.setattr(large, "DETACH_MIN_BYTES", 1024)  # its weights stay in their file
    model, data = small_external
    result = calibrate(model, "--data", data, "-o", tmp_path / "q.onnx", "--report",
                       tmp_path / "q.json", "-q")
    assert result.exit_code == 0, result.output
    timings = json.loads((tmp_path / "q.json").read_text())["timings_seconds"]
    assert {"latency_float_1_thread", "latency_quantized_2_threads"} <= set(timings)
    assert (True, False) in sessions  # the calibration's own sessions do not repack
    # The timing runs in a process of its own, on the model as held here: its weights in
    # their file, mapped, and repacked.
    light = load_model(model).model
    assert large.has_external_data(light)
    feed = {i.name: np.load(data)[i.name][:1] for i in light.graph.input}
    latency.time_here(light, light, [feed], providers=("CPUExecutionProvider",), threads=(1,))
    assert (True, True) in sessions


def test_external_output_is_deterministic(
    small_external: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = small_external
    files = []
    for run in ("a", "b"):
        out = tmp_path / run
        out.mkdir()
        result = calibrate(
            model, "--data", data, "-o", out / "q.onnx", "--report", out / "q.json", "-q"
        )
        assert result.exit_code == 0, result.output
        files.append(((out / "q.onnx").read_bytes(), (out / "q.onnx.data").read_bytes()))
    assert files[0] == files[1]


def test_a_large_inline_model_goes_external_above_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    model = build_model(
        nodes,
        [float_input("x", ["N", 32])],
        ["y"],
        {"W": rng.standard_normal((32, 64)).astype(np.float32)},
    )
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((4, 32)).astype(np.float32))
    args = ["--data", tmp_path / "d.npz", "--report", tmp_path / "q.json", "-q"]
    result = calibrate(tmp_path / "m.onnx", "-o", tmp_path / "inline.onnx", *args)
    assert result.exit_code == 0 and not (tmp_path / "inline.onnx.data").exists()
    monkeypatch.setattr(qcal.graph.files.save, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)
    result = calibrate(tmp_path / "m.onnx", "-o", tmp_path / "external.onnx", *args, "--force")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "external.onnx.data").is_file()
    inline, external = onnx.load(tmp_path / "inline.onnx"), onnx.load(tmp_path / "external.onnx")
    for tensor in (*inline.graph.initializer, *external.graph.initializer):
        tensor.ClearField("data_location")  # onnx.load sets it explicitly when it loads data
    assert inline.SerializeToString() == external.SerializeToString()  # same model, other layout


def test_an_inline_model_of_large_weights_is_calibrated_with_them_in_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights over `WEIGHTS_IN_FILES_BYTES` go to a file while qcal calibrates an inline
    model (onnxruntime maps them instead of copying them into each session); the model is
    still timed against float, and written inline, as its size asks."""
    from qcal.graph.files import large

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"], name="mm0"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W1"], ["y"], name="mm1")]
    weights = {"W0": rng.standard_normal((64, 128)).astype(np.float32) / 8,
               "W1": rng.standard_normal((128, 16)).astype(np.float32) / 11}
    model = build_model(nodes, [float_input("x", ["N", 64])], ["y"], weights)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 64)).astype(np.float32))
    mapped: list[bool] = []
    original = qcal.calibration.runtime._mapping_weights

    def spy(model: onnx.ModelProto, *args: Any, **kwargs: Any) -> bytes | None:
        mapped.append(large.has_external_data(model))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(qcal.calibration.runtime, "_mapping_weights", spy)
    monkeypatch.setattr(large, "DETACH_MIN_BYTES", 1024)
    from qcal.graph.files import load

    loads: list[Path] = []  # the user's model is read once (the timing runs it as kept)
    read_file = load._read_file

    def counted(path: Path) -> bytes:
        loads.append(path)
        return read_file(path)

    monkeypatch.setattr(load, "_read_file", counted)
    for limit, in_files in ((1 << 20, False), (4096, True)):  # 40 KB of weights
        monkeypatch.setattr(qcal.graph.files.save, "WEIGHTS_IN_FILES_BYTES", limit)
        mapped.clear()
        loads.clear()
        out = tmp_path / f"q{limit}.onnx"
        result = calibrate(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", out,
                           "--report", tmp_path / "q.json", "--force", "-q")
        assert result.exit_code == 0, result.output
        assert any(mapped) is in_files, mapped
        assert len(loads) == 1, loads
        report = json.loads((tmp_path / "q.json").read_text())
        assert "latency_quantized_1_thread" in report["timings_seconds"]
        assert report["output_model"]["external_data"] is None
        assert not out.with_name(out.name + ".data").exists()
        written = onnx.load(out)
        assert not large.has_external_data(written)
        onnx.checker.check_model(written)


def test_an_existing_data_file_needs_force(
    small_external: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = small_external
    (tmp_path / "q.onnx.data").write_bytes(b"someone else's")
    result = calibrate(
        model, "--data", data, "-o", tmp_path / "q.onnx", "--report", tmp_path / "q.json", "-q"
    )
    assert result.exit_code == errors.OutputError.exit_code
    assert "q.onnx.data" in result.stderr and "--force" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "q.onnx.data"]
    assert (tmp_path / "q.onnx.data").read_bytes() == b"someone else's"


def test_a_failed_write_leaves_neither_file(
    small_external: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, data = small_external
    out = tmp_path / "out"
    out.mkdir()

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qcal.graph.files.save, "write_atomic", disk_full)
    result = calibrate(
        model, "--data", data, "-o", out / "q.onnx", "--report", out / "q.json", "-q"
    )
    assert result.exit_code != 0
    assert list(out.iterdir()) == []


def test_sessions_for_models_over_the_protobuf_limit_leave_the_model_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    model = build_model(
        nodes,
        [float_input("x", ["N", 32])],
        ["y"],
        {"W": rng.standard_normal((32, 64)).astype(np.float32)},
    )
    before = model.SerializeToString()
    monkeypatch.setattr(qcal.calibration.runtime, "_MAX_INLINE_BYTES", 100)  # take the large-model path
    session = qcal.calibration.runtime.create_session(model)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    weight = onnx.numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight, rtol=1e-5, atol=1e-5)
    assert model.SerializeToString() == before


def conv_bn_mlp_with_external_weights(folder: Path) -> Path:
    """Opset 11 Conv -> BatchNormalization -> Relu -> Flatten -> MatMul -> Add, saved with its
    tensors of 1 KiB or more in `m.data` (the opset upgrade and the folding read them)."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Conv", ["x", "Wc", "bc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"], name="bn"
        ),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "Wm"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "bm"], ["y"], name="add"),
    ]
    weights = {
        "Wc": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
        "bc": rng.standard_normal(16).astype(np.float32) * 0.1,
        "gamma": rng.uniform(0.5, 1.5, 16).astype(np.float32),
        "beta": rng.standard_normal(16).astype(np.float32) * 0.1,
        "mean": rng.standard_normal(16).astype(np.float32) * 0.1,
        "var": rng.uniform(0.5, 1.5, 16).astype(np.float32),
        "Wm": rng.standard_normal((1024, 32)).astype(np.float32) / 32,
        "bm": rng.standard_normal(32).astype(np.float32) * 0.1,
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], weights, opset=11)
    path = folder / "m.onnx"
    onnx.save_model(
        model, path, save_as_external_data=True, location="m.data", size_threshold=1024
    )
    np.savez(folder / "m.calib.npz", x=rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    return path


def assert_same_model(got: onnx.ModelProto, expected: onnx.ModelProto) -> None:
    """Same graph and initializers; values equal up to float rounding (integer codes off by
    at most one, where a scale's last bits moved a value across a rounding boundary)."""
    assert got.graph.node == expected.graph.node
    assert [t.name for t in got.graph.initializer] == [t.name for t in expected.graph.initializer]
    for a, b in zip(got.graph.initializer, expected.graph.initializer):
        x, y = onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b)
        assert x.dtype == y.dtype and x.shape == y.shape, a.name
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-5, err_msg=a.name)
        else:
            assert np.abs(x.astype(np.int64) - y.astype(np.int64)).max(initial=0) <= 1, a.name


def test_weights_kept_in_files_calibrate_to_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large models keep their large weights in files while calibrated (onnxruntime maps them,
    qcal reads one at a time): the same model calibrated that way, the size of "large"
    lowered, gives the model calibrated in memory, written and returned. (Up to float rounding:
    onnxruntime does not repack mapped weights, which changes its summation order.)"""
    import tempfile

    from qcal.config import CalibrationConfig
    from qcal.graph.files import large
    from qcal.pipeline import calibrate as run_calibration

    folder = tmp_path / "in"
    folder.mkdir()
    model = conv_bn_mlp_with_external_weights(folder)

    def run(name: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        out = tmp_path / name
        out.mkdir()
        result = run_calibration(
            model, CalibrationConfig(fallback=False), output=out / "q.onnx",
            report_path=out / "q.json",
        )
        assert (out / "q.onnx.data").is_file()
        return onnx.load(out / "q.onnx"), result.model

    in_memory = run("memory")
    monkeypatch.setattr(large, "DETACH_MIN_BYTES", 1024)  # every tensor of 1 KiB is "large"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    mapped: list[bool] = []
    original = qcal.calibration.runtime._mapping_weights

    def spy(model: onnx.ModelProto, *args: Any, **kwargs: Any) -> bytes:
        mapped.append(large.has_external_data(model))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(qcal.calibration.runtime, "_mapping_weights", spy)
    in_files = run("files")
    assert mapped and all(mapped)  # every session of the second run mapped its weights
    assert list(temp.iterdir()) == []  # the weights moved out of memory went with the run
    assert not large.has_external_data(in_files[1])  # the caller gets the model whole
    for got, expected in zip(in_files, in_memory):
        assert_same_model(got, expected)


def test_a_model_keeps_its_large_external_weights_in_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qcal.graph.files import large
    from qcal.graph.files.load import load_model

    model = mlp_with_external_weights(tmp_path, [64, 128, 10])
    monkeypatch.setattr(large, "DETACH_MIN_BYTES", 4 * 128 * 10 + 1)  # W0 is large, W1 not
    loaded = load_model(model).model
    w0, w1 = loaded.graph.initializer
    assert large.is_external(w0) and not large.is_external(w1)
    assert large.external_file(w0) == ((tmp_path / "weights.bin").resolve(), 0, 4 * 64 * 128)
    full = onnx.load(model)
    for stored, kept in zip(full.graph.initializer, loaded.graph.initializer):
        expected = onnx.numpy_helper.to_array(stored)
        np.testing.assert_array_equal(large.tensor_array(kept), expected)
    x = np.random.default_rng(8).standard_normal((3, 64)).astype(np.float32)
    mapped = qcal.calibration.runtime.create_session(loaded).run(None, {"x": x})[0]
    whole = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(mapped, whole.run(None, {"x": x})[0])


# ------------------------------------------------------------------------------- slow test


@pytest.mark.slow
def test_a_model_over_2_gib_calibrates_with_memory_close_to_its_size(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    sizes = [16384, 16384, 17000]  # 2 weights: 1.07 GB + 1.11 GB of float32
    model = mlp_with_external_weights(folder, sizes)
    weights_bytes = (folder / "weights.bin").stat().st_size
    assert weights_bytes > 2**31
    np.savez(
        folder / "d.npz",
        x=np.random.default_rng(4).standard_normal((4, sizes[0])).astype(np.float32),
    )
    out = tmp_path / "out"
    out.mkdir()
    script = (
        "import resource, sys\n"
        "from qcal.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "finally:\n"
        "    print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "calibrate",
            "--no-fallback",
            str(model),
            "--data",
            str(folder / "d.npz"),
            "-o",
            str(out / "q.onnx"),
            "--report",
            str(out / "q.json"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "peak_rss_kib" in proc.stderr, proc.stderr
    peak_bytes = int(proc.stderr.rsplit("peak_rss_kib", 1)[1].split()[0]) * 1024
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "q.json").read_text())
    assert (
        report["output_model"]["external_data"]["size_bytes"]
        == (out / "q.onnx.data").stat().st_size
    )
    assert (out / "q.onnx").stat().st_size < 2**20  # the graph only; weights are in the data file
    session = ort.InferenceSession(str(out / "q.onnx"), providers=["CPUExecutionProvider"])
    x = np.load(folder / "d.npz")["x"][:1]
    assert np.isfinite(session.run(None, {"x": x})[0]).all()
    assert report["evaluation"]["outputs"][0]["sqnr_db"] > 25
    # Memory: the float weights once (mapped from their file by onnxruntime; qcal reads one at
    # a time), their int8 codes once (a quarter of that), and working space.
    print(f"peak RSS {peak_bytes / 2**30:.2f} GiB for {weights_bytes / 2**30:.2f} GiB of weights")
    assert peak_bytes < 1.4 * weights_bytes


def test_preparation_works_on_a_copy_without_the_large_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Opset conversion and shape inference see the model without its large weights, whatever
    its size (a model over 2 GiB does not serialize whole; a smaller one would cost copies of
    its weights), and the converted model gets them back, byte for byte."""
    from qcal.graph.files import large
    from qcal.graph.model import prepare_model

    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    model = build_model(nodes, [float_input("x", ["N", 64])], ["y"], {"W": weight}, opset=11)
    before = model.SerializeToString()
    monkeypatch.setattr(large, "DETACH_MIN_BYTES", 1000)
    seen: list[int] = []
    original = large.light_copy

    def spy(*args: Any, **kwargs: Any) -> Any:
        light, detached = original(*args, **kwargs)
        seen.append(light.ByteSize())
        return light, detached

    monkeypatch.setattr(large, "light_copy", spy)
    prepared, steps = prepare_model(model)
    assert seen and max(seen) < 1000  # the tools never saw the weights
    assert {s.name for s in steps} >= {"upgrade-opset", "infer-shapes"}
    (stored,) = prepared.graph.initializer
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(stored), weight)
    assert model.SerializeToString() == before


@pytest.mark.parametrize(
    "preset", ["pytorch", "tensorflow", "oneflow-cambricon", "mindspore", "horizon"]
)
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_weights_quantized_in_blocks_equal_weights_quantized_whole(
    preset: str, axis: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large weights are quantized a block at a time (bounded temporaries): same codes."""
    import qcal._quantize_tensors
    from qcal.numerics.observers import MinMaxObserver, PerChannel, PerTensor
    from qcal.numerics.presets import build_preset

    recipe = build_preset(preset).weight
    array = np.random.default_rng(6).standard_normal((6, 7, 5)).astype(np.float32) * 3
    observer = MinMaxObserver(PerTensor() if axis is None else PerChannel(axis))
    observer.update(array)
    qparams = recipe.qparams(observer.state())
    whole = recipe.quantize(array, qparams, opset=13)
    monkeypatch.setattr(qcal._quantize_tensors, "_QUANTIZE_BLOCK_ELEMENTS", 20)
    blocks = qcal._quantize_tensors._quantize_in_blocks(recipe, array, qparams, 13)
    assert blocks.dtype == whole.dtype
    np.testing.assert_array_equal(blocks, whole)
