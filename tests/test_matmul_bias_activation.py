"""A dense layer written as MatMul, a bias Add and a Relu/Clip on a 2-D input (skl2onnx and
paddle2onnx write every dense layer so): onnxruntime fuses MatMul and Add into a Gemm, then the
activation into it, so the activation's output is quantized and the layer runs as one integer
kernel, as when the exporter wrote the Gemm itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, optimized_ops, run_optimized, sqnr_db
from _pipeline_testing import calibrated_as_planned
from onnx import helper


def _mlp(activation: str, widths: tuple[int, ...], rng: np.random.Generator) -> onnx.ModelProto:
    """x [N, widths[0]] -> (MatMul, Add, activation) per hidden width -> MatMul, Add -> logits."""
    nodes, inits, value = [], {}, "x"
    layers = len(widths) - 1
    for k in range(layers):
        inits[f"w{k}"] = (rng.standard_normal((widths[k], widths[k + 1])) /
                          np.sqrt(widths[k])).astype(np.float32)
        inits[f"b{k}"] = (0.1 * rng.standard_normal(widths[k + 1])).astype(np.float32)
        nodes += [helper.make_node("MatMul", [value, f"w{k}"], [f"m{k}"], name=f"matmul{k}"),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"], name=f"add{k}")]
        value = f"a{k}"
        if k < layers - 1:
            extra = ["", "lim"] if activation == "Clip" else []
            nodes.append(helper.make_node(activation, [value, *extra], [f"r{k}"],
                                          name=f"act{k}"))
            value = f"r{k}"
    nodes[-1].output[0] = "logits"
    if activation == "Clip":
        inits["lim"] = np.array(6.0, np.float32)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", widths[0]])
    return build_model(nodes, [x], ["logits"], inits)


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_a_matmul_with_its_bias_add_and_activation_runs_as_one_integer_gemm(
        tmp_path: Path, activation: str) -> None:
    """Before, the activation read by the bias Add was not seen as fused: its output stayed
    float, onnxruntime made a float FusedGemm of the three on dequantized weights, the check
    against its graph kept each layer float, and with it the layer before: 0 % of an MLP of
    this form quantized (exit 7 on coverage), 99 % of the same weights written as Gemms."""
    rng = np.random.default_rng(21)
    model = _mlp(activation, (512, 1024, 1024, 10), rng)
    samples = rng.standard_normal((64, 512)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=samples)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    for k in (0, 1):
        assert decisions[f"matmul{k}"]["quantized"] and decisions[f"act{k}"]["quantized"]
        assert not decisions[f"add{k}"]["quantized"]  # an int32 bias of the Gemm
    assert result.report["coverage"]["macs_quantized_fraction"] > 0.98
    ran = optimized_ops(result.model, tmp_path)
    assert ran.get("QGemm") == 2, ran
    assert "FusedGemm" not in ran and "MatMul" not in ran and ran.get("Gemm", 0) <= 1, ran
    feed = {"x": samples[:8]}
    (ours,), (theirs,) = run_optimized(result.model, feed), run_optimized(model, feed)
    assert sqnr_db(theirs, ours) > 25
