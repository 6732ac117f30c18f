"""Accuracy you can gate on: default exclusions, automatic float fallback, coverage and gates.

The trap model below holds the three patterns that break naive full quantization: an embedding
of byte inputs whose common rows are small, an RMS normalization written out as elementwise ops,
and a softmax over attention logits. Every figure checked here is recomputed in the test from
the written QDQ model (onnxruntime outputs, MACs from the graph), not read from qcal alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, read_rounded, run
from _pipeline_testing import calibrate_capturing_sensitivity, save_with_data
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import qcal._accuracy_stage as accuracy_stage
from qcal.accuracy.coverage import Coverage, measure_coverage
from qcal.accuracy.evaluate import Comparison, OutputMetrics
from qcal.accuracy.fallback import CONFIRMATIONS, Candidate, Missed, search_fallback
from qcal.accuracy.macs import compute_macs, shape_probe
from qcal.accuracy.restrict import restrict_plan
from qcal.accuracy.sensitivity import TensorSensitivity
from qcal.accuracy.target import AccuracyTarget
from qcal.calibration.data import sample_digest
from qcal.calibration.runtime import create_session
from qcal.cli import main
from qcal.config import CalibrationConfig
from qcal.graph.integer_kernels import integer_output_writers
from qcal.graph.model import SelectionRules, plan_quantization, prepare_model
from qcal.numerics.errors import AccuracyGateError, ConfigError, ModelError
from qcal.pipeline import calibrate
from qcal.report import report_schema

SAMPLE_MODELS = Path(__file__).resolve().parents[1] / "sample_models"
VOCAB, LENGTH, WIDTH, CLASSES = 256, 12, 16, 10


# ------------------------------------------------------------------------------- the models


def trap_model(seed: int = 0) -> onnx.ModelProto:
    """bytes -> embedding (+ positions) -> explicit RMSNorm -> attention -> mean -> logits."""
    rng = np.random.default_rng(seed)
    printable = (np.arange(VOCAB) >= 32) & (np.arange(VOCAB) < 127)
    norms = np.where(printable, 0.05, 4.0)  # rare bytes have large vectors, text bytes small
    inits = {
        "table": (rng.standard_normal((VOCAB, WIDTH)) * norms[:, None] / 4).astype(np.float32),
        "pos": (0.01 * rng.standard_normal((LENGTH, WIDTH))).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, WIDTH).astype(np.float32),
        "eps": np.array(1e-6, np.float32),
        "wq": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
        "wk": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
        "wv": (rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32),
        "head": (rng.standard_normal((WIDTH, CLASSES)) / 4).astype(np.float32),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["table", "bytes"], ["emb"], name="embed"),
        n("Add", ["emb", "pos"], ["x"], name="add_pos"),
        n("Mul", ["x", "x"], ["x_sq"], name="rms_square"),
        n("ReduceMean", ["x_sq"], ["ms"], name="rms_mean", axes=[-1], keepdims=1),
        n("Add", ["ms", "eps"], ["ms_eps"], name="rms_add_eps"),
        n("Sqrt", ["ms_eps"], ["rms"], name="rms_sqrt"),
        n("Reciprocal", ["rms"], ["inv_rms"], name="rms_reciprocal"),
        n("Mul", ["x", "inv_rms"], ["x_normed"], name="rms_normalize"),
        n("Mul", ["x_normed", "gamma"], ["h"], name="rms_gamma"),
        n("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "wk"], ["k"], name="k_proj"),
        n("MatMul", ["h", "wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["k_t"], name="k_transpose", perm=[0, 2, 1]),
        n("MatMul", ["q", "k_t"], ["scores"], name="scores"),
        n("Softmax", ["scores"], ["attn"], name="softmax", axis=-1),
        n("MatMul", ["attn", "v"], ["ctx"], name="context"),
        n("ReduceMean", ["ctx"], ["pooled"], name="pool", axes=[1], keepdims=0),
        n("MatMul", ["pooled", "head"], ["logits"], name="classifier"),
    ]
    inputs = [helper.make_tensor_value_info("bytes", TensorProto.INT64, ["N", LENGTH])]
    return build_model(nodes, inputs, ["logits"], inits)


def byte_texts(rng: np.random.Generator, count: int) -> np.ndarray:
    """Lowercase text on one of ten topics (a run of six letters), 3 % rare bytes."""
    start = 97 + 2 * rng.integers(0, 10, size=(count, 1))
    data = start + rng.integers(0, 6, size=(count, LENGTH))
    rare = rng.random((count, LENGTH)) < 0.03
    data[rare] = rng.integers(128, 256, size=int(rare.sum()))
    return data.astype(np.int64)


@pytest.fixture(scope="module")
def trap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("trap")
    path = folder / "trap.onnx"
    onnx.save(trap_model(), path)
    rng = np.random.default_rng(1)
    np.savez(folder / "trap.calib.npz", bytes=byte_texts(rng, 64))
    np.savez(folder / "trap.eval.npz", bytes=byte_texts(rng, 200))
    return path


def run_both(float_path: Path, quant: onnx.ModelProto, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    x = create_session(onnx.load(float_path)).run(None, feed)[0]
    y = create_session(quant).run(None, feed)[0]
    return np.asarray(x, np.float64), np.asarray(y, np.float64)


def sqnr_db(x: np.ndarray, y: np.ndarray) -> float:
    return 10 * math.log10(float((x**2).sum()) / float(((x - y) ** 2).sum()))


def quantized_matmul_macs(quant: onnx.ModelProto, float_model: onnx.ModelProto,
                          feed: dict[str, np.ndarray]) -> tuple[int, int]:
    """(quantized, total) MACs of the MatMuls, from the written graph and measured shapes:
    a MatMul counts as quantized when both its inputs come out of a DequantizeLinear."""
    producers = {o: node for node in quant.graph.node for o in node.output}
    exposed = onnx.ModelProto()
    exposed.CopyFrom(float_model)
    matmuls = [node for node in float_model.graph.node if node.op_type == "MatMul"]
    names = sorted({t for node in matmuls for t in (node.input[0], node.output[0])})
    for name in names:
        exposed.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    shapes = dict(zip(names, (a.shape for a in create_session(exposed).run(names, feed))))
    done = total = 0
    by_name = {node.name: node for node in quant.graph.node}
    for node in matmuls:
        macs = int(np.prod(shapes[node.output[0]])) * shapes[node.input[0]][-1]
        total += macs
        written = by_name[node.name]
        if all(producers.get(t) is not None and producers[t].op_type == "DequantizeLinear"
               for t in written.input):
            done += macs
    return done, total


# ------------------------------------------------------------------ defaults and fallback


def test_defaults_restore_what_naive_full_quantization_breaks(trap: Path) -> None:
    feed = {"bytes": np.load(trap.with_name("trap.eval.npz"))["bytes"]}
    naive = calibrate(trap, CalibrationConfig(default_exclusions=False, placement="all",
                                              fallback=False))
    default = calibrate(trap, CalibrationConfig(placement="all", fallback=False))
    # Placement "auto" alone, without the default exclusions, keeps the traps float too: none
    # of them lies between quantized anchors.
    placed = calibrate(trap, CalibrationConfig(default_exclusions=False, fallback=False))
    agreement = {}
    for name, result in (("naive", naive), ("default", default), ("placed", placed)):
        x, y = run_both(trap, result.model, feed)
        agreement[name] = float(np.mean(x.argmax(1) == y.argmax(1)))
        assert result.report["evaluation"]["outputs"][0]["top1_agreement"] == pytest.approx(
            agreement[name])
        done, total = quantized_matmul_macs(result.model, onnx.load(trap), feed)
        assert result.report["coverage"]["macs_quantized_fraction"] == pytest.approx(done / total)
        assert result.report["coverage"]["basis"] == "macs"
    assert agreement["naive"] < 0.6  # every trap armed: most decisions change
    assert agreement["default"] >= 0.9  # the defaults keep the traps float...
    assert agreement["placed"] >= 0.9
    assert default.report["coverage"]["macs_quantized_fraction"] == 1.0  # ...at no compute cost
    reasons = {n["name"]: n["reason"] for n in default.report["nodes"]}
    assert "normalization statistic" in reasons["rms_add_eps"]
    assert "embedding lookup" in reasons["embed"]
    assert "--no-default-exclusions" in reasons["rms_square"]


def test_each_trap_rule_keeps_its_pattern_float(trap: Path) -> None:
    prepared, _ = prepare_model(onnx.load(trap))
    plan = plan_quantization(prepared, SelectionRules(placement="all"))
    naive = plan_quantization(prepared, SelectionRules(default_exclusions=False, placement="all"))
    reads = {(t.tensor, c) for t in plan.activations for c in t.consumers}
    planned = {t.tensor for t in plan.activations} | {w.tensor for w in plan.weights}
    naive_planned = {t.tensor for t in naive.activations} | {w.tensor for w in naive.weights}
    # Normalization: the statistic, the squares and the normalizer's inputs stay float...
    assert {"ms", "x_sq", "inv_rms"} <= naive_planned and not {"ms", "x_sq", "inv_rms"} & planned
    assert ("x", "rms_normalize") not in reads and ("x", "rms_square") not in reads
    assert "x_normed" in planned  # ...the normalized values do not
    # Embedding: the table and the looked-up vectors; softmax: the logits (not the MatMul).
    assert {"table", "emb"} <= naive_planned and not {"table", "emb"} & planned
    assert "scores" in naive_planned and "scores" not in planned
    assert {("q", "scores"), ("k_t", "scores")} <= reads
    assert ("x", "add_pos") in reads or "x" in planned  # other readers still quantize x


def test_fallback_keeps_cheap_tensors_float_first(trap: Path, tmp_path: Path) -> None:
    feed = {"bytes": np.load(trap.with_name("trap.eval.npz"))["bytes"]}
    config = CalibrationConfig(default_exclusions=False, target_sqnr=15.0, placement="all",
                               sensitivity=True)  # ranked by per-tensor sensitivity
    result = calibrate(trap, config, report_path=tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, report_schema())
    x, y = run_both(trap, result.model, feed)
    assert sqnr_db(x, y) >= 15.0
    assert report["evaluation"]["outputs"][0]["sqnr_db"] == pytest.approx(sqnr_db(x, y), rel=1e-6)
    fallback = report["fallback"]
    assert fallback["reached"] and fallback["kept_float"]
    assert fallback["steps"][0]["kept_float"] == 0 and not fallback["steps"][0]["target_met"]
    assert fallback["steps"][0]["worst_sqnr_db"] < 15.0  # it did need the fallback
    # Every tensor kept float is one the naive plan quantized; none costs compute here.
    kept = {k["tensor"] for k in fallback["kept_float"]}
    planned = {t["name"] for t in report["tensors"]}
    assert kept and not kept & planned
    done, total = quantized_matmul_macs(result.model, onnx.load(trap), feed)
    assert done == total and report["coverage"]["macs_quantized_fraction"] == 1.0
    # The report lists every planned tensor's sensitivity, worst first.
    ratios = [t["noise_ratio"] for t in report["sensitivity"]["tensors"]]
    assert ratios == sorted(ratios, reverse=True)
    assert report["sensitivity"]["data"].endswith("trap.eval.npz")


def test_unreachable_target_says_so_and_respects_the_floor(trap: Path) -> None:
    config = CalibrationConfig(min_product_macs=0, default_exclusions=False, target_sqnr=80.0, min_coverage=60.0)
    result = calibrate(trap, config, enforce_gates=False)
    fallback = result.report["fallback"]
    assert not fallback["reached"] and "NOT reached" in fallback["message"]
    assert all(s["macs_quantized_fraction"] >= 0.6 for s in fallback["steps"])
    assert result.report["coverage"]["macs_quantized_fraction"] >= 0.6
    assert any("NOT reached" in w for w in result.report["warnings"])
    # A missed target fails the run as the default floor it replaces does (it passed as a
    # warning: asking for more than the floor gave a weaker verdict than asking for nothing).
    (gate,) = result.report["gates"]
    assert gate["option"] == "target-sqnr" and not gate["passed"]
    # a yes/no in the report's own units (value 0: not reached; it needed 1), the target's
    # figure in its measure: a CI reading value >= threshold gets the verdict right
    assert (gate["value"], gate["threshold"]) == (0.0, 1.0)
    assert "--target-sqnr 80" in gate["measure"]
    with pytest.raises(AccuracyGateError, match="target-sqnr"):
        calibrate(trap, config)


# ----------------------------------------------------------------------------------- gates


def test_failed_gates_exit_7_after_writing_the_evidence(trap: Path, tmp_path: Path) -> None:
    out, rep = tmp_path / "q.onnx", tmp_path / "q.json"
    args = ["calibrate", "--min-product-macs", "0", str(trap), "-o", str(out), "--report", str(rep),
            "--fail-under-sqnr", "90", "--fail-under-agreement", "50",
            "--fail-if-coverage-below", "60"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == AccuracyGateError.exit_code == 7, result.output
    # Quantized: the projections and the head, 3*L*W*W + W*C of the MACs; the attention
    # products (2*L*L*W) stay float.
    projections = 3 * LENGTH * WIDTH * WIDTH + WIDTH * CLASSES
    share = 100 * projections / (projections + 2 * LENGTH * LENGTH * WIDTH)
    assert out.is_file() and rep.is_file()
    report = json.loads(rep.read_text())
    gates = {g["option"]: g for g in report["gates"]}
    sqnr = report["evaluation"]["outputs"][0]["sqnr_db"]
    assert gates["fail-under-sqnr"]["value"] == pytest.approx(sqnr, rel=1e-5)
    assert not gates["fail-under-sqnr"]["passed"]
    assert gates["fail-under-agreement"]["passed"] and gates["fail-if-coverage-below"]["passed"]
    assert gates["fail-if-coverage-below"]["value"] == pytest.approx(share, rel=1e-6)
    assert "fail-under-sqnr" in result.stderr and "fail-under-agreement" not in result.stderr
    # The summary says it once, on the gate's own line: no warning repeats it.
    assert result.stdout.count("--fail-under-sqnr 90") == 1, result.stdout
    assert any(w.startswith("gate failed:") for w in report["warnings"])  # the report keeps it


def test_coverage_gate_and_passing_gates(trap: Path, tmp_path: Path) -> None:
    out, rep = tmp_path / "q.onnx", tmp_path / "q.json"
    base = ["calibrate", str(trap), "-o", str(out), "--report", str(rep), "--force", "-q",
            "--no-fallback"]
    failing = CliRunner().invoke(main, [*base, "--exclude-nodes", "q_proj",
                                        "--fail-if-coverage-below", "90"])
    assert failing.exit_code == 7
    report = json.loads(rep.read_text())
    feed = {"bytes": np.load(trap.with_name("trap.eval.npz"))["bytes"]}
    done, total = quantized_matmul_macs(onnx.load(out), onnx.load(trap), feed)
    assert report["gates"][0]["value"] == pytest.approx(100 * done / total, rel=1e-6)
    assert done < total
    passing = CliRunner().invoke(main, [*base, "--fail-under-sqnr", "5", "--fail-under-agreement", "80"])
    assert passing.exit_code == 0, passing.output
    assert all(g["passed"] for g in json.loads(rep.read_text())["gates"])


def test_agreement_options_need_a_classifier_output(tmp_path: Path) -> None:
    model = SAMPLE_MODELS / "transformer_block.onnx"
    for option in ("--fail-under-agreement", "--max-agreement-drop"):
        result = CliRunner().invoke(main, ["calibrate", str(model), "-o", str(tmp_path / "q.onnx"),
                                           "--report", str(tmp_path / "q.json"), option, "1"])
        assert result.exit_code == ConfigError.exit_code, result.output
        assert option.lstrip("-") in result.stderr
        assert not (tmp_path / "q.onnx").exists()


def test_percentages_are_checked() -> None:
    with pytest.raises(ConfigError, match="max-agreement-drop"):
        CalibrationConfig(max_agreement_drop=120.0)
    with pytest.raises(ConfigError, match="sensitivity-samples"):
        CalibrationConfig(sensitivity_samples=0)


# --------------------------------------------------------------------------------- coverage


def test_digits_macs_match_the_layer_formulas() -> None:
    model, _ = prepare_model(onnx.load(SAMPLE_MODELS / "digits_cnn.onnx"))
    sample = {"image": np.zeros((1, 1, 8, 8), np.float32)}
    macs = compute_macs(model, sample)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    nodes = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm")]
    names = [n.output[0] for n in nodes]
    exposed.graph.output.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT, None)
                                for t in names)
    outputs = dict(zip(names, create_session(exposed).run(names, sample)))
    for node in nodes:
        weight = inits[node.input[1]]
        per_output = int(np.prod(weight.shape[1:])) if node.op_type == "Conv" else weight.shape[1]
        assert macs[node.name] == outputs[node.output[0]].size * per_output
    plan = plan_quantization(model, SelectionRules(exclude_nodes=(nodes[0].name,)))
    coverage = measure_coverage(model, plan, macs)
    assert coverage.macs_quantized == sum(macs.values()) - macs[nodes[0].name]


def test_macs_are_counted_at_the_largest_of_the_first_samples(tmp_path: Path) -> None:
    """A projection then scores against itself over T positions: T x 8 x 8 + T x T x 8 MACs.
    The first sample holds one position (a decoder step's empty cache), the others 16: the
    figure is that of 16 positions, where the float product of activations weighs twice the
    projection (its share read 89 % at one position, 33 % at 16)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="project"),
             helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1], name="turn"),
             helper.make_node("MatMul", ["h", "ht"], ["y"], name="scores")]
    rng = np.random.default_rng(31)
    model = build_model(nodes, [float_input("x", [1, "T", 8])], ["y"],
                        {"w": rng.standard_normal((8, 8)).astype(np.float32)})
    path = tmp_path / "steps.onnx"
    onnx.save(model, path)
    folder = tmp_path / "data"
    folder.mkdir()
    for i, length in enumerate([1, 16, 16, 16, 16, 16, 16, 16]):
        np.savez(folder / f"{i:02d}.npz",
                 x=rng.standard_normal((1, length, 8)).astype(np.float32))
    result = calibrate(path, CalibrationConfig(min_product_macs=0, data=folder, fallback=False))
    coverage = result.report["coverage"]
    assert coverage["macs_total"] == 16 * 8 * 8 + 16 * 16 * 8
    assert coverage["macs_quantized"] == 16 * 8 * 8


