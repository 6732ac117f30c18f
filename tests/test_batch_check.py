"""Joined samples run only where onnxruntime computes them as it computes each sample alone.

The model here reads its dim 0 as a sequence, not as a batch: it subtracts the mean over dim 0,
so joining samples changes every value. (A time-major recurrent model whose time axis is free
does the same.) Real models differ more subtly, in the last bits of a reduction at another batch
size; what qcal does about either is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, residual_classifier, run
from click.testing import CliRunner
from onnx import helper

from qcal.calibration import batch_check
from qcal.calibration.batch_check import exact_batch_size
from qcal.calibration.collect import expose_tensors
from qcal.calibration.data import iter_batches, open_data
from qcal.cli import main
from qcal.graph.model import model_inputs


def _centred_over_dim0(rng: np.random.Generator) -> onnx.ModelProto:
    """x (N, 4) -> (x - mean over N) @ W: every row depends on the other rows of its run."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["centred"]),
        helper.make_node("MatMul", ["centred", "W"], ["y"]),
    ]
    weights = {"W": rng.standard_normal((4, 3)).astype(np.float32)}
    return build_model(nodes, [float_input("x", ["N", 4])], ["y"], weights)


def _save(tmp_path: Path, model: onnx.ModelProto, data: dict[str, np.ndarray]) -> tuple[Path, Path]:
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **data)
    return tmp_path / "m.onnx", tmp_path / "d.npz"


def _check(tmp_path: Path, model: onnx.ModelProto, x: np.ndarray) -> tuple[int, str | None]:
    """`exact_batch_size` at 4 of `model` (shapes inferred, as qcal prepares it) on samples `x`
    of its input "x"."""
    model_path, data_path = _save(tmp_path, model, {"x": x})
    model = onnx.shape_inference.infer_shapes(model)
    inputs = model_inputs(model)
    source = open_data(data_path, model_path=model_path, inputs=inputs)
    return exact_batch_size(model, source, inputs, 4)


