"""A Pad between quantized layers runs on the integers: a Pad of the input's codes by its zero
point (the value 0), where onnxruntime keeps a float Pad between a DequantizeLinear and a
QuantizeLinear; a Pad by another constant stays float. A Conv of one input and one output
channel stays float under placement auto (onnxruntime's integer kernel takes it for a slow
depthwise one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input, optimized_ops
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import SelectionRules, plan_quantization, prepare_model
from qcal.pipeline import calibrate


def _channel_padding_block(mode: str = "constant", value: float | None = None) -> onnx.ModelProto:
    """A MediaPipe-style residual block that widens its channels: conv -> relu -> (depthwise ->
    pointwise conv to 16 channels) + (the input padded from 8 to 16 channels) -> relu -> conv
    -> relu -> a 1x1 head."""
    rng = np.random.default_rng(3)
    pads = np.array([0, 4, 0, 0, 0, 4, 0, 0], np.int64)  # 4 channels before, 4 after
    pad_inputs = ["r1", "pads"] + (["value"] if value is not None else [])
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wd", "bd"], ["d"], name="depthwise", group=8,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d", "wp", "bp"], ["p"], name="pointwise"),
        helper.make_node("Pad", pad_inputs, ["widened"], name="channel_pad", mode=mode),
        helper.make_node("Add", ["p", "widened"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        # the last Conv writes the model's output: float, as onnxruntime runs it either way
        helper.make_node("Conv", ["r3", "w4", "b4"], ["y"], name="head"),
    ]
    shapes = {"w1": (8, 8, 3, 3), "wd": (8, 1, 3, 3), "wp": (16, 8, 1, 1), "w3": (8, 16, 3, 3),
              "w4": (4, 8, 1, 1)}
    inits: dict[str, np.ndarray] = {"pads": pads}
    for name, shape in shapes.items():
        inits[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        inits["b" + name[1:]] = (rng.standard_normal(shape[0]) * 0.1).astype(np.float32)
    if value is not None:
        inits["value"] = np.array(value, np.float32)
    return build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["y"], inits, opset=13)


def _quantize(model: onnx.ModelProto, tmp_path: Path) -> tuple[onnx.ModelProto, np.ndarray]:
    onnx.save(model, tmp_path / "m.onnx")
    x = np.random.default_rng(4).standard_normal((16, 8, 12, 12)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    config = CalibrationConfig(data=tmp_path / "calib.npz", fallback=False)
    return calibrate(tmp_path / "m.onnx", config).model, x


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_a_pad_between_integer_layers_pads_the_codes(tmp_path: Path, mode: str) -> None:
    model = _channel_padding_block(mode, 0.0 if mode == "constant" else None)
    quantized, x = _quantize(model, tmp_path)
    onnx.checker.check_model(quantized, full_check=True)
    producers = {o: n for n in quantized.graph.node for o in n.output}
    pad = next(n for n in quantized.graph.node if n.op_type == "Pad")
    source = producers[pad.input[0]]
    assert source.op_type == "QuantizeLinear"  # the codes, not a DequantizeLinear
    if mode == "constant":  # by the zero point of those codes: the value 0
        assert pad.input[2] == source.input[2]
    else:
        assert len(pad.input) == 2
    ops = optimized_ops(quantized, tmp_path)
    # no float Pad or Add between pairs: the residual Add and its Relu run as one QLinearAdd
    assert ops["QLinearAdd"] == 1 and "Add" not in ops, ops
    reference = _run(model, x)
    noise = np.sum((_run(quantized, x) - reference) ** 2)
    assert 10 * np.log10(np.sum(reference**2) / noise) > 25


def test_a_pad_by_another_constant_stays_float() -> None:
    prepared, _ = prepare_model(_channel_padding_block("constant", 1.0))
    plan = plan_quantization(prepared, SelectionRules())
    decision = next(d for d in plan.nodes if d.node == "channel_pad")
    assert not decision.quantized and "constant other than 0" in decision.reason


def test_a_convolution_of_one_channel_in_and_out_stays_float() -> None:
    """onnxruntime runs a 1-in, 1-out Conv as a depthwise one: 5x its float kernel at 1x256
    taps; with two output channels it is the matrix product that pays (0.6x)."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="stem"),
        helper.make_node("Relu", ["c1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["one"], name="one_channel"),
        helper.make_node("Conv", ["r", "w3"], ["two"], name="two_channels"),
    ]
    inits = {"w1": rng.standard_normal((8, 8, 1, 3)).astype(np.float32),
             "w2": rng.standard_normal((1, 8, 1, 1)).astype(np.float32),
             "w3": rng.standard_normal((2, 8, 1, 1)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", [1, 8, 4, 64])], ["one", "two"], inits)
    # the filters of a pitch detector: one channel in, one out, 256 taps
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="filter")]
    single = build_model(nodes, [float_input("x", [1, 1, 4, 512])], ["y"],
                         {"w": rng.standard_normal((1, 1, 1, 256)).astype(np.float32)})
    for graph, floated, kept in ((single, "filter", None), (model, None, "two_channels")):
        prepared, _ = prepare_model(graph)
        decisions = {d.node: d for d in plan_quantization(prepared, SelectionRules()).nodes}
        if floated is not None:
            assert not decisions[floated].quantized
            assert "one input and one output channel" in decisions[floated].reason
        if kept is not None:
            assert decisions[kept].quantized
