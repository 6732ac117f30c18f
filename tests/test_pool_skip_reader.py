"""A UNet's encoder block: Conv -> Relu -> MaxPool, whose output the next Conv reads and a skip
Concat reads beside a float ConvTranspose's output. onnxruntime moves the next Conv's
QuantizeLinear up through the pool and runs the Conv before it in integers only when that
QuantizeLinear is the pool's only reader, so the Concat reads its DequantizeLinear: the Conv
before the pool is quantized and runs as QLinearConv, not in float on dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from _onnx_testing import build_model, float_input
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.pipeline import calibrate


def _encoder_block(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> MaxPool -> {Conv -> Relu -> ConvTranspose, skip}, the
    ConvTranspose's output and the skip concatenated, a 1x1 Conv head and global pooling."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["pooled"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["pooled", "w2", "b2"], ["c2"], name="conv2",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("ConvTranspose", ["r2", "wt", "bt"], ["up"], name="up",
                         kernel_shape=[1, 1]),
        helper.make_node("Concat", ["up", "pooled"], ["joined"], name="skip", axis=1),
        helper.make_node("Conv", ["joined", "w3", "b3"], ["h"], name="head"),
        helper.make_node("GlobalAveragePool", ["h"], ["y"], name="gap"),
    ]
    inits = {
        "w0": rng.standard_normal((32, 8, 3, 3)).astype(np.float32) * 0.2,
        "b0": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w1": rng.standard_normal((32, 32, 3, 3)).astype(np.float32) * 0.1,
        "b1": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((32, 32, 3, 3)).astype(np.float32) * 0.1,
        "b2": rng.standard_normal(32).astype(np.float32) * 0.1,
        "wt": rng.standard_normal((32, 32, 1, 1)).astype(np.float32) * 0.2,
        "bt": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w3": rng.standard_normal((4, 64, 1, 1)).astype(np.float32) * 0.2,
        "b3": rng.standard_normal(4).astype(np.float32) * 0.1,
    }
    return build_model(nodes, [float_input("x", ["N", 8, 32, 32])], ["y"], inits)


def test_a_pool_read_by_a_skip_concat_leaves_the_conv_before_it_in_integers(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(5)
    model = _encoder_block(rng)
    onnx.save(model, tmp_path / "m.onnx")
    x = rng.standard_normal((32, 8, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    result = calibrate(tmp_path / "m.onnx",
                       CalibrationConfig(data=tmp_path / "calib.npz", fallback=False))
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["conv1"]["quantized"], decisions["conv1"]["reason"]
    assert not decisions["up"]["quantized"]  # no integer ConvTranspose on the CPU provider
    onnx.checker.check_model(result.model, full_check=True)
    readers = [n for n in result.model.graph.node if "pooled" in n.input]
    assert [n.op_type for n in readers] == ["QuantizeLinear"]

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(result.model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    ran = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert ran.count("QLinearConv") == 4  # conv0, conv1, conv2 and the head
    assert ran.count("Conv") == 0 and "FusedConv" not in ran
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours, theirs = session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0]
    assert 10 * np.log10(np.sum(theirs ** 2) / np.sum((theirs - ours) ** 2)) > 25
