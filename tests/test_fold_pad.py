"""A Pad that adds zeros on spatial axes before a Conv becomes the Conv's own padding
(fold-pad): the prepared model computes the same values, and the quantized model has no float
Pad between a DequantizeLinear and a QuantizeLinear."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import prepare_model
from qcal.pipeline import calibrate

ZERO_PADS = [0, 0, 1, 0, 0, 0, 1, 1]  # uneven, as tf2onnx writes a strided "same" padding


def _pad_conv(pads: list[int], *, conv: dict[str, Any] | None = None, mode: str = "constant",
              value: float | None = None, extra_reader: bool = False,
              opset: int = 13) -> onnx.ModelProto:
    """x [N, 4, 9, 9] -> Pad -> Conv (8 filters, 3x3, stride 2) -> y (and Relu(Pad) -> z)."""
    rng = np.random.default_rng(0)
    inits: dict[str, np.ndarray] = {
        "pads": np.array(pads, np.int64),
        "w": rng.standard_normal((8, 4 + pads[1] + pads[5], 3, 3)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
    }
    pad_inputs = ["x", "pads"]
    if value is not None:
        inits["value"] = np.array(value, np.float32)
        pad_inputs.append("value")
    attributes = dict(conv or {}, strides=[2, 2])
    nodes = [
        helper.make_node("Pad", pad_inputs, ["padded"], name="pad", mode=mode),
        helper.make_node("Conv", ["padded", "w", "b"], ["y"], name="conv", **attributes),
    ]
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["padded"], ["z"], name="relu"))
        outputs.append("z")
    return build_model(nodes, [float_input("x", ["N", 4, 9, 9])], outputs, inits, opset=opset)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _feed(channels: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, channels, 9, 9)).astype(np.float32)}


@pytest.mark.parametrize("conv", [{}, {"pads": [1, 0, 0, 1]}, {"auto_pad": "VALID"}],
                         ids=["no pads", "own pads", "valid"])
def test_a_zero_pad_before_a_conv_is_folded_into_it(conv: dict[str, Any]) -> None:
    model = _pad_conv(ZERO_PADS, conv=conv)
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["Pad"] == 0
    assert "pads" not in {t.name for t in prepared.graph.initializer}
    assert any(s.name == "fold-pad" for s in steps)
    (folded,) = [n for n in prepared.graph.node if n.op_type == "Conv"]
    own = conv.get("pads", [0, 0, 0, 0])
    expected = [own[0] + 1, own[1] + 0, own[2] + 1, own[3] + 1]
    assert [list(a.ints) for a in folded.attribute if a.name == "pads"] == [expected]
    assert not [a for a in folded.attribute if a.name == "auto_pad"]
    (reference,), (got,) = run(model, _feed()), run(prepared, _feed())
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        {"pads": ZERO_PADS, "mode": "reflect"},
        {"pads": ZERO_PADS, "value": 0.5},  # pads with something else than zeros
        {"pads": [0, 1, 0, 0, 0, 1, 0, 0]},  # adds channels
        {"pads": [0, 0, -1, 0, 0, 0, 0, 0]},  # crops
        {"pads": ZERO_PADS, "extra_reader": True},  # something else reads the padded values
        {"pads": ZERO_PADS, "conv": {"auto_pad": "SAME_UPPER"}},
    ],
    ids=["reflect", "value", "channels", "crop", "other reader", "same upper"],
)
def test_a_pad_the_conv_cannot_hold_stays(case: dict[str, Any]) -> None:
    model = _pad_conv(**case)
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["Pad"] == 1
    for reference, got in zip(run(model, _feed()), run(prepared, _feed())):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_an_explicit_zero_value_and_an_old_opset_fold_too() -> None:
    for model in (_pad_conv(ZERO_PADS, value=0.0), _pad_conv(ZERO_PADS, opset=11)):
        prepared, _ = prepare_model(model)
        assert _ops(prepared)["Pad"] == 0
        (reference,), (got,) = run(model, _feed()), run(prepared, _feed())
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_the_quantized_conv_reads_the_codes_directly(tmp_path: Path) -> None:
    # Unfolded, the quantized model keeps a float Pad between a DequantizeLinear and a
    # QuantizeLinear, which onnxruntime runs as three nodes before the integer Conv.
    rng = np.random.default_rng(2)
    inits = {
        "w0": (rng.standard_normal((8, 8, 1, 1)) * 0.5).astype(np.float32),
        "pads": np.array(ZERO_PADS, np.int64),
        "w": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((2, 8, 1, 1)) * 0.3).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Pad", ["r0", "pads"], ["padded"], name="pad"),
        helper.make_node("Conv", ["padded", "w"], ["c"], name="conv", strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="head"),
    ]
    model = build_model(nodes, [float_input("x", ["N", 8, 9, 9])], ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 8, 9, 9)).astype(np.float32))
    quantized = calibrate(tmp_path / "m.onnx", CalibrationConfig(data=tmp_path / "calib.npz"),
                          enforce_gates=False).model
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(quantized.SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    optimized = _ops(onnx.load(tmp_path / "optimized.onnx"))
    assert optimized["QLinearConv"] == 3  # conv0, the padded conv and the head
    assert optimized["Pad"] == 0
    assert optimized["QuantizeLinear"] == 1  # the model's input only
    (reference,), (got,) = run(model, _feed(8)), run(quantized, _feed(8))
    # every Conv quantized, the head's output on the grid of its range too
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum((got - reference) ** 2)) > 20


def _nhwc_pad_transpose_conv(pads: list[int], *, extra_reader: bool = False) -> onnx.ModelProto:
    """x [N, 9, 9, 4] (NHWC) -> Pad -> Transpose to NCHW -> Conv (stride 2) -> y, as tf2onnx
    writes a Keras ZeroPadding2D before a strided convolution (and Relu(Transpose) -> z)."""
    rng = np.random.default_rng(3)
    inits = {"pads": np.array(pads, np.int64),
             "w": rng.standard_normal((8, 4, 3, 3)).astype(np.float32)}
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"),
        helper.make_node("Transpose", ["padded"], ["nchw"], name="to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w"], ["y"], name="conv", strides=[2, 2]),
    ]
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["nchw"], ["z"], name="relu"))
        outputs.append("z")
    return build_model(nodes, [float_input("x", ["N", 9, 9, 4])], outputs, inits)


def test_a_zero_pad_before_a_transpose_to_a_conv_is_folded_with_the_permuted_pads() -> None:
    """NHWC pads [0, 1, 0, 0, 0, 1, 1, 0] (top 1; bottom 1, right 1) become the NCHW Conv's
    pads [1, 0, 1, 1]; the Transpose then reads the unpadded input."""
    nhwc_pads = [0, 1, 0, 0, 0, 1, 1, 0]
    model = _nhwc_pad_transpose_conv(nhwc_pads)
    prepared, steps = prepare_model(model)
    assert [s.name for s in steps if s.name == "fold-pad"] == ["fold-pad"]
    assert _ops(prepared)["Pad"] == 0 and _ops(prepared)["Transpose"] == 1
    (folded,) = [n for n in prepared.graph.node if n.op_type == "Conv"]
    assert [list(a.ints) for a in folded.attribute if a.name == "pads"] == [[1, 0, 1, 1]]
    feed = {"x": np.random.default_rng(4).standard_normal((2, 9, 9, 4)).astype(np.float32)}
    (reference,), (got,) = run(model, feed), run(prepared, feed)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
    # Padding a Transpose's batch or channel axis, or a Transpose something else reads: kept.
    for kept in (_nhwc_pad_transpose_conv([0, 0, 0, 1, 0, 0, 0, 0]),
                 _nhwc_pad_transpose_conv(nhwc_pads, extra_reader=True)):
        prepared, _ = prepare_model(kept)
        assert _ops(prepared)["Pad"] == 1
