"""The layer-input sums bias correction needs, taken inside onnxruntime, against the same sums
taken in numpy (the reference path GPTQ still uses): the same integers on every Conv geometry,
MatMul and Gemm layout, with NaN, infinities and ties at half a code step in the data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qcal.calibration import hessians, layer_sums
from qcal.calibration.hessians import HessianTarget, collect_hessians, hessian_target
from qcal.config import CalibrationConfig
from qcal.numerics.onnx_mapping import OnnxQParams
from qcal.pipeline import calibrate

SCALE, ZERO = 0.05, 11
SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


NP_TYPES = {TensorProto.UINT8: np.uint8, TensorProto.INT8: np.int8, TensorProto.INT16: np.int16}


def _act(dtype: int = TensorProto.UINT8, zero: int = ZERO) -> OnnxQParams:
    np_type = NP_TYPES[dtype]
    return OnnxQParams(dtype=dtype, scale=np.array(SCALE, np.float32),
                       zero_point=np.array(zero, np_type), axis=None, clip_min=None,
                       clip_max=None, exact=True, deviations=(), replacement=None, min_opset=10)


def _model(node: onnx.NodeProto, x_shape: list, weight: np.ndarray, opset: int = 13,
           before: bool = False) -> onnx.ModelProto:
    """One layer reading `x` or, with `before`, a Neg of `x` (a value a node produces rather
    than a graph input)."""
    nodes = [node]
    if before:
        nodes = [helper.make_node("Neg", ["x"], ["x_neg"], name="neg"), node]
        node.input[0] = "x_neg"
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")],
        value_info=[helper.make_tensor_value_info("x_neg", TensorProto.FLOAT, x_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _awkward(rng: np.random.Generator, shape: tuple, nan: bool = True) -> np.ndarray:
    """Normal values with +-inf, huge values and exact ties at half a code step, and NaN
    (without `nan`: +inf alone, so that the whole holds no NaN and sums to no NaN either)."""
    x = rng.normal(size=shape).astype(np.float32) * 3
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, 40), replace=False)
    flat[picks[:4]] = np.nan if nan else 1e-3
    flat[picks[4:6]] = np.inf
    flat[picks[6:8]] = -np.inf if nan else -1e30  # huge values of both signs may sum to NaN
    flat[picks[8:10]] = 3e38
    flat[picks[10:]] = (rng.integers(-20, 20, size=picks[10:].size) + 0.5) * np.float32(SCALE)
    return x


def _both_ways(model: onnx.ModelProto, target: HessianTarget, batches: list,
               monkeypatch: pytest.MonkeyPatch, *, retakes: bool = True) -> tuple:
    """The layer's inputs measured as collect_hessians does it and in numpy alone; without
    `retakes`, no batch may be handed back to numpy."""
    with monkeypatch.context() as patch:
        if not retakes:
            patch.setattr(layer_sums.Retake, "tensor", _no_retake)
        in_onnxruntime = collect_hessians(model, [target], lambda: batches)[target.node]
    with monkeypatch.context() as patch:
        patch.setattr(hessians, "in_graph", lambda model, layers: [])
        in_numpy = collect_hessians(model, [target], lambda: batches)[target.node]
    return in_onnxruntime, in_numpy


def _no_retake(*args: object) -> None:
    raise AssertionError("a batch was taken in numpy")


def _assert_same(got: hessians.LayerInputs, expected: hessians.LayerInputs) -> None:
    assert got.hessian is None and expected.hessian is None
    assert got.count == expected.count
    assert got.sums.dtype == np.int64 and np.array_equal(got.sums, expected.sums)
    assert np.array_equal(got.real_sums, expected.real_sums)


CONVS = [  # (attributes, input shape, weight shape)
    ({"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2], "group": 2},
     (3, 4, 9, 8), (6, 2, 3, 2)),
    ({"pads": [0, 0, 0, 0]}, (2, 3, 5, 5), (4, 3, 1, 1)),
    ({"pads": [2, 2, 2, 2], "strides": [3, 3]}, (2, 3, 7, 6), (4, 3, 5, 5)),
    ({"pads": [1, 1, 1, 1], "group": 6}, (2, 6, 6, 5), (6, 1, 3, 3)),  # depthwise
    ({"pads": [0, 3, 0, 1], "strides": [2, 2], "dilations": [3, 1]}, (1, 2, 8, 4), (3, 2, 2, 4)),
    ({"pads": [1, 0, 0, 0]}, (2, 2, 2, 6), (3, 2, 3, 3)),  # kernel taller than the input
    ({"pads": [2, 1], "strides": [2], "dilations": [2]}, (2, 3, 11), (5, 3, 3)),  # 1-d
]


# (input a graph input or a node's output, the codes' type, NaN in the data)
VARIANTS = [(False, TensorProto.UINT8, True), (True, TensorProto.UINT8, False),
            (True, TensorProto.INT8, True), (False, TensorProto.INT16, True)]


@pytest.mark.parametrize(("attrs", "x_shape", "w_shape"), CONVS)
@pytest.mark.parametrize(("before", "dtype", "nan"), VARIANTS)
def test_conv_sums_in_onnxruntime_equal_numpys(
    attrs: dict, x_shape: tuple, w_shape: tuple, before: bool, dtype: int, nan: bool,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(len(x_shape) * 7 + x_shape[-1])
    weight = rng.normal(size=w_shape).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)
    model = _model(node, ["n", *x_shape[1:]], weight, before=before)
    act = _act(dtype, -3 if dtype == TensorProto.INT8 else ZERO)
    target = hessian_target(model.graph.node[-1], weight.shape, act, products=False)
    assert target is not None
    # 16-bit codes are summed in numpy
    assert layer_sums.in_graph(model, [target]) == ([] if dtype == TensorProto.INT16 else [target])
    x = _awkward(rng, x_shape, nan)
    batches = [({"x": x[i : i + 1]}, 1) for i in range(x.shape[0])]
    got, expected = _both_ways(model, target, batches, monkeypatch, retakes=nan)
    _assert_same(got, expected)
    whole, _ = _both_ways(model, target, [({"x": x}, x.shape[0])], monkeypatch)
    _assert_same(whole, expected)  # any batching: the same integers


@pytest.mark.parametrize(("dtype", "nan"), [(TensorProto.UINT8, True), (TensorProto.INT8, False),
                                            (TensorProto.INT16, True)])
def test_matmul_and_gemm_sums_in_onnxruntime_equal_numpys(
    dtype: int, nan: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(dtype)
    act = _act(dtype, -3 if dtype == TensorProto.INT8 else ZERO)
    cases = [
        (helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), ["n", 4, 5], (5, 3),
         (3, 4, 5)),
        (helper.make_node("Gemm", ["x", "w"], ["y"], name="gemm", transB=1), ["n", 5], (3, 5),
         (6, 5)),
        (helper.make_node("Gemm", ["x", "w"], ["y"], name="gemm_t", transA=1), [5, "m"], (5, 3),
         (5, 7)),
    ]
    for node, x_dims, w_shape, x_shape in cases:
        weight = rng.normal(size=w_shape).astype(np.float32)
        model = _model(node, x_dims, weight)
        target = hessian_target(model.graph.node[-1], weight.shape, act, products=False)
        assert target is not None
        got, expected = _both_ways(model, target, [({"x": _awkward(rng, x_shape, nan)}, 1)],
                                   monkeypatch, retakes=nan or dtype == TensorProto.INT16)
        _assert_same(got, expected)
        assert got.count > 0


def test_models_before_opset_13_and_gptq_targets_take_the_numpy_path() -> None:
    weight = np.ones((2, 3, 1, 1), np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv")
    old = _model(node, ["n", 3, 4, 4], weight, opset=12)
    target = hessian_target(old.graph.node[-1], weight.shape, _act(), products=False)
    assert target is not None and layer_sums.in_graph(old, [target]) == []
    x = np.arange(96, dtype=np.float32).reshape(2, 3, 4, 4) / 40
    measured = collect_hessians(old, [target], lambda: [({"x": x}, 2)])["conv"]
    codes = np.clip(np.rint(x / np.float32(SCALE)) + ZERO, 0, 255) - ZERO
    assert np.array_equal(measured.sums[0], codes.sum(axis=(0, 2, 3)))
    with_products = dataclasses.replace(target, products=True)
    # the whole input is needed for H: collect_hessians never asks the graph for those sums
    new = _model(helper.make_node("Conv", ["x", "w"], ["y"], name="conv"), ["n", 3, 4, 4],
                 weight)
    both = collect_hessians(new, [with_products], lambda: [({"x": x}, 2)])["conv"]
    assert both.hessian is not None and np.array_equal(both.sums, measured.sums)


def test_an_axis_too_long_for_exact_float32_sums_is_taken_in_numpy(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 2^24 / 255 positions along the first axis summed, float32 sums of codes may round:
    such a batch goes to numpy, and shorter ones in the same run stay in onnxruntime."""
    rng = np.random.default_rng(9)
    long = (1 << 24) // 255 + 1
    weight = rng.normal(size=(2, 1, 3, 1)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 0, 1, 0])
    model = _model(node, [1, 1, "h", 1], weight)
    target = hessian_target(model.graph.node[-1], weight.shape, _act(zero=0), products=False)
    assert target is not None
    taken = []
    original = layer_sums.Retake.tensor

    def counting(self: layer_sums.Retake, name: str, feed: dict) -> np.ndarray:
        taken.append(feed["x"].shape[2])
        return original(self, name, feed)

    monkeypatch.setattr(layer_sums.Retake, "tensor", counting)
    # codes 255 but one 254: the whole axis sums to 255 x long - 1, an odd number above 2^24
    # that float32 cannot hold
    x = np.full((1, 1, long, 1), 255 * SCALE, np.float32)
    x[0, 0, long // 2, 0] = 254 * SCALE
    assert 255 * long - 1 > 1 << 24
    short = rng.normal(size=(1, 1, 50, 1)).astype(np.float32)
    batches = [({"x": x}, 1), ({"x": short}, 1)]
    counted: list[int] = []
    got = collect_hessians(model, [target], lambda: batches, on_batch=counted.append)["conv"]
    assert taken == [long]
    assert counted == [1, 1]  # the progress sees every batch
    with monkeypatch.context() as patch:
        patch.setattr(hessians, "in_graph", lambda model, layers: [])
        expected = collect_hessians(model, [target], lambda: batches)["conv"]
    _assert_same(got, expected)


@pytest.mark.parametrize("name", ["digits_cnn", "transformer_block"])
def test_a_run_writes_the_same_model_with_the_sums_taken_either_way(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the bias-corrected model is byte for byte the same whether onnxruntime takes
    the layer-input sums or numpy does (as for a batch sent back to numpy)."""
    config = CalibrationConfig(fallback=False)
    calibrate(SAMPLES / f"{name}.onnx", config, output=tmp_path / "graph.onnx")
    monkeypatch.setattr(hessians, "in_graph", lambda model, layers: [])
    calibrate(SAMPLES / f"{name}.onnx", config, output=tmp_path / "numpy.onnx")
    assert (tmp_path / "graph.onnx").read_bytes() == (tmp_path / "numpy.onnx").read_bytes()