def test_attention_counts_alike_written_out_or_as_one_operator() -> None:
    """Two heads of width 4 over 6 positions: Q K^T and the weighted sum of V hold
    2 x (1 x 2 x 6 x 6 x 4) = 576 MACs, whether two MatMuls or opset 23's Attention compute
    them; onnxruntime's fused Attention adds its projection (6 x 8 inputs x 24 outputs) and
    FusedMatMul counts as the MatMul it is, transposed input included."""
    heads = helper.make_node("Transpose", ["q4"], ["q4t"], perm=[0, 1, 3, 2])
    written_out = build_model(
        [heads,
         helper.make_node("MatMul", ["k4", "q4t"], ["scores"], name="qk"),
         helper.make_node("Softmax", ["scores"], ["p"], name="softmax"),
         helper.make_node("MatMul", ["p", "v4"], ["y"], name="pv")],
        [float_input(n, [1, 2, 6, 4]) for n in ("q4", "k4", "v4")], ["y"])
    written_out, _ = prepare_model(written_out)  # shapes inferred, as calibration has them
    assert sorted(compute_macs(written_out, None).values()) == [288, 288]
    one_op = build_model(
        [helper.make_node("Attention", ["q", "k", "v"], ["y"], name="att", q_num_heads=2,
                          kv_num_heads=2)],
        [float_input(n, [1, 6, 8]) for n in ("q", "k", "v")], ["y"], opset=23, ir_version=10)
    assert compute_macs(one_op, None) == {"att": 576}
    rng = np.random.default_rng(2)
    fused = helper.make_model(helper.make_graph(
        [helper.make_node("Attention", ["x", "w", "b"], ["a"], name="att", domain="com.microsoft",
                          num_heads=2),
         helper.make_node("FusedMatMul", ["xt", "m"], ["f"], name="fmm", domain="com.microsoft",
                          transA=1)],
        "fused", [float_input("x", [1, 6, 8]), float_input("xt", [8, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "f")],
        [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
         for name, shape in (("w", (8, 24)), ("b", (24,)), ("m", (8, 16)))]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sample = {"x": rng.standard_normal((1, 6, 8)).astype(np.float32),
              "xt": rng.standard_normal((8, 4)).astype(np.float32)}
    # onnx's shape inference does not know these operators: one onnxruntime run measures
    assert compute_macs(fused, sample, run_shapes=shape_probe(fused, sample)) == {
        "att": 6 * 8 * 24 + 576, "fmm": 4 * 16 * 8}


def test_symbolic_shapes_are_sized_from_the_sample_without_running_the_model() -> None:
    """Symbols that shape inference derives from the input's (strided convolutions give
    ``unk__0``) become numbers when it reruns with the sample's input shapes; no onnxruntime
    probe is needed."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Conv", ["c1", "w2"], ["y"], name="conv2", strides=[2, 2]),
    ]
    initializers = {
        "w1": rng.standard_normal((4, 2, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((5, 4, 2, 2)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["n", 2, "h", "w"])], ["y"], initializers)
    model, _ = prepare_model(model)
    sample = {"x": rng.standard_normal((3, 2, 9, 13)).astype(np.float32)}

    def no_probe(tensors: list[str]) -> dict[str, tuple[int, ...]]:
        raise AssertionError(f"probe asked for {tensors}")

    macs = compute_macs(model, sample, run_shapes=no_probe)
    # c1: 3 x 4 x 5 x 7 (floor((9 + 2 - 3) / 2) + 1 = 5, floor((13 + 2 - 3) / 2) + 1 = 7);
    # y: 3 x 5 x 2 x 3 (floor((5 - 2) / 2) + 1 = 2, floor((7 - 2) / 2) + 1 = 3).
    assert macs == {"conv1": (3 * 4 * 5 * 7) * (2 * 3 * 3), "conv2": (3 * 5 * 2 * 3) * (4 * 2 * 2)}


def test_unknown_shapes_fall_back_to_counting_nodes() -> None:
    model, _ = prepare_model(onnx.load(SAMPLE_MODELS / "digits_cnn.onnx"))
    for value in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            dim.dim_param = "unknown"
    macs = compute_macs(model, None)
    assert all(v is None for v in macs.values())
    plan = plan_quantization(model, SelectionRules())
    coverage = measure_coverage(model, plan, macs)
    assert coverage.basis == "nodes" and coverage.note and "counts nodes" in coverage.note
    # Every compute node is quantized but the stem Conv, whose one input channel keeps it
    # float under placement "auto": counting nodes, the figure is all of them but one.
    stem = next(n.name for n in model.graph.node if n.op_type == "Conv")
    assert set(macs) - {d.node for d in plan.nodes if d.quantized} == {stem}
    assert coverage.fraction == (len(macs) - 1) / len(macs)
    assert coverage.compute_nodes == len(macs)


def test_recurrent_layers_are_named_as_left_out_of_the_figure() -> None:
    """An LSTM holds most of the work of a tagger but has no integer kernel: the share of
    MACs counts the Linear after it, and the note says the LSTM is not counted."""
    rng = np.random.default_rng(4)
    hidden = 8
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R", "B"], ["seq", "", ""], name="lstm",
                         hidden_size=hidden),
        helper.make_node("Squeeze", ["seq", "axis"], ["h"], name="squeeze"),
        helper.make_node("MatMul", ["h", "V"], ["y"], name="head"),
    ]
    inits = {
        "W": rng.standard_normal((1, 4 * hidden, 5)).astype(np.float32),
        "R": rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32),
        "B": np.zeros((1, 8 * hidden), np.float32),
        "axis": np.array([1], np.int64),
        "V": rng.standard_normal((hidden, 3)).astype(np.float32),
    }
    model, _ = prepare_model(build_model(nodes, [float_input("x", [6, 1, 5])], ["y"], inits))
    sample = {"x": rng.standard_normal((6, 1, 5)).astype(np.float32)}
    macs = compute_macs(model, sample)
    assert set(macs) == {"head"}
    coverage = measure_coverage(model, plan_quantization(model, SelectionRules()), macs)
    assert coverage.note is not None and coverage.note.startswith("1 LSTM not counted")
    assert coverage.recurrent_layers == "1 LSTM"
    sized = SelectionRules(run_macs=tuple(macs.items()), min_product_macs=1 << 18)
    coverage = measure_coverage(model, plan_quantization(model, sized), macs)
    # The LSTM holds 4 x 8 x (5 + 8) = 416 weights, the head 24: its product, too small to
    # pay, is no option's to quantize for a gain (a speaker encoder of three LSTMs, told to
    # quantize it, came out "100 %" quantized and as fast as its float model).
    assert coverage.float_reasons is not None
    assert "recurrent layers hold most of its weights" in coverage.float_reasons
    assert "--min-product-macs 0" not in coverage.float_reasons


# ------------------------------------------------------------------------- search mechanics


def _metrics(sqnr: float) -> Comparison:
    return Comparison(1, (OutputMetrics("y", sqnr, 1.0, 0.0, None, None, None),))


def _candidates(count: int) -> list[Candidate]:
    return [Candidate(TensorSensitivity(f"t{i}", "activation", 10.0, 0.1, None, None), 0.0)
            for i in range(count)]


def _ranked(trap: Path) -> tuple[onnx.ModelProto, Any, list[str], list[Candidate]]:
    """The trap model, its plan of every tensor, 13 of its tensors and their candidates in
    that order."""
    model, _ = prepare_model(onnx.load(trap))
    plan = plan_quantization(model, SelectionRules(default_exclusions=False, placement="all"))
    tensors = sorted({t.tensor for t in plan.activations if t.consumers})[:13]
    candidates = [Candidate(TensorSensitivity(t, "activation", 10.0, 0.1, None, None), 0.0)
                  for t in tensors]
    return model, plan, tensors, candidates


@pytest.mark.parametrize("needed", [0, 1, 3, 6, 13])
def test_search_finds_the_fewest_tensors_to_keep_float(needed: int, trap: Path) -> None:
    model, plan, tensors, candidates = _ranked(trap)
    checked: list[int] = []

    def evaluate(quantized: onnx.ModelProto) -> Comparison:
        kept = len(tensors) - sum(1 for t in plan.activations
                                  if t.tensor in tensors and _has_q(quantized, t.tensor))
        checked.append(kept)
        return _metrics(30.0 if kept >= needed else 10.0)

    result = search_fallback(
        model=model, plan=plan, candidates=candidates, macs=compute_macs(model, None),
        target=AccuracyTarget(min_sqnr_db=20.0), floor=0.0,
        write=lambda p: _marker_model(model, p), evaluate=evaluate,
    )
    assert result.reached and len(result.kept) == needed
    search = 2 * math.ceil(math.log2(len(tensors) + 1)) + 2
    assert len(checked) <= 2 * search  # the search, then at most as many to prune its choice


def test_candidates_the_target_holds_without_are_given_back(trap: Path) -> None:
    """The ranking measures error where it is made, not its effect on the outputs: when only
    the first and the sixth candidates matter, the search's prefix of six holds four that do
    not, and they are quantized again (each checked once, last-ranked first)."""
    model, plan, tensors, candidates = _ranked(trap)
    needed = {tensors[0], tensors[5]}
    checked: list[set[str]] = []

    def evaluate(quantized: onnx.ModelProto) -> Comparison:
        floated = {t for t in tensors if not _has_q(quantized, t)}
        checked.append(floated)
        return _metrics(30.0 if needed <= floated else 10.0)

    result = search_fallback(
        model=model, plan=plan, candidates=candidates, macs=compute_macs(model, None),
        target=AccuracyTarget(min_sqnr_db=20.0), floor=0.0,
        write=lambda p: _marker_model(model, p), evaluate=evaluate,
    )
    assert result.reached and {c.sensitivity.tensor for c in result.kept} == needed
    assert not _has_q(result.model, tensors[0]) and _has_q(result.model, tensors[1])
    assert len(checked) == len({frozenset(c) for c in checked})  # no model checked twice


@pytest.mark.parametrize(("held_out_needs", "calibration_needs", "conclusive", "found"), [
    (2, 2, True, 2),    # the first set the held-out samples accept passes the second check too
    (2, 5, True, 5),    # more are kept float until a set passes both
    (1, 3, True, 3),
    (2, 13, True, None),  # none within the confirmations: the first set, with what it missed
    (2, 5, False, None),  # a check that cannot tell (too few decisions): no search past it
])
def test_a_set_that_misses_the_confirmation_is_followed_by_one_that_passes(
    held_out_needs: int, calibration_needs: int, conclusive: bool, found: int | None,
    trap: Path,
) -> None:
    """The held-out samples are few, and the search stops at the first set they accept; a
    second check (on the calibration samples) that set misses sends the search on, keeping
    more float, to the first set that passes both, where that check can tell."""
    model, plan, tensors, candidates = _ranked(trap)
    confirmed: list[int] = []

    def floated(quantized: onnx.ModelProto) -> int:
        return sum(1 for t in tensors if not _has_q(quantized, t))

    def evaluate(quantized: onnx.ModelProto) -> Comparison:
        return _metrics(30.0 if floated(quantized) >= held_out_needs else 10.0)

    def confirm(quantized: onnx.ModelProto, held_out: Comparison) -> Missed | None:
        assert held_out.outputs[0].sqnr_db == 30.0  # only sets that met the target
        confirmed.append(floated(quantized))
        return (None if floated(quantized) >= calibration_needs
                else Missed(48, "missed", conclusive))

    result = search_fallback(
        model=model, plan=plan, candidates=candidates, macs=compute_macs(model, None),
        target=AccuracyTarget(min_sqnr_db=20.0), floor=0.0,
        write=lambda p: _marker_model(model, p), evaluate=evaluate, confirm=confirm,
    )
    assert result.reached
    assert len(confirmed) <= 1 + CONFIRMATIONS and len(set(confirmed)) == len(confirmed)
    if found is None:
        assert len(result.kept) == held_out_needs and result.confirmed is False
        assert result.missed == Missed(48, "missed", conclusive)
        if not conclusive:
            assert confirmed == [held_out_needs]  # the first set's check, and no search on
        assert "but missed on the calibration samples" in result.message
        assert ("as did the sets" in result.message) is conclusive
        return
    assert len(result.kept) == found and result.confirmed and result.missed is None
    assert floated(result.model) == found
    if found != held_out_needs:
        assert "on the calibration samples too" in result.message


def _marker_model(model: onnx.ModelProto, plan: Any) -> onnx.ModelProto:
    """A stand-in 'QDQ model' recording which activations the plan still quantizes."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.doc_string = json.dumps(sorted(t.tensor for t in plan.activations))
    return out


def _has_q(model: onnx.ModelProto, tensor: str) -> bool:
    return tensor in json.loads(model.doc_string)


def test_restrict_plan_drops_dependent_biases_and_says_why() -> None:
    model, _ = prepare_model(onnx.load(SAMPLE_MODELS / "digits_cnn.onnx"))
    plan = plan_quantization(model, SelectionRules())
    bias = plan.biases[0]
    writers = integer_output_writers(model.graph)
    restricted = restrict_plan(plan, {bias.input_tensor: "kept float by a test"}, writers)
    assert bias.input_tensor not in {a.tensor for a in restricted.activations}
    assert all(b.input_tensor != bias.input_tensor for b in restricted.biases)
    reasons = {d.node: d.reason for d in restricted.nodes}
    assert "kept float by a test" in reasons[bias.node]
    assert restrict_plan(plan, {}, writers) is plan


def test_coverage_of_an_empty_model_is_complete() -> None:
    assert Coverage("macs", 0, 0, 0, 0).fraction == 1.0


# ------------------------------------------------------------------------- one error, one candidate


def _scaled_net() -> onnx.ModelProto:
    """x -> MatMul -> Relu -> h -> Mul(2.5) -> s -> MatMul -> y: s is h on a grid 2.5 times as
    wide (the Relu keeps preparation from folding the Mul into the first weight)."""
    rng = np.random.default_rng(11)
    inits = {"w1": rng.standard_normal((8, 16)).astype(np.float32),
             "c": np.array(2.5, np.float32),
             "w2": (rng.standard_normal((16, 4)) / 4).astype(np.float32)}
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w1"], ["m"], name="fc1"), n("Relu", ["m"], ["h"], name="relu"),
             n("Mul", ["h", "c"], ["s"], name="scale"), n("MatMul", ["s", "w2"], ["y"], name="fc2")]
    return build_model(nodes, [float_input("x", ["N", 8])], ["y"], inits)


def test_tensors_carrying_one_error_are_kept_float_together(tmp_path: Path) -> None:
    from qcal.accuracy.fallback import rank_candidates
    from qcal.graph.qdq import InsertQDQ

    path, data = save_with_data(tmp_path, "scaled", _scaled_net(), 12, evaluate=16)
    assert data is not None
    captured = calibrate_capturing_sensitivity(path, CalibrationConfig(min_product_macs=0, sensitivity=True))
    model, plan, acts, weights = (captured[k] for k in ("model", "plan", "acts", "weights"))
    by_tensor = captured["result"].by_tensor()
    assert by_tensor["h"].harm > 0 and by_tensor["s"].harm == pytest.approx(by_tensor["h"].harm,
                                                                              rel=1e-4)

    def output(keep: dict[str, str]) -> np.ndarray:
        import onnxruntime as ort

        alone = dataclasses.replace(
            plan, activations=tuple(a for a in plan.activations if a.tensor not in keep))
        quantized = InsertQDQ(alone, acts, weights)(model).model
        options = ort.SessionOptions()
        # The Q/DQ arithmetic as written (onnxruntime's fusions would quantize a float MatMul
        # input on the fly, a different error).
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(quantized.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return np.asarray(session.run(None, {"x": data})[0])

    # Why they go together: either one float alone leaves the error of the other.
    both = output({})
    np.testing.assert_allclose(output({"s": "-"}), both, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output({"h": "-"}), both, rtol=1e-5, atol=1e-6)
    candidates = rank_candidates(model, plan, captured["result"], compute_macs(model, None))
    grouped = [c for c in candidates if {"h", "s"} & set(c.tensors)]
    assert len(grouped) == 1 and set(grouped[0].tensors) == {"h", "s"}
    assert "the same error" in grouped[0].reason()


def test_a_matmul_input_kept_float_takes_the_constant_weight_with_it(tmp_path: Path) -> None:
    import onnxruntime as ort

    from qcal.graph.qdq import InsertQDQ

    path, _ = save_with_data(tmp_path, "scaled", _scaled_net(), 13)
    captured = calibrate_capturing_sensitivity(path, CalibrationConfig(min_product_macs=0, sensitivity=True))
    model, plan, acts, weights = (captured[k] for k in ("model", "plan", "acts", "weights"))

    def optimized_ops(p: Any) -> set[str]:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(InsertQDQ(p, acts, weights)(model).model.SerializeToString(),
                             options, providers=["CPUExecutionProvider"])
        return {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}

    # Why: a float input next to a dequantized constant weight is quantized on the fly.
    input_only = dataclasses.replace(
        plan, activations=tuple(a for a in plan.activations if a.tensor != "s"))
    assert "MatMulNBits" in optimized_ops(input_only)
    restricted = restrict_plan(plan, {"s": "test"}, integer_output_writers(model.graph))
    assert "w2" not in {w.tensor for w in restricted.weights}
    assert "w1" in {w.tensor for w in restricted.weights}
    fc2 = next(d for d in restricted.nodes if d.node == "fc2")
    assert not fc2.quantized and "MatMulNBits" in fc2.reason
    assert "MatMulNBits" not in optimized_ops(restricted)


def test_a_conv_whose_output_is_kept_float_goes_float_whole(tmp_path: Path) -> None:
    """conv1 -> Relu -> conv2 -> Relu -> conv3 with conv2's output kept float: with no
    QuantizeLinear after it, onnxruntime has no integer kernel for conv2 and ran it in float on
    a weight dequantized at every run, while the report called it quantized. Its weight goes
    float with its output; conv1's output stays quantized (its integer kernel writes codes) and
    conv2 reads it through the DequantizeLinear."""
    import onnxruntime as ort

    from qcal.graph.qdq import InsertQDQ

    rng = np.random.default_rng(5)
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             n("Relu", ["c1"], ["r1"], name="relu1"),
             n("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             n("Relu", ["c2"], ["r2"], name="relu2"),
             n("Conv", ["r2", "w3", "b3"], ["y"], name="conv3")]
    inits = {}
    for name, shape in (("1", (8, 8, 3, 3)), ("2", (8, 8, 3, 3)), ("3", (4, 8, 1, 1))):
        inits[f"w{name}"] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        inits[f"b{name}"] = rng.standard_normal(shape[0]).astype(np.float32)
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    onnx.save(model, tmp_path / "convs.onnx")
    np.savez(tmp_path / "convs.calib.npz",
             x=rng.standard_normal((8, 8, 8, 8)).astype(np.float32))
    captured = calibrate_capturing_sensitivity(tmp_path / "convs.onnx",
                                               CalibrationConfig(sensitivity=True))
    prepared, plan, acts, weights = (captured[k] for k in ("model", "plan", "acts", "weights"))
    assert {"w2", "r2"} <= {t.tensor for t in (*plan.weights, *plan.activations)}

    # conv3 writes the graph output through a pair of its own: quantized too, and float with
    # what it reads
    assert "w3" in {w.tensor for w in plan.weights}
    restricted = restrict_plan(plan, {"r2": "test"}, integer_output_writers(prepared.graph))
    assert {w.tensor for w in restricted.weights} == {w.tensor for w in plan.weights} - {"w2",
                                                                                         "w3"}
    assert "w1" in {w.tensor for w in restricted.weights}
    r1 = next(a for a in restricted.activations if a.tensor == "r1")
    assert "conv2" not in r1.consumers
    conv2 = next(d for d in restricted.nodes if d.node == "conv2")
    assert not conv2.quantized and "integer kernel" in conv2.reason

    def optimized(p: Any) -> onnx.ModelProto:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(InsertQDQ(p, acts, weights)(prepared).model.SerializeToString(),
                             options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath)

    # Why: with only the output left float, conv2's weight is dequantized at every run.
    output_only = dataclasses.replace(
        plan, activations=tuple(a for a in plan.activations if a.tensor != "r2"))
    before = optimized(output_only)
    dequantized = {v for node in before.graph.node if node.op_type == "DequantizeLinear"
                   for v in node.output}
    assert any(node.op_type in ("Conv", "FusedConv") and node.input[1] in dequantized
               for node in before.graph.node)
    after = optimized(restricted)
    dequantized = {v for node in after.graph.node if node.op_type == "DequantizeLinear"
                   for v in node.output}
    assert not any(node.op_type in ("Conv", "FusedConv") and node.input[1] in dequantized
                   for node in after.graph.node)
    assert sum(node.op_type == "QLinearConv" for node in after.graph.node) == 1  # conv1


# ---------------------------------------------------------------- the default accuracy floor


def test_a_run_that_meets_the_floor_pays_one_evaluation_and_nothing_more(tmp_path: Path) -> None:
    result = calibrate(SAMPLE_MODELS / "digits_cnn.onnx",
                       CalibrationConfig(data=SAMPLE_MODELS / "digits_cnn.calib.npz", limit=64))
    report = result.report
    assert report["evaluation"]["outputs"][0]["top1_agreement"] >= 0.99
    assert report["fallback"] is None and report["sensitivity"] is None
    assert "localise" not in report["timings_seconds"]
    assert "fallback" not in report["timings_seconds"]
    assert report["gates"] == []


def _outlier_mlp() -> onnx.ModelProto:
    """x -> MatMul -> Relu (one hidden channel 1000x the others) -> MatMul -> logits: one
    per-tensor step for the hidden layer wipes out the small channels the logits rest on. The
    second MatMul holds 38 % of the MACs, which keeping its input float costs (so the coverage
    floor is set to 50 % here)."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w1[:, 0] *= 1000.0
    w2 = rng.standard_normal((32, 10)).astype(np.float32)
    w2[0, :] = 0.0  # the huge channel does not reach the logits
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["pre"], name="fc1"),
        helper.make_node("Relu", ["pre"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["logits"], name="fc2"),
    ]
    return build_model(nodes, [float_input("x", ["N", 16])], ["logits"], {"w1": w1, "w2": w2})


def test_below_the_floor_the_blocks_find_the_error_and_the_fallback_restores_it(
    tmp_path: Path,
) -> None:
    path, data = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, evaluate=200,
                                features=16)
    assert data is not None
    naive = calibrate(path, CalibrationConfig(min_product_macs=0, fallback=False))
    assert naive.report["evaluation"]["outputs"][0]["top1_agreement"] < 0.99
    result = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0))
    report = result.report
    fallback = report["fallback"]
    assert fallback["reached"] and [k["tensor"] for k in fallback["kept_float"]] == ["h"]
    assert fallback["message"].endswith("(ranked by their measured effect on the outputs, "
                                        "in blocks)")
    # it names the floor's figures that apply: this model has no probabilities to hold
    assert fallback["message"].startswith("SQNR of values, sigmoid maps and per-sample scores "
                                          ">= 14 dB and agreement >= 99 % of decisions reached")
    # the blocks' ranking reached the floor: the error jumps were never localised
    assert report["sensitivity"] is None and "localise" not in report["timings_seconds"]
    expected = run(_outlier_mlp(), {"x": data})[0]
    got = run(result.model, {"x": data})[0]
    agreement = float(np.mean(expected.argmax(1) == got.argmax(1)))
    assert agreement >= 0.99
    assert agreement == pytest.approx(report["evaluation"]["outputs"][0]["top1_agreement"])
    assert report["gates"] == []


def _without_blocks(*args: object, **kwargs: object) -> None:
    raise ModelError("activation 'h': per-axis activations cannot be measured")


def test_where_blocks_cannot_be_measured_the_error_jumps_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model the switch form cannot take (per-axis activations): the error is localised by
    its jumps instead, and the fallback restores the model as well."""
    path, _ = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, evaluate=200,
                             features=16)
    monkeypatch.setattr(accuracy_stage, "measure_blocks", _without_blocks)
    report = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0)).report
    assert report["sensitivity"]["method"] == "error-jump"
    assert report["sensitivity"]["tensors"][0]["tensor"] == "h"  # where the error jumps
    fallback = report["fallback"]
    assert fallback["reached"] and [k["tensor"] for k in fallback["kept_float"]] == ["h"]
    assert "in blocks" not in fallback["message"]
    assert report["evaluation"]["outputs"][0]["top1_agreement"] >= 0.99
    assert report["gates"] == []