def test_samples_that_change_when_joined_run_one_at_a_time(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    model_path, data_path = _save(tmp_path, _centred_over_dim0(rng),
                                  {"x": rng.standard_normal((12, 4)).astype(np.float32)})
    model = onnx.shape_inference.infer_shapes(onnx.load(model_path))  # as qcal prepares it
    inputs = model_inputs(model)
    source = open_data(data_path, model_path=model_path, inputs=inputs)
    # The data batching alone would join them: the model's dim 0 is free.
    assert next(iter(iter_batches(source, inputs, 4)))[1] == 4
    size, reason = exact_batch_size(model, source, inputs, 4)
    assert size == 1
    assert reason is not None and "'mean'" in reason and "4 samples" in reason


def test_samples_computed_alike_stay_joined(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    model = residual_classifier(rng, in_channels=3, channels=8, classes=5, side=12,
                                second_scale=0.1, softmax=True)
    model_path, data_path = _save(
        tmp_path, model, {"x": rng.standard_normal((10, 3, 12, 12)).astype(np.float32)})
    inputs = model_inputs(model)
    source = open_data(data_path, model_path=model_path, inputs=inputs)
    assert exact_batch_size(model, source, inputs, 4) == (4, None)
    assert exact_batch_size(model, source, inputs, 1) == (1, None)


@pytest.mark.parametrize(("shape", "why"), [
    ([1, 4], "input 'x' has a fixed first dimension (1)"),
    ([], "input 'x' has no dimension to join samples along (rank 0)"),
])
def test_inputs_that_cannot_be_joined_say_so(tmp_path: Path, shape: list[int], why: str) -> None:
    """A model exported for one sample (or fed a scalar) runs its samples one at a time whatever
    --batch-size asks, and the reason names the input."""
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    model = build_model(nodes, [float_input("x", shape)], ["y"], {})
    samples = np.random.default_rng(5).standard_normal((6, *shape)).astype(np.float32)
    assert _check(tmp_path, model, samples) == (
        1, f"batch-size: {why}; the samples ran one at a time")


def test_shape_arithmetic_may_count_the_samples(tmp_path: Path) -> None:
    """A float computed from the input's shape for a Reshape (as tf2onnx writes some) holds
    the number of samples: it differs joined by design and is no reason to run one at a time."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["shape_f", "one"], ["shape_scaled"]),
        helper.make_node("Cast", ["shape_scaled"], ["target"], to=onnx.TensorProto.INT64),
        helper.make_node("Reshape", ["x", "target"], ["same"]),
        helper.make_node("MatMul", ["same", "W"], ["y"]),
    ]
    weights = {"W": rng.standard_normal((4, 3)).astype(np.float32),
               "one": np.ones(1, np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 4])], [float_input("y", ["N", 3])],
                        weights)
    assert _check(tmp_path, model, rng.standard_normal((8, 4)).astype(np.float32)) == (4, None)


def _calibrate(model: Path, data: Path, out: Path, batch: int) -> tuple[bytes, dict[str, object]]:
    out.mkdir()
    result = CliRunner().invoke(main, [
        "calibrate", str(model), "--data", str(data), "--batch-size", str(batch),
        "-o", str(out / "q.onnx"), "--report", str(out / "q.json"), "-q", "--no-fallback",
    ])
    assert result.exit_code == 0, result.output
    return (out / "q.onnx").read_bytes(), json.loads((out / "q.json").read_text())


def test_the_batch_size_cannot_change_the_model(tmp_path: Path) -> None:
    """Joined, the centred rows would span other ranges than alone; the batch check keeps the
    model byte for byte that of one sample at a time, and the report says why."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 4)).astype(np.float32) + np.arange(12, dtype=np.float32)[:, None]
    model_path, data_path = _save(tmp_path, _centred_over_dim0(rng), {"x": x})
    alone, alone_report = _calibrate(model_path, data_path, tmp_path / "b1", 1)
    joined, joined_report = _calibrate(model_path, data_path, tmp_path / "b4", 4)
    assert joined == alone
    assert not any("batch-size" in w for w in alone_report["warnings"])  # type: ignore[attr-defined]
    notes = [w for w in joined_report["warnings"] if "batch-size" in w]  # type: ignore[attr-defined]
    assert len(notes) == 1 and "one at a time" in notes[0]
    assert joined_report["data"]["batch_size"] == 1  # type: ignore[index]


def test_collected_statistics_do_not_depend_on_the_batch_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((12, 4)).astype(np.float32) + np.arange(12, dtype=np.float32)[:, None]
    model_path, data_path = _save(tmp_path, _centred_over_dim0(rng), {"x": x})
    files = []
    for batch in (1, 4):
        out = tmp_path / f"s{batch}.qcalstats"
        result = CliRunner().invoke(main, ["collect", str(model_path), "--data", str(data_path),
                                           "--batch-size", str(batch), "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_the_size_estimate_is_what_the_check_would_hold(tmp_path: Path) -> None:
    """Shapes from shape inference with the feed's sizes for the symbolic batch dim: the
    estimate is the bytes the joined run's tensors take."""
    rng = np.random.default_rng(8)
    model = onnx.shape_inference.infer_shapes(residual_classifier(
        rng, in_channels=3, channels=8, classes=5, side=12, second_scale=0.1, softmax=True))
    feed = {"x": rng.standard_normal((6, 3, 12, 12)).astype(np.float32)}
    tensors = [v for node in model.graph.node for v in node.output]
    held = sum(a.nbytes for a in run(expose_tensors(model, tensors), feed))
    assert held > 6 * 3 * 12 * 12 * 4
    assert batch_check._estimated_bytes(model, tensors, feed) == held


def test_a_check_too_large_runs_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(9)
    model = residual_classifier(rng, in_channels=3, channels=8, classes=5, side=12,
                                second_scale=0.1, softmax=True)
    model_path, data_path = _save(
        tmp_path, model, {"x": rng.standard_normal((10, 3, 12, 12)).astype(np.float32)})
    model = onnx.shape_inference.infer_shapes(model)
    inputs = model_inputs(model)
    source = open_data(data_path, model_path=model_path, inputs=inputs)
    assert exact_batch_size(model, source, inputs, 4) == (4, None)
    monkeypatch.setattr(batch_check, "_CHECK_BYTES", 4 * 3 * 12 * 12 * 4)  # the inputs alone
    size, reason = exact_batch_size(model, source, inputs, 4)
    assert size == 1 and reason is not None and "MiB" in reason


def test_constants_computed_in_the_graph_are_not_samples(tmp_path: Path) -> None:
    """A weight reshaped in the graph has nothing to do with the feed, even when its dim 0
    happens to equal the number of samples joined (PP-OCR cls reshapes its biases)."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Reshape", ["W", "shape"], ["W_reshaped"]),
        helper.make_node("MatMul", ["x", "W_reshaped"], ["y"]),
    ]
    weights = {"W": rng.standard_normal(12).astype(np.float32),
               "shape": np.array([4, 3], np.int64)}
    model = build_model(nodes, [float_input("x", ["N", 4])], [float_input("y", ["N", 3])],
                        weights)
    assert _check(tmp_path, model, rng.standard_normal((8, 4)).astype(np.float32)) == (4, None)


def test_a_difference_after_the_first_batch_is_found(tmp_path: Path) -> None:
    """Whether joining shows can depend on the values too. Here each row gets the index of the
    largest row per column, broadcast back to the rows' shape: four equal rows give index 0
    joined or alone (ties go to the first); the next four do not."""
    nodes = [
        helper.make_node("ArgMax", ["x"], ["index"], axis=0, keepdims=1),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["index", "shape"], ["indices"]),
        helper.make_node("Cast", ["indices"], ["offset"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Add", ["x", "offset"], ["y"]),
    ]
    model = build_model(nodes, [float_input("x", ["N", 4])], [float_input("y", ["N", 4])])
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    x[:4] = x[0]
    size, reason = _check(tmp_path, model, x)
    assert size == 1 and reason is not None and "'offset'" in reason


# ------------------------------------------------------------------------------- thread count


def _strided_conv1d(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv1d 64 -> 64, kernel 3, stride 2 on 199 steps (a wav2vec2 feature encoder's third
    layer): onnxruntime's float kernel splits its work between threads so that some outputs
    differ in their last bits at one thread and at two."""
    w = (rng.standard_normal((64, 64, 3)) / np.sqrt(192)).astype(np.float32)
    v = (rng.standard_normal((64, 64, 3)) / np.sqrt(192)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], strides=[2], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "V"], ["y"], name="conv2")]
    return build_model(nodes, [float_input("x", ["N", 64, 199])], ["y"], {"W": w, "V": v})


def _threads_differ(model: onnx.ModelProto, x: np.ndarray) -> bool:
    import onnxruntime as ort

    outputs = []
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"x": x})[0])
    return not np.array_equal(outputs[0].view(np.uint32), outputs[1].view(np.uint32))


