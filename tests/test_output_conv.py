"""A Conv that writes a graph output runs in integers: onnxruntime fuses DequantizeLinear ->
Conv -> QuantizeLinear into its integer Conv only before a QuantizeLinear, so the Conv's value
is renamed, quantized, and the graph output written by a DequantizeLinear, under the same name
and type. Without that pair the Conv ran in float on dequantized weights and was kept float (a
style-transfer network's last Conv, a third of its work: exit 7 on the coverage floor). The
same holds for any integer kernel whose graph output other nodes read too (a classifier's
features beside the logits its head computes from them): onnxruntime fuses the QuantizeLinear
only when it is the value's only reader and the value no graph output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, optimized_ops, run_optimized, sqnr_db
from _pipeline_testing import calibrated_as_planned
from onnx import helper


def test_a_conv_writing_a_graph_output_runs_as_an_integer_conv(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["image"], name="last",
                         pads=[4, 4, 4, 4]),
    ]
    inits = {"w0": rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1,
             "b0": rng.standard_normal(32).astype(np.float32) * 0.1,
             "w1": rng.standard_normal((3, 32, 9, 9)).astype(np.float32) * 0.03,
             "b1": rng.standard_normal(3).astype(np.float32) * 0.1}
    model = build_model(nodes, [float_input("x", ["N", 16, 24, 24])], ["image"], inits)
    x = rng.standard_normal((24, 16, 24, 24)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    onnx.checker.check_model(result.model, full_check=True)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["last"]["quantized"], decisions["last"]["reason"]
    assert result.report["coverage"]["macs_quantized_fraction"] == 1.0
    (output,) = result.model.graph.output
    assert output.name == "image" and output.type == model.graph.output[0].type
    writer = next(n for n in result.model.graph.node if "image" in n.output)
    assert writer.op_type == "DequantizeLinear"

    ran = optimized_ops(result.model, tmp_path)
    assert ran["QLinearConv"] == 2 and "Conv" not in ran and "FusedConv" not in ran
    (ours,), (theirs,) = run_optimized(result.model, {"x": x}), run_optimized(model, {"x": x})
    assert sqnr_db(theirs, ours) > 25
    # on the grid of its calibrated range: every value a step's multiple from the zero point
    record = next(t for t in result.report["tensors"] if t["name"] == "image")
    scale, zero = record["onnx"]["scale"][0], record["onnx"]["zero_point"][0]
    codes = ours / np.float32(scale) + zero
    assert np.abs(codes - np.round(codes)).max() < 1e-2



@pytest.mark.parametrize("shown", ["conv", "relu"])
def test_a_conv_output_read_on_and_shown_runs_as_an_integer_conv(tmp_path: Path,
                                                                  shown: str) -> None:
    """Conv -> Relu -> Conv, where the model also returns the first Conv's value, or its
    Relu's (fused with it): the first Conv ran in float, 33 % of the MACs."""
    rng = np.random.default_rng(11)
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["y"], name="conv1", pads=[1, 1, 1, 1]),
    ]
    inits = {"w0": rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1,
             "b0": rng.standard_normal(32).astype(np.float32) * 0.1,
             "w1": rng.standard_normal((32, 32, 3, 3)).astype(np.float32) * 0.1,
             "b1": rng.standard_normal(32).astype(np.float32) * 0.1}
    returned = {"conv": "c0", "relu": "r0"}[shown]
    model = build_model(nodes, [float_input("x", ["N", 16, 24, 24])], ["y", returned], inits)
    x = rng.standard_normal((24, 16, 24, 24)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    onnx.checker.check_model(result.model, full_check=True)
    assert all(d["quantized"] for d in result.report["nodes"]), result.report["nodes"]
    assert result.report["coverage"]["macs_quantized_fraction"] == 1.0
    _written_by_a_dequantize(result.model, model, returned)
    ran = optimized_ops(result.model, tmp_path)
    assert ran["QLinearConv"] == 2 and "Conv" not in ran and "FusedConv" not in ran
    ours, theirs = run_optimized(result.model, {"x": x}), run_optimized(model, {"x": x})
    assert min(sqnr_db(f, q) for f, q in zip(theirs, ours)) > 25


def test_features_returned_beside_logits_run_as_an_integer_gemm(tmp_path: Path) -> None:
    """A Gemm's features, returned and read by the head's Relu -> Gemm: the feature layer,
    84 % of the MACs, ran in float (16 % quantized)."""
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["features"], name="embed", transB=1),
        helper.make_node("Relu", ["features"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w1", "b1"], ["logits"], name="head", transB=1),
    ]
    inits = {"w0": rng.standard_normal((512, 512)).astype(np.float32) * 0.05,
             "b0": rng.standard_normal(512).astype(np.float32) * 0.1,
             "w1": rng.standard_normal((100, 512)).astype(np.float32) * 0.05,
             "b1": rng.standard_normal(100).astype(np.float32) * 0.1}
    model = build_model(nodes, [float_input("x", ["N", 512])], ["logits", "features"], inits)
    x = rng.standard_normal((32, 8, 512)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    onnx.checker.check_model(result.model, full_check=True)
    assert all(d["quantized"] for d in result.report["nodes"]), result.report["nodes"]
    _written_by_a_dequantize(result.model, model, "features")
    ran = optimized_ops(result.model, tmp_path)
    assert "Gemm" not in ran and "FusedGemm" not in ran and "MatMul" not in ran, ran
    ours = run_optimized(result.model, {"x": x[0]})
    theirs = run_optimized(model, {"x": x[0]})
    assert min(sqnr_db(f, q) for f, q in zip(theirs, ours)) > 25


def _written_by_a_dequantize(quantized: onnx.ModelProto, model: onnx.ModelProto,
                             name: str) -> None:
    """The graph output `name` keeps its place, name and type, written by a DequantizeLinear."""
    assert [o.name for o in quantized.graph.output] == [o.name for o in model.graph.output]
    assert [o.type for o in quantized.graph.output] == [o.type for o in model.graph.output]
    writer = next(n for n in quantized.graph.node if name in n.output)
    assert writer.op_type == "DequantizeLinear"
