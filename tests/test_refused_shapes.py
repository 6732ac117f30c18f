"""Dimensions onnx's data propagation states wrongly (a CANINE's attention Transpose, torch's
TorchScript export) make onnxruntime refuse qcal's prepared model where it loads the user's:
they are dropped, the element types kept, and the run goes on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _onnx_testing import float_input
from onnx import TensorProto, helper

from qcal.calibration.value_types import drop_refused_shapes
from qcal.config import CalibrationConfig
from qcal.pipeline import calibrate


def _reshaped(rng: np.random.Generator) -> onnx.ModelProto:
    """x [N, 128] -> Reshape to [N, 8, 16] by a shape computed at run time -> MatMul by a
    [16, 4] weight: onnxruntime cannot tell the Reshape's output from the graph alone."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0, name="batch"),
             helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0, name="target"),
             helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="project")]
    inits = {"zero": np.array([0], np.int64), "rest": np.array([8, 16], np.int64),
             "w": rng.standard_normal((16, 4)).astype(np.float32)}
    graph = helper.make_graph(
        nodes, "reshaped", [float_input("x", ["N", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 4])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _misstated(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with the Reshape's output stated [N, 16, 8] (it is [N, 8, 16])."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    del wrong.graph.value_info[:]
    wrong.graph.value_info.append(
        helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 16, 8]))
    return wrong


def test_dimensions_onnxruntime_refuses_are_dropped_and_types_kept() -> None:
    model = _misstated(_reshaped(np.random.default_rng(1)))
    detail = drop_refused_shapes(model)
    assert detail is not None and "onnxruntime refused them" in detail
    (stated,) = model.graph.value_info
    assert stated.type.tensor_type.elem_type == TensorProto.FLOAT
    assert not stated.type.tensor_type.HasField("shape")


def test_a_model_onnxruntime_loads_keeps_its_dimensions() -> None:
    model = _reshaped(np.random.default_rng(2))
    before = model.SerializeToString()
    assert drop_refused_shapes(model) is None
    assert model.SerializeToString() == before


def test_a_run_on_a_model_whose_stated_dimensions_onnxruntime_refuses_goes_on(
        tmp_path: Path) -> None:
    """The user's model states a wrong intermediate shape that qcal keeps (here by hand, as
    data propagation did): the run quantizes it and says what it dropped."""
    rng = np.random.default_rng(3)
    model = _misstated(_reshaped(rng))
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 128)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(
        data=tmp_path / "calib.npz", min_product_macs=0, fallback=False), enforce_gates=False)
    steps = {s["step"]: s["detail"] for s in result.report["input_model"]["preparation"]}
    assert "onnxruntime refused them" in steps["onnxruntime-shapes"]
    assert result.report["evaluation"]["outputs"][0]["sqnr_db"] > 20
    onnx.checker.check_model(result.model)