@pytest.mark.parametrize("checked", [True, False])
def test_the_thread_count_cannot_change_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """At two threads and at one the model and its ranges are byte for byte the same. Where
    onnxruntime's kernels differ with the thread count (measured here), the statistics were
    collected at one thread and the report says why; a model this small (under
    _ONE_THREAD_MACS) runs on one thread unchecked, and nothing is said."""
    import qcal._inputs

    if checked:
        monkeypatch.setattr(qcal._inputs, "_ONE_THREAD_MACS", 0)
    rng = np.random.default_rng(6)
    model = _strided_conv1d(rng)
    x = rng.standard_normal((6, 64, 199)).astype(np.float32)
    model_path, data_path = _save(tmp_path, model, {"x": x})
    runs = {}
    for threads in (1, 2):
        out = tmp_path / f"t{threads}"
        out.mkdir()
        result = CliRunner().invoke(main, [
            "calibrate", str(model_path), "--data", str(data_path), "--threads", str(threads),
            "-o", str(out / "q.onnx"), "--report", str(out / "q.json"), "-q", "--no-fallback",
        ])
        assert result.exit_code == 0, result.output
        runs[threads] = ((out / "q.onnx").read_bytes(), json.loads((out / "q.json").read_text()))
    assert runs[1][0] == runs[2][0]
    notes = [w for w in runs[2][1]["warnings"] if w.startswith("threads:")]
    if not checked:
        assert notes == [] and runs[2][1]["runtime"]["threads"] == 1
    elif _threads_differ(model, x[:1]):
        assert len(notes) == 1 and "at one thread" in notes[0]
        assert runs[2][1]["runtime"]["threads"] == 1
    else:  # this machine's kernels agree: nothing to say
        assert notes == []
    assert not any(w.startswith("threads:") for w in runs[1][1]["warnings"])


def test_a_thread_check_too_large_compares_the_tensor_outputs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too large to compare every tensor, the thread check compares the model's outputs: a
    classifier's ZipMap of dicts beside its scores is not one of them (sorting dicts failed)."""
    rng = np.random.default_rng(12)
    model = build_model([helper.make_node("MatMul", ["x", "w"], ["scores"])],
                        [float_input("x", ["N", 4])], [float_input("scores", ["N", 3])],
                        {"w": rng.standard_normal((4, 3)).astype(np.float32)})
    model.graph.node.append(helper.make_node("ZipMap", ["scores"], ["by_class"],
                                             domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2]))
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 1))
    by_class = onnx.TypeProto()
    by_class.sequence_type.elem_type.map_type.key_type = onnx.TensorProto.INT64
    by_class.sequence_type.elem_type.map_type.value_type.tensor_type.elem_type = (
        onnx.TensorProto.FLOAT)
    model.graph.output.append(helper.make_value_info("by_class", by_class))
    onnx.checker.check_model(model)
    onnx.save(model, tmp_path / "m.onnx")
    samples = tmp_path / "samples"  # a sample of three rows: three dicts, which do not sort
    samples.mkdir()
    np.savez(samples / "0.npz", x=rng.standard_normal((3, 4)).astype(np.float32))
    inputs = model_inputs(model)
    source = open_data(samples, model_path=tmp_path / "m.onnx", inputs=inputs)
    monkeypatch.setattr(batch_check, "_CHECK_BYTES", 0)  # the outputs alone
    assert batch_check.exact_threads(model, source, inputs, 2) == (2, None)
