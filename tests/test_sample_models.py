"""The committed sample models are valid, run in onnxruntime on their data, and are accurate.

These tests read the files that ``sample_models/build.py`` wrote; they never rebuild them
(rebuilding needs the dev-only trainer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
MODELS = ("digits_cnn", "transformer_block")
DATA_FILES = [f"{model}.{split}.npz" for model in MODELS for split in ("calib", "eval")]
MIN_DIGITS_ACCURACY = 0.95


def _load(model: str) -> onnx.ModelProto:
    return onnx.load(str(SAMPLES / f"{model}.onnx"))


def _session(model: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        str(SAMPLES / f"{model}.onnx"), options, providers=["CPUExecutionProvider"]
    )


def _declared_shape(value: onnx.ValueInfoProto) -> list[int | str]:
    dims = value.type.tensor_type.shape.dim
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in dims]


@pytest.mark.parametrize("model", MODELS)
def test_model_passes_full_check(model: str) -> None:
    proto = _load(model)
    onnx.checker.check_model(proto, full_check=True)
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 17)]
    assert proto.ir_version <= 9  # loadable by every onnxruntime that supports opset 17


@pytest.mark.parametrize("model", MODELS)
def test_every_node_has_a_unique_name(model: str) -> None:
    names = [node.name for node in _load(model).graph.node]
    assert all(names), "unnamed node"
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("data_file", DATA_FILES)
def test_data_files_hold_only_numeric_arrays(data_file: str) -> None:
    # allow_pickle=False makes np.load refuse object arrays instead of unpickling them.
    with np.load(SAMPLES / data_file, allow_pickle=False) as archive:
        for key in archive.files:
            array = archive[key]
            assert array.dtype == np.float32, key
            assert np.isfinite(array).all(), key


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("split", ["calib", "eval"])
def test_model_runs_on_its_data(model: str, split: str) -> None:
    session = _session(model)
    proto = _load(model)
    (graph_input,) = session.get_inputs()
    (declared_output,) = proto.graph.output
    with np.load(SAMPLES / f"{model}.{split}.npz", allow_pickle=False) as archive:
        assert archive.files == [graph_input.name]
        data = archive[graph_input.name]
    # Axis 0 is the sample axis and lines up with the model's symbolic batch dim.
    assert graph_input.shape[0] == "N"
    assert list(data.shape[1:]) == graph_input.shape[1:]
    (output,) = session.run(None, {graph_input.name: data})
    expected = [len(data)] + _declared_shape(declared_output)[1:]
    assert list(output.shape) == expected
    assert output.dtype == np.float32
    assert np.isfinite(output).all()


def test_digits_cnn_is_accurate_on_held_out_digits() -> None:
    with np.load(SAMPLES / "digits_cnn.eval.npz", allow_pickle=False) as archive:
        images = archive["image"]
    labels = np.load(SAMPLES / "digits_cnn.eval.labels.npy", allow_pickle=False)
    assert labels.dtype == np.int64
    assert labels.shape == (len(images),)
    assert set(np.unique(labels)) == set(range(10))
    (logits,) = _session("digits_cnn").run(["logits"], {"image": images})
    accuracy = float(np.mean(np.argmax(logits, axis=1) == labels))
    assert accuracy >= MIN_DIGITS_ACCURACY


def test_digits_data_are_scaled_pixels() -> None:
    # Digits pixels are integers 0..16 scaled by 1/16, so every value is a multiple of 1/16.
    for split in ("calib", "eval"):
        with np.load(SAMPLES / f"digits_cnn.{split}.npz", allow_pickle=False) as archive:
            images = archive["image"]
        assert images.min() >= 0.0 and images.max() <= 1.0
        np.testing.assert_array_equal(images * 16, np.round(images * 16))


def test_digits_cnn_keeps_batchnorm_unfused() -> None:
    op_types = [node.op_type for node in _load("digits_cnn").graph.node]
    assert op_types.count("BatchNormalization") == op_types.count("Conv")


def test_transformer_block_has_both_layer_norm_spellings() -> None:
    op_types = {node.op_type for node in _load("transformer_block").graph.node}
    assert {"LayerNormalization", "ReduceMean", "Sqrt", "Div"} <= op_types
    assert {"MatMul", "Softmax", "Transpose", "Reshape", "Add"} <= op_types
