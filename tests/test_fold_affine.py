"""A Mul or Add by one constant per output channel after a Conv, Gemm or MatMul (Keras' spelling
of a BatchNormalization after a Conv1D or a Dense) is folded into its weight and bias by
fold-batchnorm: the prepared model computes the same values without the Mul/Add."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import helper

from qcal.graph.model import prepare_model

CHANNELS = 8


def _conv1d_bn(*, scale_shape: tuple[int, ...] = (1, CHANNELS, 1),
               shift_shape: tuple[int, ...] = (1, CHANNELS, 1), squeeze_axes: tuple[int, ...] = (2,),
               extra_reader: bool = False, bias: bool = True) -> onnx.ModelProto:
    """x [N, 4, 16] -> Unsqueeze -> Conv -> Squeeze -> Mul(scale) -> Add(shift) -> Relu -> y,
    as tf2onnx writes a Keras Conv1D followed by BatchNormalization."""
    rng = np.random.default_rng(0)
    inits: dict[str, Any] = {
        "unsqueeze_axes": np.array([2], np.int64),
        "w": rng.standard_normal((CHANNELS, 4, 1, 3)).astype(np.float32),
        "squeeze_axes": np.array(squeeze_axes, np.int64),
        "scale": rng.uniform(0.5, 2.0, scale_shape).astype(np.float32),
        "shift": rng.standard_normal(shift_shape).astype(np.float32),
    }
    conv_inputs = ["x4", "w"]
    if bias:
        inits["b"] = rng.standard_normal(CHANNELS).astype(np.float32)
        conv_inputs.append("b")
    nodes = [
        helper.make_node("Unsqueeze", ["x", "unsqueeze_axes"], ["x4"], name="expand"),
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[0, 1, 0, 1]),
        helper.make_node("Squeeze", ["c", "squeeze_axes"], ["c3"], name="squeeze"),
        helper.make_node("Mul", ["c3", "scale"], ["scaled"], name="bn_mul"),
        helper.make_node("Add", ["shift", "scaled"], ["shifted"], name="bn_add"),
        helper.make_node("Relu", ["shifted"], ["y"], name="relu"),
    ]
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["c3"], ["z"], name="neg"))
        outputs.append("z")
    return build_model(nodes, [float_input("x", ["N", 4, 16])], outputs, inits)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _assert_same(model: onnx.ModelProto, prepared: onnx.ModelProto, shape: tuple[int, ...]) -> None:
    feed = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    for reference, got in zip(run(model, feed), run(prepared, feed)):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_a_batchnorm_spelled_as_mul_and_add_after_a_conv1d_is_folded(bias: bool) -> None:
    model = _conv1d_bn(bias=bias)
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["Mul"] == _ops(prepared)["Add"] == 0
    assert {"scale", "shift"}.isdisjoint(t.name for t in prepared.graph.initializer)
    assert "2 per-channel Mul/Add" in {s.name: s.detail for s in steps}["fold-batchnorm"]
    _assert_same(model, prepared, (3, 4, 16))


def test_one_constant_for_every_channel_folds_too() -> None:
    model = _conv1d_bn(scale_shape=(), shift_shape=(1,))
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["Mul"] == _ops(prepared)["Add"] == 0
    _assert_same(model, prepared, (2, 4, 16))


@pytest.mark.parametrize(
    "case",
    [
        {"scale_shape": (1, 1, 16), "shift_shape": (1, 1, 16)},  # per position, not per channel
        {"scale_shape": (2, CHANNELS, 1), "shift_shape": (2, CHANNELS, 1)},  # per sample
        {"extra_reader": True},  # the Conv's values are read unscaled too
    ],
    ids=["per position", "per sample", "other reader"],
)
def test_a_mul_or_add_that_is_not_per_channel_stays(case: dict[str, Any]) -> None:
    model = _conv1d_bn(**case)
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["Mul"] == 1
    shape = (2, 4, 16)
    _assert_same(model, prepared, shape)


def test_a_dense_layer_with_a_batchnorm_spelled_out_folds_into_the_gemm() -> None:
    rng = np.random.default_rng(2)
    inits = {
        "w": rng.standard_normal((6, CHANNELS)).astype(np.float32),
        "b": rng.standard_normal(CHANNELS).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, CHANNELS).astype(np.float32),
        "shift": rng.standard_normal(CHANNELS).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["d"], name="dense"),
        helper.make_node("Mul", ["d", "scale"], ["scaled"], name="bn_mul"),
        helper.make_node("Add", ["scaled", "shift"], ["y"], name="bn_add"),
    ]
    model = build_model(nodes, [float_input("x", ["N", 6])], ["y"], inits)
    prepared, _ = prepare_model(model)
    assert _ops(prepared) == Counter({"Gemm": 1})
    assert [o.name for o in prepared.graph.output] == ["y"]
    _assert_same(model, prepared, (5, 6))


def _dense_bn(*, bias: bool = True, tied: bool = False, rank3: bool = False) -> onnx.ModelProto:
    """x -> MatMul(W) [-> Add(b)] -> Mul(scale) -> Add(shift) -> Relu -> y: a Keras Dense
    followed by BatchNormalization as tf2onnx writes them. With `tied`, another MatMul reads W
    too (it must keep the unscaled weight)."""
    rng = np.random.default_rng(3)
    inits = {
        "w": rng.standard_normal((6, CHANNELS)).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, CHANNELS).astype(np.float32),
        "shift": rng.standard_normal((1, CHANNELS)).astype(np.float32),
    }
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="dense")]
    source = "m"
    if bias:
        inits["b"] = rng.standard_normal(CHANNELS).astype(np.float32)
        nodes.append(helper.make_node("Add", ["m", "b"], ["mb"], name="bias"))
        source = "mb"
    nodes += [
        helper.make_node("Mul", [source, "scale"], ["scaled"], name="bn_mul"),
        helper.make_node("Add", ["scaled", "shift"], ["shifted"], name="bn_add"),
        helper.make_node("Relu", ["shifted"], ["y"], name="relu"),
    ]
    outputs = ["y"]
    if tied:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["z"], name="tied"))
        outputs.append("z")
    shape = ["N", 5, 6] if rank3 else ["N", 6]
    return build_model(nodes, [float_input("x", shape)], outputs, inits)


@pytest.mark.parametrize(("tied", "rank3"), [(False, False), (True, False), (False, True)],
                         ids=["dense", "shared weight", "sequence"])
def test_a_batchnorm_after_a_dense_layer_folds_into_its_matmul_and_bias(
        tied: bool, rank3: bool) -> None:
    model = _dense_bn(tied=tied, rank3=rank3)
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["Mul"] == 0
    assert _ops(prepared)["Add"] == 1  # the bias, holding the shift now
    if tied:  # the other reader keeps the weight as it was
        tied_node = next(n for n in prepared.graph.node if n.name == "tied")
        weights = {t.name: t for t in prepared.graph.initializer}
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(weights[tied_node.input[1]]),
                                      onnx.numpy_helper.to_array(weights["w"]))
    _assert_same(model, prepared, (4, 5, 6) if rank3 else (4, 6))


def test_without_a_bias_only_the_scale_folds_into_the_matmul() -> None:
    model = _dense_bn(bias=False)
    prepared, _ = prepare_model(model)
    # The Mul goes into the weight; the Add right after the MatMul is then its bias, and stays.
    assert _ops(prepared)["Mul"] == 0
    assert _ops(prepared)["Add"] == 1
    _assert_same(model, prepared, (4, 6))


def test_a_conv_bias_added_as_a_reshaped_constant_folds_into_the_conv() -> None:
    """paddle2onnx writes a Conv's bias as ``Add(conv, Reshape(bias, [1, C, 1, 1]))``: the
    reshape of constants folds to an initializer, and the Add into the Conv's bias, so an
    integer Conv needs no float Add after it."""
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(CHANNELS).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["bias", "shape"], ["bias4"], name="bias_view"),
        helper.make_node("Add", ["c", "bias4"], ["y"], name="bias_add"),
    ]
    inits = {"w": rng.standard_normal((CHANNELS, 3, 3, 3)).astype(np.float32), "bias": bias,
             "shape": np.array([1, CHANNELS, 1, 1], np.int64)}
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)
    prepared, steps = prepare_model(model)
    assert _ops(prepared) == Counter({"Conv": 1}), _ops(prepared)
    (conv,) = prepared.graph.node
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in prepared.graph.initializer}
    np.testing.assert_array_equal(stored[conv.input[2]], bias)
    assert [s.name for s in steps if s.name.startswith("fold")] == [
        "fold-constant-weights", "fold-batchnorm"]
    _assert_same(model, prepared, (2, 3, 8, 8))
