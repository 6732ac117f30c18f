"""A MaxPool of the codes an integer layer writes serves the integer chain: in a MediaPipe
downsampling block (MaxPool -> Pad of channels -> Add of the strided branch -> PRelu) the pool
and the nodes after it are quantized, and onnxruntime runs the pool on the codes,
channels-last, with no float island between the integer layers.

A UNet's encoder block: Conv -> Relu -> MaxPool, whose output the next Conv reads and a skip
Concat reads beside a float ConvTranspose's output. onnxruntime moves the next Conv's
QuantizeLinear up through the pool and runs the Conv before it in integers only when that
QuantizeLinear is the pool's only reader, so the Concat reads its DequantizeLinear."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _onnx_testing import build_model, float_input, optimized_ops, run_optimized, sqnr_db
from _pipeline_testing import calibrated_as_planned
from onnx import helper


def _downsampling_block(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv -> PRelu, then a stride-2 depthwise + pointwise branch added to the MaxPool of the
    block's input padded with 8 zero channels, a PRelu, and a Conv head with global pooling."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c0", "s0"], ["p0"], name="prelu0"),
        helper.make_node("Conv", ["p0", "wd", "bd"], ["d"], name="depthwise", group=16,
                         pads=[0, 0, 1, 1], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Conv", ["d", "wp", "bp"], ["branch"], name="pointwise"),
        helper.make_node("MaxPool", ["p0"], ["pooled"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Pad", ["pooled", "pads"], ["widened"], name="pad"),
        helper.make_node("Add", ["widened", "branch"], ["sum"], name="add"),
        helper.make_node("PRelu", ["sum", "s1"], ["p1"], name="prelu1"),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="head"),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="gap"),
    ]
    inits = {
        "w0": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.3,
        "b0": rng.standard_normal(16).astype(np.float32) * 0.1,
        "s0": rng.uniform(0, 0.5, (16, 1, 1)).astype(np.float32),
        "wd": rng.standard_normal((16, 1, 3, 3)).astype(np.float32) * 0.5,
        "bd": rng.standard_normal(16).astype(np.float32) * 0.1,
        "wp": rng.standard_normal((24, 16, 1, 1)).astype(np.float32) * 0.3,
        "bp": rng.standard_normal(24).astype(np.float32) * 0.1,
        "pads": np.array([0, 0, 0, 0, 0, 8, 0, 0], np.int64),
        "s1": rng.uniform(0, 0.5, (24, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((4, 24, 1, 1)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(4).astype(np.float32) * 0.1,
    }
    return build_model(nodes, [float_input("x", ["N", 8, 32, 32])], ["y"], inits)


def test_the_nodes_after_a_pool_of_codes_are_quantized_and_run_on_integers(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(11)
    model = _downsampling_block(rng)
    x = rng.standard_normal((32, 8, 32, 32)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert all(decisions[name]["quantized"] for name in ("pool", "pad", "add", "prelu1"))
    onnx.checker.check_model(result.model, full_check=True)

    ran = optimized_ops(result.model, tmp_path)
    assert "NhwcMaxPool" in ran and "MaxPool" not in ran
    assert "PRelu" not in ran and "Add" not in ran  # no float island after the pool
    assert ran["Transpose"] <= 2  # channels-last from the first integer Conv to the head
    (ours,), (theirs,) = run_optimized(result.model, {"x": x}), run_optimized(model, {"x": x})
    assert sqnr_db(theirs, ours) > 25


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
    x = rng.standard_normal((32, 8, 32, 32)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["conv1"]["quantized"], decisions["conv1"]["reason"]
    assert not decisions["up"]["quantized"]  # no integer ConvTranspose on the CPU provider
    onnx.checker.check_model(result.model, full_check=True)
    readers = [n for n in result.model.graph.node if "pooled" in n.input]
    assert [n.op_type for n in readers] == ["QuantizeLinear"]

    ran = optimized_ops(result.model, tmp_path)
    assert ran["QLinearConv"] == 4  # conv0, conv1, conv2 and the head
    assert ran["Conv"] == 0 and "FusedConv" not in ran
    (ours,), (theirs,) = run_optimized(result.model, {"x": x}), run_optimized(model, {"x": x})
    assert sqnr_db(theirs, ours) > 25

