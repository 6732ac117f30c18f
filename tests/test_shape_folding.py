"""Shapes computed at run time fold as onnxruntime folds them, so the plan sees the static
shapes onnxruntime sees: a MatMul and its bias Add that onnxruntime makes one Gemm get an int32
bias, and the Gemm runs in integers."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import prepare_model
from qcal.pipeline import calibrate


def _windowed_dense_model(rng: np.random.Generator) -> onnx.ModelProto:
    """A Swin/MobileViT-like block written as TorchScript writes it: the padding to a multiple
    of the window is computed from the Shape of a Conv's output (Gather, Mod, Sub), the padded
    size through floats (Cast, Div, Ceil, Mul, Cast); the tokens broadcast by an Expand to a
    shape a Where chooses on a comparison of constants (a BERT-like encoder's token types); then
    tokens [1, 64, 8] -> MatMul -> Add(bias) -> Tanh."""
    c = {
        "w": rng.standard_normal((8, 8, 1, 1)).astype(np.float32) * 0.4,
        "two": np.array(2, np.int64), "window": np.array(4, np.int64),
        "window_f": np.array(4.0, np.float32), "zeros6": np.zeros(6, np.int64),
        "axis0": np.array([0], np.int64), "one": np.array(1, np.int64),
        "also_one": np.array(1, np.int64), "tokens": np.array([1, -1, 8], np.int64),
        "ones": np.ones(3, np.int64), "twos": np.full(3, 2, np.int64),
        "dense": rng.standard_normal((8, 16)).astype(np.float32) * 0.3,
        "bias": rng.standard_normal(16).astype(np.float32) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Shape", ["c"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "two"], ["height"], name="height"),
        helper.make_node("Mod", ["height", "window"], ["rest"], name="rest"),
        helper.make_node("Sub", ["window", "rest"], ["short"], name="short"),
        helper.make_node("Mod", ["short", "window"], ["pad"], name="pad"),
        helper.make_node("Unsqueeze", ["pad", "axis0"], ["pad1"], name="pad1"),
        helper.make_node("Cast", ["height"], ["height_f"], name="height_f", to=1),
        helper.make_node("Div", ["height_f", "window_f"], ["windows_f"], name="windows_f"),
        helper.make_node("Ceil", ["windows_f"], ["windows_up"], name="windows_up"),
        helper.make_node("Mul", ["windows_up", "window_f"], ["padded_f"], name="padded_f"),
        helper.make_node("Cast", ["padded_f"], ["padded"], name="padded", to=7),
        helper.make_node("Sub", ["padded", "height"], ["pad_again"], name="pad_again"),
        helper.make_node("Unsqueeze", ["pad_again", "axis0"], ["pad2"], name="pad2"),
        helper.make_node("Concat", ["zeros6", "pad1", "pad2"], ["pads"], name="pads", axis=0),
        helper.make_node("Pad", ["c", "pads"], ["padded_map"], name="pad_map"),
        helper.make_node("Transpose", ["padded_map"], ["channels_last"], name="to_nhwc",
                         perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["channels_last", "tokens"], ["seq"], name="to_tokens"),
        helper.make_node("Equal", ["one", "also_one"], ["same"], name="same"),
        helper.make_node("Where", ["same", "ones", "twos"], ["broadcast"], name="broadcast"),
        helper.make_node("Expand", ["seq", "broadcast"], ["expanded"], name="expand"),
        helper.make_node("MatMul", ["expanded", "dense"], ["m"], name="dense"),
        helper.make_node("Add", ["m", "bias"], ["a"], name="dense_bias"),
        helper.make_node("Tanh", ["a"], ["y"], name="post"),
    ]
    return build_model(nodes, [float_input("x", [1, 8, 6, 6])], [float_input("y", [1, 64, 16])], c)


def test_shapes_computed_from_a_static_input_fold_to_constants() -> None:
    rng = np.random.default_rng(31)
    model = _windowed_dense_model(rng)
    prepared, steps = prepare_model(model)
    computed = {n.name for n in prepared.graph.node}
    assert computed == {"conv", "pad_map", "to_nhwc", "to_tokens", "expand", "dense",
                        "dense_bias", "post"}, computed
    assert any(s.name == "fold-constant-shapes" for s in steps)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None
                       for d in v.type.tensor_type.shape.dim] for v in prepared.graph.value_info}
    assert shapes["expanded"] == [1, 64, 8], shapes["expanded"]
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in prepared.graph.initializer}
    np.testing.assert_array_equal(folded["pads"], [0, 0, 0, 0, 0, 0, 2, 2])
    x = rng.standard_normal((2, 1, 8, 6, 6)).astype(np.float32)
    for sample in x:  # the model computes what it did
        want = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": sample})
        got = ort.InferenceSession(prepared.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": sample})
        np.testing.assert_array_equal(got[0], want[0])


def test_the_dense_layer_after_computed_shapes_runs_as_an_integer_gemm(tmp_path: Path) -> None:
    """With the tokens' shape unknown to the plan, the bias stayed a float Add; onnxruntime,
    folding the same chains, fused MatMul and Add into a Gemm with a float bias on dequantized
    weights, and the check against its graph kept the layer float: nothing ran in integers."""
    rng = np.random.default_rng(32)
    model = _windowed_dense_model(rng)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 8, 6, 6)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(min_product_macs=0, 
        data=tmp_path / "calib.npz", fallback=False, allow_slower=True))
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["dense"] and decisions["conv"], result.report["nodes"]
    assert result.report["coverage"]["macs_quantized_fraction"] == 1.0
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(result.model.SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    ops = Counter(n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node)
    assert ops["QGemm"] == 1 and not {"Gemm", "FusedGemm", "MatMul"} & set(ops), ops


def test_the_shape_of_a_tensor_with_a_free_axis_stays_computed() -> None:
    """An input of free batch: its Conv's Shape is not a constant, and neither is what the
    model computes from it; the prepared model still takes any batch."""
    rng = np.random.default_rng(33)
    model = _windowed_dense_model(rng)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    prepared, _ = prepare_model(model)
    assert {"shape", "height", "pad_map"} <= {n.name for n in prepared.graph.node}
    x = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    session = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], original.run(None, {"x": x})[0])


def test_folding_a_log_of_zero_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """T5's relative-position buckets take a log of 0 on a branch a Where then drops: folded,
    numpy's warnings went to the user's terminal."""
    nodes = [
        helper.make_node("Log", ["raw"], ["logs"], name="log"),
        helper.make_node("Where", ["positive", "logs", "raw"], ["weight"], name="pick"),
        helper.make_node("MatMul", ["x", "weight"], ["y"], name="dense"),
    ]
    raw = np.array([[0.0, 2.0], [3.0, 0.0]], np.float32)
    constants = {"raw": raw, "positive": raw > 0}
    model = build_model(nodes, [float_input("x", [1, 2])], [float_input("y", [1, 2])], constants)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared, _ = prepare_model(model)
    assert capfd.readouterr().err == ""
    assert [n.name for n in prepared.graph.node] == ["dense"]
    weight = next(t for t in prepared.graph.initializer if t.name == "weight")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(weight),
                                  np.where(raw > 0, np.log(np.maximum(raw, 1e-30)), raw))


def test_what_an_if_condition_is_computed_from_stays_computed() -> None:
    """Made a constant, an If's condition lets onnxruntime inline the branch it picks and
    check its shapes, which onnx's own AffineGrid expansion fails although the model runs: the
    Size of a static input and its comparison stay as they are when an If reads the result."""
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                                    [float_input("t", [4])])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                    [float_input("e", [4])])
    nodes = [
        helper.make_node("Size", ["x"], ["size"], name="size"),
        helper.make_node("Equal", ["size", "four"], ["is_four"], name="is_four"),
        helper.make_node("If", ["is_four"], ["y"], name="choose", then_branch=then_branch,
                         else_branch=else_branch),
    ]
    model = build_model(nodes, [float_input("x", [4])], [float_input("y", [4])],
                        {"four": np.array(4, np.int64)})
    prepared, _ = prepare_model(model)
    assert [n.name for n in prepared.graph.node] == ["size", "is_four", "choose"]
