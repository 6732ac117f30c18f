"""A dequantized activation that only float nodes read, two or more of them, is read through one
Clip(x, -FLT_MAX): the values are the same, and onnxruntime fuses the GELU written out after an
integer Conv (it gives each reader of a DequantizeLinear a copy of its own, which hid the one
value the fusion looks for)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _onnx_testing import build_model, float_input, optimized_ops, run
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.pipeline import calibrate

_RNG = np.random.default_rng(0)


def _conv_gelu_conv(*, second_reader: bool = False) -> onnx.ModelProto:
    """x [N, 8, 12, 12] -> Conv 1x1 -> GELU written out -> Conv 1x1 -> Relu -> y; with
    `second_reader`, a third Conv reads the first one's output and is added to the second's."""
    inits = {
        "w1": (_RNG.standard_normal((16, 8, 1, 1)) * 0.4).astype(np.float32),
        "w2": (_RNG.standard_normal((8, 16, 1, 1)) * 0.3).astype(np.float32),
        "sqrt2": np.array(2 ** 0.5, np.float32), "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        helper.make_node("Div", ["c1", "sqrt2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
        helper.make_node("Mul", ["c1", "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["g"], name="half_mul"),
        helper.make_node("Conv", ["g", "w2"], ["c2"], name="conv2"),
    ]
    if second_reader:  # an integer Conv reading the first one's output beside the float nodes
        inits["w3"] = (_RNG.standard_normal((8, 16, 1, 1)) * 0.3).astype(np.float32)
        nodes += [helper.make_node("Conv", ["c1", "w3"], ["c3"], name="conv3"),
                  helper.make_node("Add", ["c2", "c3"], ["y"], name="sum")]
    else:
        nodes.append(helper.make_node("Relu", ["c2"], ["y"], name="relu"))
    return build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["y"], inits)


def _quantize(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "d.npz", x=_RNG.standard_normal((16, 8, 12, 12)).astype(np.float32))
    config = CalibrationConfig(data=folder / "d.npz", fallback=False, allow_slower=True)
    return calibrate(folder / "m.onnx", config, enforce_gates=False).model


def test_the_float_readers_of_a_dequantized_value_share_one_and_the_gelu_fuses(
        tmp_path: Path) -> None:
    quantized = _quantize(_conv_gelu_conv(), tmp_path)
    onnx.checker.check_model(quantized)
    (shared,) = [n for n in quantized.graph.node if n.op_type == "Clip"]
    lowest = {t.name: onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer}[
        shared.input[1]]
    assert lowest == -np.finfo(np.float32).max and len(shared.input) == 2
    producer = {o: n for n in quantized.graph.node for o in n.output}[shared.input[0]]
    assert producer.op_type == "DequantizeLinear"
    readers = sorted(n.name for n in quantized.graph.node if shared.output[0] in n.input)
    assert readers == ["div", "mul"]
    # the same values as the model without the Clip (each reader reading the Dequantize)
    bypassed = onnx.ModelProto()
    bypassed.CopyFrom(quantized)
    for node in bypassed.graph.node:
        node.input[:] = [shared.input[0] if v == shared.output[0] else v for v in node.input]
    kept = [n for n in bypassed.graph.node if n.op_type != "Clip"]
    del bypassed.graph.node[:]
    bypassed.graph.node.extend(kept)
    feed = {"x": _RNG.standard_normal((2, 8, 12, 12)).astype(np.float32)}
    np.testing.assert_array_equal(run(quantized, feed)[0], run(bypassed, feed)[0])
    # onnxruntime now fuses the GELU; without the Clip it cannot
    assert optimized_ops(quantized, tmp_path)["Gelu"] == 1
    assert optimized_ops(bypassed, tmp_path)["Gelu"] == 0


def test_a_quantized_reader_keeps_reading_the_dequantize(tmp_path: Path) -> None:
    """The integer Conv reading the same value needs the DequantizeLinear itself (its QDQ
    unit): only the float readers read the Clip, and both the integer Conv and the fused GELU
    are kept."""
    quantized = _quantize(_conv_gelu_conv(second_reader=True), tmp_path)
    (shared,) = [n for n in quantized.graph.node if n.op_type == "Clip"]
    readers = sorted(n.name for n in quantized.graph.node if shared.output[0] in n.input)
    assert readers == ["div", "mul"]
    (conv3,) = [n for n in quantized.graph.node if n.name == "conv3"]
    assert conv3.input[0] == shared.input[0]
    ops = optimized_ops(quantized, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["Gelu"] == 1


def test_before_opset_11_the_clip_takes_its_bound_as_an_attribute() -> None:
    """Clip's bounds became inputs at opset 11: an opset-10 model (QDQ exists since 10) gets
    the attribute form, and the float readers read the same values."""
    from qcal.graph.qdq._shared_reads import share_dequantized_reads

    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq"),
             helper.make_node("Abs", ["d"], ["a"], name="abs"),
             helper.make_node("Neg", ["d"], ["n"], name="neg"),
             helper.make_node("Add", ["a", "n"], ["y"], name="add")]
    inputs = [helper.make_tensor_value_info("q", onnx.TensorProto.UINT8, [2, 6])]
    model = build_model(nodes, inputs, ["y"], {"s": np.array(0.25, np.float32),
                                               "z": np.array(128, np.uint8)}, opset=10)
    feed = {"q": _RNG.integers(0, 256, (2, 6)).astype(np.uint8)}
    before = run(model, feed)[0]
    assert share_dequantized_reads(model, frozenset({"abs", "neg"})) == 1
    onnx.checker.check_model(model)
    (clip,) = [n for n in model.graph.node if n.op_type == "Clip"]
    assert list(clip.input) == ["d"]
    assert helper.get_attribute_value(clip.attribute[0]) == -np.finfo(np.float32).max
    np.testing.assert_array_equal(run(model, feed)[0], before)
