"""An embedding lookup whose looked-up vectors only Conv/MatMul/Gemm nodes read: the lookup
stays float (a default exclusion, `qcal.graph.traps`), the vectors are quantized as the input
their integer kernels need."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _onnx_testing import build_model, optimized_ops, run_optimized, sqnr_db
from _pipeline_testing import calibrated_as_planned
from onnx import helper


def test_a_looked_up_vector_read_by_a_gemm_is_its_quantized_input(tmp_path: Path) -> None:
    """A decoder step: an embedding lookup read by a Gemm alone. The lookup stays float (a
    default exclusion), but the Gemm reads its vector quantized: kept float, the vector kept
    the Gemm in float (a transliterator's decoder step, 19 % of its work, and exit 7 on
    coverage at 69.95 %)."""
    rng = np.random.default_rng(13)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["vec"], name="embed"),
        helper.make_node("Gemm", ["vec", "w0", "b0"], ["h"], name="project", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w1", "b1"], ["logits"], name="head", transB=1),
    ]
    inits = {"table": rng.standard_normal((300, 256)).astype(np.float32),
             "w0": rng.standard_normal((512, 256)).astype(np.float32) * 0.05,
             "b0": rng.standard_normal(512).astype(np.float32) * 0.1,
             "w1": rng.standard_normal((300, 512)).astype(np.float32) * 0.05,
             "b1": rng.standard_normal(300).astype(np.float32) * 0.1}
    ids = helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N"])
    model = build_model(nodes, [ids], ["logits"], inits)
    samples = rng.integers(0, 300, (64, 4)).astype(np.int64)
    result = calibrated_as_planned(model, tmp_path, ids=samples)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert not decisions["embed"]["quantized"]
    assert "embedding lookup" in decisions["embed"]["reason"]
    assert decisions["project"]["quantized"] and decisions["head"]["quantized"]
    assert result.report["coverage"]["macs_quantized_fraction"] == 1.0
    ran = optimized_ops(result.model, tmp_path)
    assert "Gemm" not in ran and "FusedGemm" not in ran and ran["Gather"] == 1, ran
    feed = {"ids": samples[0]}
    (ours,), (theirs,) = run_optimized(result.model, feed), run_optimized(model, feed)
    assert sqnr_db(theirs, ours) > 25
