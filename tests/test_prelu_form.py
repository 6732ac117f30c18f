"""PRelu between integer operators: onnxruntime's float kernel for it is slow, so the Q/DQ
writer spells it as Clips of its input's codes and a depthwise 1 x 1 Conv of the slopes, which
onnxruntime runs on the integers; the output's codes are those of the float PRelu between the
same pair."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from _pipeline_testing import calibrated_as_planned
from onnx import TensorProto, helper, numpy_helper

from qcal.config import CalibrationConfig
from qcal.graph.qdq._integer_forms import write_integer_forms
from qcal.pipeline import calibrate

_SLOPES = np.array([0.25, -1.5, 3.0, 0.0], np.float32)


def _prelu_between_pair(slope: np.ndarray, x_zero: int, *, stated: bool = True) -> onnx.ModelProto:
    """codes -> DequantizeLinear -> PRelu -> QuantizeLinear -> codes, 4 channels of 16 x 16,
    each channel holding every one of the 256 input codes."""
    nodes = [
        helper.make_node("DequantizeLinear", ["codes", "x_scale", "x_zero"], ["x"], name="dq"),
        helper.make_node("PRelu", ["x", "slope"], ["y"], name="act"),
        helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero"], ["out"], name="q"),
    ]
    initializers = [
        numpy_helper.from_array(np.float32(0.05), "x_scale"),
        numpy_helper.from_array(np.uint8(x_zero), "x_zero"),
        numpy_helper.from_array(np.float32(0.07), "y_scale"),
        numpy_helper.from_array(np.uint8(100), "y_zero"),
        numpy_helper.from_array(slope, "slope"),
    ]
    graph = helper.make_graph(
        nodes, "prelu",
        [helper.make_tensor_value_info("codes", TensorProto.UINT8, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.UINT8, [1, 4, 16, 16])],
        initializers,
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])]
        if stated else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _conv_prelu_conv(rng: np.random.Generator, *extra: onnx.NodeProto,
                     outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    """Conv -> PRelu (16 slopes in [0, 0.5)) -> 1x1 Conv -> global pooling on 8 x 16 x 16
    inputs, with `extra` nodes after them."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c1", "s1"], ["p1"], name="prelu1"),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="gap"),
        *extra,
    ]
    inits = {
        "w1": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "s1": rng.uniform(0, 0.5, (16, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((4, 16, 1, 1)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(4).astype(np.float32) * 0.1,
    }
    return build_model(nodes, [float_input("x", ["N", 8, 16, 16])], list(outputs), inits)


def _run(model: onnx.ModelProto, codes: np.ndarray, folder: Path | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if folder is None:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    else:
        options.optimized_model_filepath = str(folder / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"codes": codes})[0]).astype(np.int64)


@pytest.mark.parametrize("x_zero", [120, 0])
def test_the_prelu_form_writes_the_codes_of_the_float_prelu(tmp_path: Path, x_zero: int) -> None:
    """Every input code in every channel (slopes below 0, 0, between, above 1): the written
    form gives numpy's PRelu of the input quantized on the output's grid, to a code where
    onnxruntime rounds an exact tie the other way, as the float PRelu between the pair does;
    onnxruntime runs it with no PRelu and the slope Conv in its integer kernel. With a zero
    point at the lowest code (no negative inputs) only the positive part is left."""
    model = _prelu_between_pair(_SLOPES.reshape(4, 1, 1), x_zero)
    codes = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (1, 4, 1, 1))
    original = _run(model, codes)
    assert write_integer_forms(model, frozenset({"act"})) == 1
    onnx.checker.check_model(model, full_check=True)
    assert "PRelu" not in {n.op_type for n in model.graph.node}
    written, fused = _run(model, codes), _run(model, codes, tmp_path)

    x = (codes.astype(np.float32) - x_zero) * np.float32(0.05)
    y = np.where(x >= 0, x, x * _SLOPES.reshape(1, 4, 1, 1))
    expected = np.clip(np.rint(y / np.float32(0.07)).astype(np.int64) + 100, 0, 255)
    for result in (original, written, fused):
        assert np.abs(result - expected).max() <= 1 and (result == expected).mean() >= 0.99
    optimized = {n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node}
    assert "PRelu" not in optimized
    assert ("QLinearConv" in optimized) == (x_zero != 0)


@pytest.mark.parametrize("case", ["along the last axis", "unstated shape", "not a constant"])
def test_a_prelu_the_form_does_not_fit_stays_as_written(case: str) -> None:
    """Slopes that vary along another axis than the channels, a tensor whose channels the graph
    does not state, slopes computed at run time: the PRelu stays, in float between its pair."""
    slope = np.linspace(-1, 1, 16, dtype=np.float32) if case == "along the last axis" \
        else _SLOPES.reshape(4, 1, 1)
    model = _prelu_between_pair(slope, 120, stated=case != "unstated shape")
    if case == "not a constant":
        model.graph.node.insert(0, helper.make_node("Identity", ["slope"], ["slope_copy"]))
        model.graph.node[2].input[1] = "slope_copy"
    before = model.SerializeToString()
    assert write_integer_forms(model, frozenset({"act"})) == 0
    assert model.SerializeToString() == before


def test_a_prelu_between_convs_is_quantized_in_its_integer_form(tmp_path: Path) -> None:
    """A plain run on Conv -> PRelu -> Conv -> PRelu -> Conv -> pooling (a MediaPipe block's
    shape): both PRelus are quantized and spelled out, onnxruntime runs no PRelu, and the
    model's output stays near the float model's."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c1", "s1"], ["p1"], name="prelu1"),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c2", "s2"], ["p2"], name="prelu2"),
        helper.make_node("Conv", ["p2", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="gap"),
    ]
    inits = {
        "w1": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "s1": rng.uniform(-1, 3, (16, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.2,
        "b2": rng.standard_normal(16).astype(np.float32) * 0.1,
        "s2": np.full((1, 16, 1, 1), 0.25, np.float32),
        "w3": rng.standard_normal((4, 16, 1, 1)).astype(np.float32) * 0.3,
        "b3": rng.standard_normal(4).astype(np.float32) * 0.1,
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 24, 24])], ["y"], inits)
    x = rng.standard_normal((32, 8, 24, 24)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["prelu1"]["quantized"] and decisions["prelu2"]["quantized"]
    onnx.checker.check_model(result.model, full_check=True)
    assert "PRelu" not in {n.op_type for n in result.model.graph.node}

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(result.model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    assert "PRelu" not in {n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node}
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours, theirs = session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0]
    sqnr = 10 * np.log10(np.sum(theirs ** 2) / np.sum((theirs - ours) ** 2))
    assert sqnr > 25


def test_a_form_onnxruntime_cannot_run_keeps_its_node_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a written form break onnxruntime (here a slope Conv whose weight has one
    dimension too few), the failure names a node the writer named after the PRelu, or the
    node onnxruntime fused from it: that PRelu is kept float, with onnxruntime's words, and
    the run goes on instead of stopping at a model it cannot run."""
    import qcal.graph.qdq._prelu_form as prelu_form

    right = prelu_form._channel_slopes

    def one_dimension_short(slope: np.ndarray, dims: Any) -> np.ndarray | None:
        found = right(slope, dims)
        return None if found is None else found.reshape(found.shape[0], 1)

    monkeypatch.setattr(prelu_form, "_channel_slopes", one_dimension_short)
    rng = np.random.default_rng(4)
    result = calibrated_as_planned(
        _conv_prelu_conv(rng), tmp_path,
        x=rng.standard_normal((16, 8, 16, 16)).astype(np.float32))
    decision = next(n for n in result.report["nodes"] if n["name"] == "prelu1")
    assert not decision["quantized"]
    assert "kept float: onnxruntime cannot run it quantized" in decision["reason"]
    assert "PRelu" in {n.op_type for n in result.model.graph.node}
    ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_prelu_with_a_float_reader_keeps_its_integer_form(tmp_path: Path) -> None:
    """A float node beside the integer Conv reading the PRelu's output (here an Exp) reads its
    DequantizeLinear, as for any integer kernel's output: the QuantizeLinear stays the PRelu's
    only reader, so the form still applies and onnxruntime runs no PRelu."""
    rng = np.random.default_rng(6)
    beside = [helper.make_node("Exp", ["p1"], ["e"], name="exp"),
              helper.make_node("ReduceMean", ["e"], ["z"], name="mean", keepdims=0)]
    onnx.save(_conv_prelu_conv(rng, *beside, outputs=("y", "z")), tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 8, 16, 16)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(
        data=tmp_path / "calib.npz", fallback=False, allow_slower=True))
    assert "PRelu" not in {n.op_type for n in result.model.graph.node}
    exp = next(n for n in result.model.graph.node if n.name == "exp")
    writer = next(n for n in result.model.graph.node if exp.input[0] in n.output)
    assert writer.op_type == "DequantizeLinear"