def test_where_the_blocks_fall_short_the_error_jumps_rank_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks that name neither the harmful tensor nor the weight that takes it along fall
    short; the jumps then find it, and the report lists both searches' steps and says which
    reached the floor."""
    path, _ = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, evaluate=200,
                             features=16)
    rank_blocks = accuracy_stage.rank_blocks

    def blind(*args: Any) -> list[Candidate]:
        return [c for c in rank_blocks(*args) if not {"h", "w2"} & set(c.tensors)]

    monkeypatch.setattr(accuracy_stage, "rank_blocks", blind)
    report = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0)).report
    fallback = report["fallback"]
    assert fallback["reached"] and [k["tensor"] for k in fallback["kept_float"]] == ["h"]
    assert fallback["message"].endswith(
        "(ranked by where their error jumps; ranked by their measured effect on the outputs, "
        "in blocks, they fell short)")
    assert report["sensitivity"]["method"] == "error-jump"
    # the model as planned, checked once for both searches, comes first
    kept = [s["kept_float"] for s in fallback["steps"]]
    assert kept[0] == 0 and kept.count(0) == 1 and fallback["steps"][-1]["target_met"]
    assert report["evaluation"]["outputs"][0]["top1_agreement"] >= 0.99


def test_sensitivity_asked_for_still_checks_the_floor(tmp_path: Path) -> None:
    """--sensitivity measures every tensor; the default floor still holds the run to account:
    below it, the fallback ranks by those measurements and restores the model, where before
    the summary called 96 % of agreeing decisions within the floor."""
    path, _ = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, evaluate=200,
                             features=16)
    report = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0, sensitivity=True)).report
    assert report["sensitivity"]["method"] != "error-jump"  # measured per tensor, not localised
    fallback = report["fallback"]
    assert fallback["steps"][0]["worst_top1_agreement"] < 0.99  # the full model misses it
    assert fallback["reached"] and "h" in [k["tensor"] for k in fallback["kept_float"]]
    assert report["evaluation"]["outputs"][0]["top1_agreement"] >= 0.99
    assert report["gates"] == []


def test_a_target_is_searched_as_the_floor_is(tmp_path: Path) -> None:
    """--target-sqnr replaces the floor's figures, not its search: the model as planned is
    checked first, then ranked by blocks; no per-tensor sensitivity unless asked for."""
    path, data = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, evaluate=200,
                                features=16)
    assert data is not None
    naive = calibrate(path, CalibrationConfig(min_product_macs=0, fallback=False))
    planned_sqnr = naive.report["evaluation"]["outputs"][0]["sqnr_db"]
    target = planned_sqnr + 10.0
    result = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0,
                                               target_sqnr=target))
    report = result.report
    assert "sensitivity" not in report["timings_seconds"] and report["sensitivity"] is None
    fallback = report["fallback"]
    assert fallback["steps"][0]["worst_sqnr_db"] == pytest.approx(planned_sqnr)
    assert fallback["reached"] and "h" in [k["tensor"] for k in fallback["kept_float"]]
    assert fallback["message"].endswith("(ranked by their measured effect on the outputs, "
                                        "in blocks)")
    expected = run(_outlier_mlp(), {"x": data})[0]
    got = run(result.model, {"x": data})[0]
    assert sqnr_db(expected, got) >= target
    assert report["gates"] == []
    # a target the model as planned meets costs that one evaluation
    met = calibrate(path, CalibrationConfig(min_product_macs=0, target_sqnr=planned_sqnr - 1.0))
    assert met.report["fallback"] is None and met.report["sensitivity"] is None
    assert not {"sensitivity", "localise", "localise blocks", "fallback"} & set(
        met.report["timings_seconds"])
    assert met.report["evaluation"]["outputs"][0]["sqnr_db"] == pytest.approx(planned_sqnr)


def _down(percent: float) -> str:
    """A percentage as the messages show it: two decimals, never rounded up to a floor."""
    return f"{int(percent * 100 + 1e-9) / 100:.2f}"


def test_the_summary_table_rounds_down_as_the_verdict_does() -> None:
    """63 of 64 decisions (98.4375 %) at 51.56 dB: the table said 98.44 % and 51.6 dB where the
    verdict line and the gates said 98.43 % and 51.5 dB."""
    from rich.console import Console

    from qcal._cli_output import _metrics_table

    output = {"name": "logits", "sqnr_db": 51.56, "cosine": 0.99999, "max_abs_error": 0.01,
              "top1_agreement": 63 / 64, "float_accuracy": None, "quantized_accuracy": None}
    console = Console(width=200, record=True)
    console.print(_metrics_table("t", [output]))
    text = console.export_text()
    assert f"{_down(100 * 63 / 64)}%" in text and "98.44" not in text
    assert "51.5" in text and "51.6" not in text


def test_a_floor_the_fallback_cannot_reach_is_a_failed_gate(trap: Path, tmp_path: Path) -> None:
    """Everything quantized and the traps armed: no choice above the coverage floor gets top-1
    agreement to 99 %. The model and report are written and the run exits 7 with the reason."""
    out, rep = tmp_path / "q.onnx", tmp_path / "q.json"
    result = CliRunner().invoke(main, ["calibrate", str(trap), "-o", str(out), "--report",
                                       str(rep), "--no-default-exclusions", "--placement", "all",
                                       "-q"])
    assert result.exit_code == 7, result.output
    assert "accuracy floor" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    report = json.loads(rep.read_text())
    jsonschema.validate(report, report_schema())
    assert not report["fallback"]["reached"]
    assert [g["option"] for g in report["gates"]] == ["accuracy-floor"]
    assert out.is_file()
    agreement = report["evaluation"]["outputs"][0]["top1_agreement"]  # the one line names it
    assert f"{_down(100 * agreement)} % of the decisions agree" in result.stderr


def test_the_summary_says_the_measured_quality_and_what_to_do_below_the_floor(
    trap: Path, tmp_path: Path
) -> None:
    """Below the floor the summary names the measured agreement and the options that act on it;
    within it, the figure and the verdict."""
    out, rep = tmp_path / "q.onnx", tmp_path / "q.json"
    below = CliRunner().invoke(main, ["calibrate", str(trap), "-o", str(out), "--report", str(rep),
                                      "--no-default-exclusions", "--placement", "all"])
    assert below.exit_code == 7
    agreement = json.loads(rep.read_text())["evaluation"]["outputs"][0]["top1_agreement"]
    said = " ".join(below.stdout.split())  # rich wraps lines
    assert "quality: below the accuracy floor (99 % of decisions, F1 0.97 of yes decisions, 14 dB " \
           "on values, sigmoids and per-sample scores): " \
           f"{_down(100 * agreement)}% of the decisions agree" in said
    assert "--min-coverage lower than 70" in said and "--no-fallback accepts" in said
    within = CliRunner().invoke(main, ["calibrate", str(SAMPLE_MODELS / "digits_cnn.onnx"),
                                       "--limit", "32", "-o", str(out), "--report", str(rep),
                                       "--force"])
    assert within.exit_code == 0
    agreement = json.loads(rep.read_text())["evaluation"]["outputs"][0]["top1_agreement"]
    assert (f"quality: within the accuracy floor: {_down(100 * agreement)}% of the decisions agree"
            in " ".join(within.stdout.split()))


@pytest.mark.parametrize(("needed", "limit", "found", "most_checks"),
                         [(5, 20, 5, 8), (21, 20, None, 2), (0, 20, 0, 1), (1, 1, 1, 2)])
def test_the_search_checks_the_coverage_limit_before_searching_below_it(
    needed: int, limit: int, found: int | None, most_checks: int
) -> None:
    """The smallest k that meets the target (met from `needed` on); when even `limit` does not
    meet it, two checks say so (k = 0 and k = limit) instead of a whole search."""
    from qcal.accuracy._prefix_search import smallest_passing

    checked: list[int] = []

    def check(k: int) -> object:
        checked.append(k)
        return type("Step", (), {"met": k >= needed})()

    assert smallest_passing(check, limit) == found  # type: ignore[arg-type]
    assert len(set(checked)) <= most_checks


def test_the_error_of_a_conv_whose_relu_is_fused_is_localised_at_that_conv() -> None:
    """Conv -> Relu three times: the Convs' outputs are not quantized (onnxruntime fuses each
    Relu), only the Relus' are. An error put into the second Conv's weight jumps there: that
    weight and its input take the jump, the Convs before and after take none."""
    from qcal.accuracy.localise import localise_error

    rng = np.random.default_rng(41)
    nodes, weights, previous = [], {}, "x"
    for i in (1, 2, 3):
        nodes += [helper.make_node("Conv", [previous, f"w{i}"], [f"c{i}"], name=f"conv{i}",
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        weights[f"w{i}"] = (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32)
        previous = f"r{i}"
    nodes.append(helper.make_node("GlobalAveragePool", ["r3"], ["y"], name="pool"))
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"],
                                         weights))
    plan = plan_quantization(model, SelectionRules())
    assert {"r1", "r2"} <= {a.tensor for a in plan.activations}
    assert "c2" not in {a.tensor for a in plan.activations}  # fused: not quantized
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    for tensor in broken.graph.initializer:
        if tensor.name == "w2":  # as if its quantization had gone badly wrong
            values = numpy_helper.to_array(tensor) * 1.5
            tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float32), "w2"))
    feed = {"x": rng.standard_normal((4, 8, 8, 8)).astype(np.float32)}
    harm = {s.tensor: s.harm for s in localise_error(model, broken, plan, [(feed, 4)]).tensors}
    assert harm["w2"] > 0.01 and harm["r1"] == harm["w2"]
    assert harm.get("w1", 0.0) == 0.0 and harm.get("w3", 0.0) < 0.01 * harm["w2"]


def test_an_error_passed_on_element_by_element_is_localised_where_it_was_made() -> None:
    """Conv -> Add 3 -> Clip -> Mul (a hardswish without its /6) -> depthwise Conv: a channel of
    small values, rounded at the first Conv's output, is magnified by its large depthwise weight.
    The error jumps at the depthwise Conv; the Conv output whose rounding it is, read only
    through element-by-element nodes, takes that jump too (keeping the depthwise input float
    alone would leave the rounding in place)."""
    from qcal.accuracy.localise import localise_error

    rng = np.random.default_rng(43)
    three, zero, six = (np.array(v, np.float32) for v in (3.0, 0.0, 6.0))
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="pointwise"),
        helper.make_node("Add", ["c1", "three"], ["a1"], name="add"),
        helper.make_node("Clip", ["a1", "zero", "six"], ["k1"], name="clip"),
        helper.make_node("Mul", ["c1", "k1"], ["h1"], name="mul"),
        helper.make_node("Conv", ["h1", "w2"], ["d1"], name="depthwise", group=2,
                         pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["d1"], ["y"], name="pool"),
    ]
    weights = {
        # x's first two channels, one per output channel; its other six weigh nothing
        "w1": np.pad(np.array([[[[0.02]], [[0.0]]], [[[0.0]], [[5.0]]]], np.float32),
                     ((0, 0), (0, 6), (0, 0), (0, 0))),
        "w2": np.stack([np.full((1, 3, 3), 40.0), np.full((1, 3, 3), 0.01)]).astype(np.float32),
        "three": three, "zero": zero, "six": six,
    }
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"],
                                         weights))
    plan = plan_quantization(model, SelectionRules())
    assert {"c1", "h1"} <= {a.tensor for a in plan.activations}
    # The quantized model as far as c1 goes: its readers see it rounded on an 8-bit grid set
    # by its large channel, which leaves the small channel a few steps.
    rounded = read_rounded(model, "c1", 0.1, np.array(128, np.uint8))
    feed = {"x": rng.uniform(-1.0, 1.0, (4, 8, 8, 8)).astype(np.float32)}
    harm = {s.tensor: s.harm for s in localise_error(model, rounded, plan, [(feed, 4)]).tensors}
    assert harm["h1"] > 0.1
    assert harm["c1"] == harm["h1"]  # the rounding made at c1, magnified at the depthwise Conv
    assert harm.get("x", 0.0) < 1e-3 * harm["h1"]  # upstream of the first Conv: none of it


def test_without_evaluation_data_the_floor_is_checked_on_held_out_samples(
    tmp_path: Path,
) -> None:
    """A plain run with calibration data only: a quarter of the samples, those of the smallest
    SHA-256 digests, is held out, the ranges come from the rest (the input's range is theirs,
    as numpy finds it) and the floor is judged on the 16 held out, whose agreement is
    recomputed here."""
    for seed in range(3, 100):  # data whose extremes tell the held-out rows from the last 16
        path, _ = save_with_data(tmp_path, "mlp", _outlier_mlp(), seed, calib=64, features=16)
        rows = np.load(tmp_path / "mlp.calib.npz")["x"]
        by_digest = sorted(range(64), key=lambda i: sample_digest({"x": rows[i:i + 1]}))
        held, kept = sorted(by_digest[:16]), sorted(by_digest[16:])
        if rows[kept].max() != rows[:48].max() and rows[kept].min() != rows[:48].min():
            break
    # the gates' verdict is not what is checked here (a random MLP's near-level scores)
    result = calibrate(path, CalibrationConfig(min_product_macs=0, data=tmp_path / "mlp.calib.npz",
                                               fallback=True, min_coverage=50.0),
                       enforce_gates=False)
    report = result.report
    assert report["data"]["samples"] == 48
    assert report["evaluation"]["samples"] == 16
    assert "held out" in report["evaluation"]["data"]
    observed = next(t for t in report["tensors"] if t["name"] == "x")["statistics"]
    assert observed["min"][0] == pytest.approx(rows[kept].min())
    assert observed["max"][0] == pytest.approx(rows[kept].max())
    expected = run(_outlier_mlp(), {"x": rows[held]})[0].argmax(1)
    got = run(result.model, {"x": rows[held]})[0].argmax(1)
    assert report["evaluation"]["outputs"][0]["top1_agreement"] == pytest.approx(
        float(np.mean(expected == got)))


@pytest.mark.parametrize("options", [{}, {"sensitivity": True, "sensitivity_samples": 4}])
def test_a_plain_run_writes_the_same_model_and_report_whatever_the_data_order(
    tmp_path: Path, options: dict[str, Any],
) -> None:
    """The held-out quarter, the samples the error is localised and sensitivity measured on, and
    those the shapes are probed on are chosen by content: the same rows reversed or shuffled
    give the same model byte for byte and the same report, through a fallback that keeps a
    tensor float."""
    path, _ = save_with_data(tmp_path, "mlp", _outlier_mlp(), 3, calib=64, features=16)
    rows = np.load(tmp_path / "mlp.calib.npz")["x"]
    orders = {"given": rows, "reversed": rows[::-1],
              "shuffled": rows[np.random.default_rng(0).permutation(len(rows))]}
    written, reports = {}, {}
    for name, data in orders.items():
        np.savez(tmp_path / f"{name}.npz", x=data)
        out = tmp_path / f"{name}.qdq.onnx"
        result = calibrate(path, CalibrationConfig(
            min_product_macs=0, data=tmp_path / f"{name}.npz", min_coverage=50.0, **options),
            output=out)
        written[name] = out.read_bytes()
        report = {k: v for k, v in result.report.items() if k != "timings_seconds"}
        report["config"] = {k: v for k, v in report["config"].items() if k != "data"}
        report["data"] = {k: v for k, v in report["data"].items() if k != "path"}
        report["output_model"] = {k: v for k, v in report["output_model"].items() if k != "path"}
        reports[name] = json.dumps(report, sort_keys=True)
    assert json.loads(reports["given"])["fallback"]["kept_float"]  # the search ran and kept some
    assert written["reversed"] == written["given"] == written["shuffled"]
    assert reports["reversed"] == reports["given"] == reports["shuffled"]
