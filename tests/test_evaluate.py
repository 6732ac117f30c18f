"""Metrics against independent computation on hand-made models."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal._verdict import quality_verdict
from qcal.accuracy.coverage import Coverage
from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.gates import Gates, check_gates
from qcal.config import CalibrationConfig
from qcal.pipeline import calibrate


def _scale_model(factor: float, op: str = "MatMul", rank: int = 2) -> onnx.ModelProto:
    """y = x * factor, as a linear layer (classifier-like scores) or an elementwise Mul; with
    `rank` 3, over positions ([N, T, 5])."""
    k = (np.eye(5, dtype=np.float32) * np.float32(factor)) if op == "MatMul" else np.float32(factor)
    shape: list[str | int] = ["N", 5] if rank == 2 else ["N", "T", 5]
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "k"], ["y"], name="scale")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializer=[onnx.numpy_helper.from_array(np.asarray(k), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_metrics_match_numpy() -> None:
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(3)]
    labels = rng.integers(0, 5, size=12)
    result = compare_models(_scale_model(1.0), _scale_model(1.1), ((({"x": d}), 4) for d in data),
                            labels=labels)
    x = np.concatenate(data).astype(np.float64)
    y = np.concatenate(data).astype(np.float32) * np.float32(1.1)
    y = y.astype(np.float64)
    out = result.outputs[0]
    assert result.samples == 12
    assert out.sqnr_db == pytest.approx(10 * math.log10((x**2).sum() / ((x - y) ** 2).sum()), rel=1e-9)
    assert out.cosine == pytest.approx(1.0, abs=1e-9)  # scaling keeps the direction
    assert out.max_abs_error == pytest.approx(np.abs(x - y).max(), rel=1e-9)
    assert out.top1_agreement == 1.0
    assert out.float_accuracy == pytest.approx(np.mean(x.argmax(1) == labels))


def test_identical_models_have_no_sqnr() -> None:
    data = [np.ones((2, 5), np.float32)]
    out = compare_models(_scale_model(2.0), _scale_model(2.0), (({"x": d}, 2) for d in data)).outputs[0]
    assert out.sqnr_db is None and out.max_abs_error == 0.0 and out.cosine == 1.0


def test_an_output_the_float_model_keeps_at_zero_is_flagged(tmp_path: Path) -> None:
    """A zero-initialised head: both models output 0, so their comparison says nothing; the
    output is flagged (and the report warns, naming it), an output merely equal is not."""
    data = [np.ones((2, 5), np.float32)]
    zero = compare_models(_scale_model(0.0), _scale_model(0.0), (({"x": d}, 2) for d in data))
    same = compare_models(_scale_model(2.0), _scale_model(2.0), (({"x": d}, 2) for d in data))
    assert zero.outputs[0].float_all_zero and zero.outputs[0].sqnr_db is None
    assert not same.outputs[0].float_all_zero
    assert zero.outputs[0].to_json()["float_all_zero"] is True
    onnx.save(_scale_model(0.0), tmp_path / "zero.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(3).standard_normal((8, 5)).astype(
        np.float32))
    report = calibrate(tmp_path / "zero.onnx", CalibrationConfig(data=tmp_path / "calib.npz"),
                       enforce_gates=False).report
    expected = ("output 'y' is 0 on every evaluation sample in the float model: its comparison "
                "with the quantized model says nothing of it")
    assert [w for w in report["warnings"] if "is 0 on every evaluation sample" in w] == [expected]
    # its argmax of zeros agrees whatever the quantized model does: no verdict is drawn from it
    verdict = quality_verdict(report)
    assert verdict is not None and verdict.headline == "quality: not measured", verdict


def test_an_output_empty_on_every_sample_is_told_from_one_at_zero() -> None:
    """A detector that finds nothing outputs no element: the comparison flags it as empty (the
    report's warning says "empty", not "0"); one empty batch among others is not."""
    empty = [np.ones((2, 0, 5), np.float32)]
    some = [np.ones((2, 0, 5), np.float32), np.ones((2, 3, 5), np.float32)]
    model = _scale_model(2.0, rank=3)
    out = compare_models(model, model, (({"x": d}, 2) for d in empty)).outputs[0]
    assert out.float_all_empty and out.float_all_zero
    out = compare_models(model, model, (({"x": d}, 2) for d in some)).outputs[0]
    assert not out.float_all_empty and not out.float_all_zero


def test_sign_flip_breaks_agreement() -> None:
    data = [np.arange(10, dtype=np.float32).reshape(2, 5)]
    out = compare_models(_scale_model(1.0), _scale_model(-1.0), (({"x": d}, 2) for d in data)).outputs[0]
    assert out.top1_agreement == 0.0 and out.cosine == pytest.approx(-1.0)


def _unary_model(op: str, *, output: str = "y", rank: int = 2) -> onnx.ModelProto:
    shape = ["N", 5] if rank == 2 else ["N", 5, 1]
    nodes = [helper.make_node(op, ["x"], ["t"], name="op")]
    nodes.append(helper.make_node("Reshape", ["t", "shape"], [output], name="reshape"))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [rank],
                                        [0, 5] if rank == 2 else [0, 5, 1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_non_finite_outputs_are_counted_and_break_the_output() -> None:
    """Log of the data is -inf/NaN where the data is <= 0: counted, and the sums run over the
    elements both models computed finite."""
    x = np.array([[1.0, -2.0, 0.5, 0.0, 3.0], [2.0, 4.0, -1.0, 0.25, 1.5]], np.float32)
    result = compare_models(_unary_model("Abs"), _unary_model("Log"), iter([({"x": x}, 2)]))
    out = result.outputs[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(x)
    bad = ~np.isfinite(logs)
    assert out.nonfinite_float == 0
    assert out.nonfinite_quantized == out.nonfinite_introduced == int(bad.sum()) == 3
    assert out.broken and result.broken_outputs == ("y",)
    assert result.worst_sqnr_db == -math.inf
    a = np.abs(x[~bad]).astype(np.float64)
    b = logs[~bad].astype(np.float64)
    assert out.sqnr_db == pytest.approx(10 * math.log10((a**2).sum() / ((a - b) ** 2).sum()))
    assert out.to_json()["nonfinite_introduced"] == 3


def test_non_finite_in_both_models_is_not_introduced() -> None:
    x = np.array([[1.0, -2.0, 0.5, 0.0, 3.0]], np.float32)
    result = compare_models(_unary_model("Log"), _unary_model("Log"), iter([({"x": x}, 1)]))
    out = result.outputs[0]
    assert out.nonfinite_float == out.nonfinite_quantized == 2
    assert out.nonfinite_introduced == 0 and not out.broken and out.sqnr_db is None


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (_unary_model("Abs", output="z"), "no output 'y'"),
        (_unary_model("Abs", rank=3), "rank 2 in the float model, 3 in the second"),
    ],
)
def test_models_with_different_outputs_are_refused(other: onnx.ModelProto, message: str) -> None:
    from qcal.numerics.errors import ModelError

    x = np.ones((1, 5), np.float32)
    with pytest.raises(ModelError, match=message):
        compare_models(_unary_model("Abs"), other, iter([({"x": x}, 1)]))


def test_a_broken_output_fails_every_gate() -> None:
    from qcal.accuracy.coverage import Coverage
    from qcal.accuracy.gates import Gates, check_gates

    x = np.array([[1.0, -2.0, 0.5, 0.0, 3.0]], np.float32)
    comparison = compare_models(_unary_model("Abs"), _unary_model("Log"), iter([({"x": x}, 1)]))
    coverage = Coverage(basis="nodes", compute_nodes=1, quantized_nodes=1, macs_total=None,
                        macs_quantized=None, note=None)
    results = check_gates(Gates(fail_under_sqnr=-100.0), comparison, coverage)
    assert [(r.option, r.passed) for r in results] == [
        ("finite-outputs", False), ("fail-under-sqnr", False)]
    assert check_gates(Gates(), comparison, coverage)[0].value == 2.0


def test_a_rank_2_output_not_computed_as_scores_has_no_agreement() -> None:
    """An embedding (here an elementwise product) is compared by SQNR and cosine only."""
    data = [np.arange(10, dtype=np.float32).reshape(2, 5)]
    out = compare_models(_scale_model(1.0, "Mul"), _scale_model(-1.0, "Mul"),
                         (({"x": d}, 2) for d in data)).outputs[0]
    assert out.top1_agreement is None and out.cosine == pytest.approx(-1.0)


def test_nan_evaluation_inputs_are_refused_naming_the_sample() -> None:
    from qcal.numerics.errors import DataError

    good = np.ones((2, 5), np.float32)
    bad = good.copy()
    bad[1, 2] = np.nan
    with pytest.raises(DataError, match=r"input 'x' holds NaN values in samples 2-3"):
        compare_models(_scale_model(1.0), _scale_model(1.1), iter([({"x": good}, 2), ({"x": bad}, 2)]))


def test_an_infinite_mask_in_the_evaluation_inputs_is_data() -> None:
    """PyTorch's causal mask holds -inf; the outputs stay finite (exp(-inf) = 0). Refused as
    "NaN or infinite", the run exited 5 where the same data calibrated without a word."""
    nodes = [helper.make_node("Add", ["x", "mask"], ["s"], name="masked"),
             helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["N", 5])
                     for v in ("x", "mask")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(8).standard_normal((4, 5)).astype(np.float32)
    mask = np.where(np.arange(5) > 2, -np.inf, 0.0).astype(np.float32)[None].repeat(4, 0)
    out = compare_models(model, model, [({"x": x, "mask": mask}, 4)]).outputs[0]
    assert out.nonfinite_float == 0 and out.sqnr_db is None and out.top1_agreement == 1.0


def _sequence_model(factor: np.ndarray, last: str, *, opset: int = 17,
                    axis: int | None = None) -> onnx.ModelProto:
    """[N, T, 5] scores: x · diag(factor), then `last` (Softmax over `axis`, or Identity). The
    input's rank is not declared (as in many exports with dynamic shapes)."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["t"], name="scale")]
    attrs = {} if axis is None else {"axis": axis}
    nodes.append(helper.make_node(last, ["t"], ["y"], name="last", **attrs))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 5])],
        initializer=[onnx.numpy_helper.from_array(factor.astype(np.float32), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _sequence_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Data, and two scalings of its classes whose argmax differs at some positions."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    other = np.array([1.0, 1.0, 1.0, 1.0, 2.5], np.float32)  # boosts class 4
    return x, np.ones(5, np.float32), other


def _expected_positions(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.argmax(x * a, -1) == np.argmax(x * b, -1)))


def test_a_softmax_over_the_last_axis_is_compared_per_position() -> None:
    """A CTC recognizer or token classifier ([N, T, classes] softmax) is read by the argmax of
    every position: its agreement counts positions, as an independent argmax says."""
    x, a, b = _sequence_data()
    expected = _expected_positions(x, a, b)
    assert 0.0 < expected < 1.0
    out = compare_models(_sequence_model(a, "Softmax"), _sequence_model(b, "Softmax"),
                         [({"x": x}, 4)]).outputs[0]
    assert out.top1_agreement == pytest.approx(expected)


def test_a_softmax_of_opset_12_upgraded_by_the_converter_is_still_per_position() -> None:
    """onnx's version converter writes an opset-12 softmax over the last axis as Flatten,
    Softmax, Reshape: still a distribution at every position. Over axis 1 of a rank-3 input it
    is one distribution per sample, and no per-position decision."""
    from onnx import version_converter

    x, a, b = _sequence_data()
    upgraded = [version_converter.convert_version(_sequence_model(f, "Softmax", opset=12, axis=2),
                                                  17) for f in (a, b)]
    assert "Flatten" in {n.op_type for n in upgraded[0].graph.node}
    out = compare_models(upgraded[0], upgraded[1], [({"x": x}, 4)]).outputs[0]
    assert out.top1_agreement == pytest.approx(_expected_positions(x, a, b))
    whole = [_sequence_model(f, "Softmax", opset=12, axis=1) for f in (a, b)]
    assert compare_models(*whole, [({"x": x}, 4)]).outputs[0].top1_agreement is None


def test_hidden_states_of_rank_3_have_no_agreement() -> None:
    """An [N, T, D] output computed element by element (hidden states, a residual sum) is not
    scores: SQNR and cosine only."""
    x, a, b = _sequence_data()
    out = compare_models(_sequence_model(a, "Identity"), _sequence_model(b, "Identity"),
                         [({"x": x}, 4)]).outputs[0]
    assert out.top1_agreement is None and out.sqnr_db is not None


def _linear_sequence_model(factor: np.ndarray, *, bias: bool, output: str = "y",
                           residual: bool = False) -> onnx.ModelProto:
    """[N, T, 5] -> MatMul by diag(factor) (then its bias added on its own, or the input added
    back as a residual) -> Reshape to [N * T, 1, 5]: a CRNN's logits written as [T, N, classes]."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="linear")]
    last = "m"
    if bias or residual:
        nodes.append(helper.make_node("Add", ["x" if residual else "b", "m"], ["a"], name="add"))
        last = "a"
    nodes.append(helper.make_node("Reshape", [last, "shape"], [output], name="reshape"))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(np.diag(factor).astype(np.float32), "w"),
                     onnx.numpy_helper.from_array(np.full(5, 0.25, np.float32), "b"),
                     onnx.numpy_helper.from_array(np.array([-1, 1, 5], np.int64), "shape")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_layers_logits_of_rank_3_are_compared_per_position(bias: bool) -> None:
    """A recognizer or tagger exported without its softmax ([T, N, classes] logits from a
    MatMul, its bias added on its own or not) is decoded by every position's argmax: its
    agreement counts positions, as an independent argmax says."""
    x, a, b = _sequence_data()
    expected = float(np.mean(np.argmax(x * a + 0.25 * bias, -1)
                             == np.argmax(x * b + 0.25 * bias, -1)))
    assert 0.0 < expected < 1.0
    out = compare_models(_linear_sequence_model(a, bias=bias),
                         _linear_sequence_model(b, bias=bias), [({"x": x}, 4)]).outputs[0]
    assert out.top1_agreement == pytest.approx(expected)


def test_a_residual_sum_or_an_output_named_as_hidden_states_has_no_agreement() -> None:
    """The same MatMul added back to its input (a residual block's hidden states), or named
    `last_hidden_state` as exporters name them: values, not decisions."""
    x, a, b = _sequence_data()
    for kwargs in ({"bias": False, "residual": True},
                   {"bias": True, "output": "last_hidden_state"}):
        out = compare_models(_linear_sequence_model(a, **kwargs),  # type: ignore[arg-type]
                             _linear_sequence_model(b, **kwargs),  # type: ignore[arg-type]
                             [({"x": x}, 4)]).outputs[0]
        assert out.top1_agreement is None and out.sqnr_db is not None, kwargs


def _two_dim_output(kind: str) -> onnx.ModelProto:
    """[N, 4] -> y [N, 4], computed by two MatMuls then: "shift" (a normalization's last step:
    one MatMul's output times a gain plus a beta, as tf2onnx and jax2tf write LayerNorm),
    "residual" (a MatMul's output added to its input) or "heads" (the two MatMuls' scores
    added, as a distilled classifier averages its heads)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="head1"),
             helper.make_node("MatMul", ["x", "w2"], ["m2"], name="head2")]
    if kind == "shift":
        nodes += [helper.make_node("Mul", ["m1", "gain"], ["scaled"], name="gain"),
                  helper.make_node("Add", ["scaled", "beta"], ["y"], name="beta")]
    else:
        nodes.append(helper.make_node("Add", ["x" if kind == "residual" else "m2", "m1"], ["y"],
                                      name="sum"))
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32),
                                                  name) for name in ("w1", "w2")]
        + [onnx.numpy_helper.from_array(np.full(4, v, np.float32), name)
           for name, v in (("gain", 1.5), ("beta", 0.25))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("kind", "decisions"),
                         [("shift", False), ("residual", False), ("heads", True)])
def test_an_add_ending_an_output_holds_scores_only_when_it_adds_heads(
        kind: str, decisions: bool) -> None:
    """A [N, 4] feature vector ending in a LayerNorm's shift had its argmax counted (a JAX ViT
    failed the floor on one flip of its 64-d features while its logits agreed at 100 %)."""
    from qcal.accuracy.decisions import decision_rules

    assert ("y" in decision_rules(_two_dim_output(kind))) is decisions


def _dense_head(width: int, outputs: int) -> onnx.ModelProto:
    """x [N, width] -> Gemm -> Relu -> Gemm -> y [N, outputs]."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["h"], name="encode"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2"], ["y"], name="decode")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", outputs])],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32),
                                                  name)
                     for name, shape in (("w1", (width, 16)), ("w2", (16, outputs)))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("width", "outputs", "decisions"),
                         [(784, 784, False), (784, 10, True), (8, 8, True), (784, 783, True)])
def test_a_linear_output_of_its_inputs_dimensions_is_a_reconstruction(
        width: int, outputs: int, decisions: bool) -> None:
    """An autoencoder's [N, 784] pixels were read as argmax decisions over 784 "classes" (87 %
    agreed at 31 dB: exit 7). A classifier's scores stay decisions, and so do 8 scores of 8
    features, a coincidence of small numbers."""
    from qcal.accuracy.decisions import decision_rules

    assert ("y" in decision_rules(_dense_head(width, outputs))) is decisions


def _qa_head(squeezed: bool) -> onnx.ModelProto:
    """[N, T, 4] hidden states -> a linear head of 2 scores per position, split into start and
    end logits [N, T] (squeezed, as a question-answering head is exported) or kept [N, T, 1]."""
    nodes = [helper.make_node("MatMul", ["h", "w"], ["m"], name="qa"),
             helper.make_node("Add", ["m", "b"], ["scores"], name="qa_bias"),
             helper.make_node("Split", ["scores", "sizes"], ["s1", "e1"], name="split", axis=-1)]
    outputs = ["s1", "e1"]
    if squeezed:
        nodes += [helper.make_node("Squeeze", [f"{v}1", "last"], [f"{v}_logits"], name=f"sq_{v}")
                  for v in ("s", "e")]
        outputs = ["s_logits", "e_logits"]
    rng = np.random.default_rng(6)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", 7, 4])],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in outputs],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "w"),
                     onnx.numpy_helper.from_array(np.zeros(2, np.float32), "b"),
                     onnx.numpy_helper.from_array(np.array([1, 1], np.int64), "sizes"),
                     onnx.numpy_helper.from_array(np.array([-1], np.int64), "last")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_question_answering_start_and_end_logits_are_decisions_over_positions() -> None:
    """A linear head split into one score per position and squeezed: each output's argmax over
    the positions is the answer's start (end); they were read as values, SQNR only."""
    from qcal.accuracy.decisions import decision_rules

    rules = decision_rules(_qa_head(squeezed=True))
    assert set(rules) == {"s_logits", "e_logits"}
    assert all(rule.applies((2, 7)) for rule in rules.values())
    assert decision_rules(_qa_head(squeezed=False)) == {}  # a split alone: values


def _face_stage(probabilities: str | None) -> onnx.ModelProto:
    """An MTCNN-like face stage: x [N, 8] -> Gemm -> Relu, then three linear heads, `dense_5` [N, 4]
    (box offsets) and `dense_6` [N, 10] (landmarks) raw, `face` [N, 2] through `probabilities` (Softmax, Sigmoid, or raw)."""
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="trunk"),
             helper.make_node("Relu", ["h"], ["r"], name="relu")]
    inits = {"w": (8, 16)}
    for head, width in (("dense_5", 4), ("dense_6", 10), ("face", 2)):
        out = f"{head}_raw" if head == "face" and probabilities else head
        nodes.append(helper.make_node("Gemm", ["r", f"w_{head}"], [out], name=head))
        inits[f"w_{head}"] = (16, width)
    if probabilities:
        nodes.append(helper.make_node(probabilities, ["face_raw"], ["face"], name="probs"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["N", w])
         for v, w in (("dense_5", 4), ("dense_6", 10), ("face", 2))],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32),
                                                  name) for name, shape in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("probabilities", "read"), [
    ("Softmax", {"face"}), ("Sigmoid", {"face"}), (None, {"dense_5", "dense_6", "face"})])
def test_raw_linear_heads_beside_probabilities_are_values(
        probabilities: str | None, read: set[str]) -> None:
    """A Keras MTCNN output stage (heads named dense_5, dense_6, softmax_2) had the argmax of
    its box offsets and landmarks counted as class decisions: 93.75 % agreed at 26-44 dB,
    exit 7, while its face decision agreed on 300 of 300 windows. With no probabilities in the
    model, its linear outputs are still read as scores."""
    from qcal.accuracy.decisions import decision_rules

    assert set(decision_rules(_face_stage(probabilities))) == read


def test_a_shared_float_reference_runs_the_float_model_once_within_its_budget() -> None:
    from qcal.accuracy.reference import FloatReference

    rng = np.random.default_rng(1)
    data = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]

    def batches() -> list[tuple[dict[str, np.ndarray], int]]:
        return [({"x": d}, 2) for d in data]

    alone = compare_models(_scale_model(1.0), _scale_model(1.1), batches())
    reference = FloatReference()
    first = compare_models(_scale_model(1.0), _scale_model(1.1), batches(), reference=reference)
    assert len(reference.outputs) == 3 and first == alone

    class NoRuns:  # the float outputs must come from the reference now
        def get_outputs(self) -> object:
            return real.get_outputs()

        def run(self, *_: object) -> object:
            raise AssertionError("the float model ran again")

    real, reference.session = reference.session, NoRuns()
    assert compare_models(_scale_model(1.0), _scale_model(1.1), batches(),
                          reference=reference) == alone
    small = FloatReference(budget_bytes=2 * 5 * 4)  # room for one batch's output only
    compare_models(_scale_model(1.0), _scale_model(1.1), batches(), reference=small)
    assert len(small.outputs) == 1


def test_a_float_reference_holds_the_data_and_later_comparisons_read_none() -> None:
    """Once every batch and its float outputs are held, a comparison reads no data (the
    fallback's checks re-read a layout detector's compressed pages each time), with the same
    figures; past the budget the data is read as before."""
    from qcal.accuracy.reference import FloatReference

    rng = np.random.default_rng(2)
    data = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]

    def batches() -> Iterator[tuple[dict[str, np.ndarray], int]]:
        yield from (({"x": d.copy()}, 2) for d in data)

    def unread() -> Iterator[tuple[dict[str, np.ndarray], int]]:
        raise AssertionError("the data was read again")
        yield  # pragma: no cover

    alone = compare_models(_scale_model(1.0), _scale_model(1.1), batches())
    reference = FloatReference()
    assert compare_models(_scale_model(1.0), _scale_model(1.1), batches(),
                          reference=reference) == alone
    assert reference.holds_data and len(reference.feeds) == 3
    for scale in (1.1, 0.9):
        expected = compare_models(_scale_model(1.0), _scale_model(scale), batches())
        assert compare_models(_scale_model(1.0), _scale_model(scale), unread(),
                              reference=reference) == expected
    # outputs fit (3 x 2 x 5 floats), inputs as well only for the first two batches
    tight = FloatReference(budget_bytes=3 * 40 + 2 * 40)
    compare_models(_scale_model(1.0), _scale_model(1.1), batches(), reference=tight)
    assert len(tight.outputs) == 3 and len(tight.feeds) == 2 and not tight.holds_data
    assert compare_models(_scale_model(1.0), _scale_model(1.1), batches(),
                          reference=tight) == alone


class _SlowSession:
    """Stands in for an onnxruntime session: each run sleeps, says which thread ran it and how
    many ran at once, and fails on the batch holding `fail`."""

    def __init__(self, seconds: float, fail: float | None = None) -> None:
        self.seconds, self.fail = seconds, fail
        self.threads: list[int] = []
        self.running = self.most = 0
        self.lock = threading.Lock()

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.append(threading.get_ident())
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        if self.fail is not None and self.fail in feed["x"]:
            raise RuntimeError("onnxruntime failed")
        return [feed["x"] * 2]


def test_slow_quantized_runs_start_ahead_on_a_second_thread_in_data_order() -> None:
    from qcal.accuracy._ahead import runs_ahead

    feeds = [({"x": np.full(3, float(i), np.float32)}, 1) for i in range(8)]
    slow = _SlowSession(0.01)
    got = [(feed["x"][0], future.result()[0][0]) for feed, _, future in
           runs_ahead(slow, ["y"], iter(feeds))]
    assert got == [(float(i), 2.0 * i) for i in range(8)]  # in data order, each its own
    assert slow.most == 2 and len(set(slow.threads)) > 1
    fast = _SlowSession(0.0)  # runs of no time stay on the calling thread, one at a time
    list(runs_ahead(fast, ["y"], iter(feeds)))
    assert fast.most == 1 and set(fast.threads) == {threading.get_ident()}


def test_a_run_that_fails_ahead_is_named_by_its_own_sample() -> None:
    """An onnxruntime failure in a run started ahead is raised where that batch is compared,
    naming its sample, as when the runs went one by one."""
    from qcal.accuracy._ahead import runs_ahead

    feeds = [({"x": np.full(3, float(i), np.float32)}, 1) for i in range(6)]
    failing = _SlowSession(0.01, fail=4.0)
    seen = []
    with pytest.raises(RuntimeError):
        for feed, _, future in runs_ahead(failing, ["y"], iter(feeds)):
            seen.append(feed["x"][0])
            future.result()
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]


def _sigmoid_after(op: str, constant: float) -> onnx.ModelProto:
    """p = Sigmoid(x `op` constant), x and p of shape [N, 3, 5]."""
    nodes = [helper.make_node(op, ["x", "c"], ["t"], name="affine"),
             helper.make_node("Sigmoid", ["t"], ["p"], name="sigmoid")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 5])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 3, 5])],
        initializer=[onnx.numpy_helper.from_array(np.asarray(constant, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_sigmoid_output_is_read_as_yes_no_decisions_at_one_half() -> None:
    """Voice activity per frame, multi-label tags: every element of a sigmoid's output is a
    decision (p > 0.5), and the agreement counts them, as an independent threshold says."""
    x, _, _ = _sequence_data()
    x = x * np.float32(10.0)  # a trained model's: most probabilities near 0 or 1
    shift = np.float32(3.0)
    expected = float(np.mean((x > 0) == (x + shift > 0)))  # sigmoid(t) > 0.5 iff t > 0
    assert 0.0 < expected < 1.0
    out = compare_models(_sigmoid_after("Add", 0.0), _sigmoid_after("Add", shift),
                         [({"x": x}, 4)]).outputs[0]
    assert out.decisions == "threshold"
    assert out.top1_agreement == pytest.approx(expected)


def test_a_scaled_sigmoid_is_values_not_decisions_at_one_half() -> None:
    """GLPN's depth is 10 sigmoid(x): its 0.5 is a sigmoid's 0.05, so it holds no yes/no
    decisions there (they were counted, 501760 of them, with an F1); it is judged by SQNR."""
    x, _, _ = _sequence_data()
    x = x * np.float32(10.0)
    model = _sigmoid_after("Add", 0.0)
    model.graph.node[-1].output[0] = "p_unit"
    model.graph.node.append(helper.make_node("Mul", ["p_unit", "depth"], ["p"], name="scale"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.float32(10.0), "depth"))
    out = compare_models(model, model, [({"x": x}, 4)]).outputs[0]
    assert out.decisions is None and out.top1_agreement is None and out.yes_f1 is None


def test_a_sigmoid_output_of_mostly_undecided_values_is_judged_by_its_sqnr() -> None:
    """An image through a sigmoid (a style-transfer network's) holds values, not decisions:
    with most of its float probabilities between 0.2 and 0.8, small errors move many of them
    across 0.5. It is compared by SQNR alone, and a small error meets the floor."""
    x = np.random.default_rng(8).uniform(-1.5, 1.5, (64, 3, 5)).astype(np.float32)
    shift = np.float32(0.02)
    assert np.mean((x > 0) != (x + shift > 0)) > 0.005  # as decisions: below 99 %
    comparison = compare_models(_sigmoid_after("Add", 0.0), _sigmoid_after("Add", shift),
                                [({"x": x}, 64)])
    out = comparison.outputs[0]
    assert out.decisions is None and out.top1_agreement is None and out.yes_f1 is None
    p = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    q = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) + shift)))
    expected = 10.0 * np.log10(np.sum(p * p) / np.sum((p - q) ** 2))
    assert out.sqnr_db == pytest.approx(expected, abs=0.01)
    assert CalibrationConfig().accuracy_target().is_met(comparison)


def test_a_mask_whose_background_sits_near_0_1_is_read_as_decisions() -> None:
    """A binary segmentation's background at 0.11-0.15 (93 % of its probabilities between 0.1
    and 0.9) is a clear no at every pixel: its mask is read as yes/no decisions at 0.5, as an
    independent count says, not as an image judged by its SQNR."""
    rng = np.random.default_rng(9)
    background = rng.normal(-1.9, 0.1, (64, 3, 4))  # sigmoid 0.11-0.15
    foreground = rng.normal(1.5, 1.0, (64, 3, 1))
    x = np.concatenate([background, foreground], axis=2).astype(np.float32)
    shift = np.float32(-0.5)  # some foreground pixels cross 0.5, no background pixel does
    expected = float(np.mean((x > 0) == (x + shift > 0)))
    assert 0.0 < expected < 1.0
    out = compare_models(_sigmoid_after("Add", 0.0), _sigmoid_after("Add", shift),
                         [({"x": x}, 64)]).outputs[0]
    assert out.decisions == "threshold"
    assert out.top1_agreement == pytest.approx(expected)


def test_a_sparse_sigmoid_map_is_held_to_the_sqnr_floor_as_well() -> None:
    """A map whose positives are 2 % of it (a pitch detector's notes) agrees at 0.5 on nearly
    every element while its probabilities are far off: the floor's SQNR applies to a sigmoid's
    output too, not to an argmax's."""
    rng = np.random.default_rng(7)
    x = np.where(rng.random((50, 3, 5)) < 0.02, 2.0, -6.0).astype(np.float32)
    x += rng.normal(0.0, 0.1, x.shape).astype(np.float32)
    comparison = compare_models(_sigmoid_after("Mul", 1.0), _sigmoid_after("Mul", 0.12),
                                [({"x": x}, 50)])
    out = comparison.outputs[0]
    assert out.decisions == "threshold" and out.top1_agreement == 1.0  # every decision holds
    assert out.sqnr_db is not None and out.sqnr_db < 10  # the probabilities do not
    floor = CalibrationConfig().accuracy_target()
    assert floor.floor_sqnr is True
    assert not floor.is_met(comparison)
    # per-position scores are judged by their decisions alone (a decoder reads their argmax)
    positions = compare_models(_scale_model(1.0, rank=3), _scale_model(0.5, rank=3),
                               [({"x": x}, 50)])
    out = positions.outputs[0]
    assert out.decisions == "argmax" and out.variation_sqnr_db is None and floor.is_met(positions)
    # per-sample scores by their SQNR too: one row per sample may be a regression head's
    logits = compare_models(_scale_model(1.0), _scale_model(0.5), [({"x": x[:, 0]}, 50)])
    assert logits.outputs[0].decisions == "argmax" and logits.outputs[0].top1_agreement == 1.0
    assert not floor.is_met(logits)


@pytest.mark.parametrize(("op", "value", "scores"), [("Div", 2.5, True), ("Mul", 0.4, True),
                                                     ("Mul", -1.0, False)])
def test_logits_scaled_by_a_temperature_are_still_scores(op: str, value: float,
                                                         scores: bool) -> None:
    """A positive constant scale changes no argmax: the output is still read by its decisions;
    a negative one reverses the order, and the output is no longer taken for scores."""
    model = _scale_model(1.0)
    model.graph.node[0].output[0] = "logits"
    model.graph.node.append(helper.make_node(op, ["logits", "t"], ["y"], name="temperature"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.float32(value), "t"))
    data = [np.arange(10, dtype=np.float32).reshape(2, 5)]
    out = compare_models(model, model, (({"x": d}, 2) for d in data)).outputs[0]
    assert (out.top1_agreement == 1.0) if scores else (out.top1_agreement is None)


def test_outputs_handed_to_a_float_reference_are_kept_in_order_within_its_budget() -> None:
    """Batches handed over past the budget are dropped, and none after them is kept either: a
    later batch must never stand in for an earlier one."""
    from qcal.accuracy.reference import FloatReference

    sizes = [3, 5, 1]  # floats per batch; the budget holds the first, not the second
    reference = FloatReference(budget_bytes=4 * 4)
    for size in sizes:
        reference.keep(["y"], [np.zeros(size, np.float32)])
    assert [len(o[0]) for o in reference.outputs] == [3]
    other = FloatReference()
    other.keep(["y"], [np.zeros(2, np.float32)])
    other.keep(["z"], [np.zeros(2, np.float32)])  # another output set: not mixed in
    assert len(other.outputs) == 1 and other.names == ["y"]


def _thresholded(threshold: float, op: str) -> onnx.ModelProto:
    """ArgMax of x + threshold per row (int64 labels), or the indices where x > threshold
    (NonZero: as many as there are, a shape that depends on the values)."""
    nodes = [helper.make_node("Add", ["x", "t"], ["shifted"])]
    if op == "ArgMax":
        nodes.append(helper.make_node("ArgMax", ["shifted"], ["y"], axis=1, keepdims=0))
    else:
        nodes += [helper.make_node("Greater", ["shifted", "zero"], ["mask"]),
                  helper.make_node("NonZero", ["mask"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        initializer=[onnx.numpy_helper.from_array(
                         np.array([threshold, 0, 0, 0, 0], np.float32), "t"),
                     onnx.numpy_helper.from_array(np.float32(0), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_integer_outputs_are_judged_by_the_share_of_equal_elements() -> None:
    """Labels have no SQNR (an index one off is no closer than one far off): the share of
    equal elements is their agreement."""
    rng = np.random.default_rng(12)
    data = [rng.standard_normal((8, 5)).astype(np.float32) for _ in range(4)]
    out = compare_models(_thresholded(0.0, "ArgMax"), _thresholded(0.4, "ArgMax"),
                         (({"x": d}, 8) for d in data)).outputs[0]
    x = np.concatenate(data)
    shifted = x + np.array([0.4, 0, 0, 0, 0], np.float32)
    expected = np.mean(np.argmax(x, axis=1) == np.argmax(shifted, axis=1))
    assert 0 < expected < 1
    assert out.sqnr_db is None and out.top1_agreement == pytest.approx(expected)
    # How far the labels moved is still said.
    labels = np.argmax(x, axis=1), np.argmax(shifted, axis=1)
    assert out.max_abs_error == np.max(np.abs(labels[0] - labels[1])) > 0 and out.cosine < 1


def test_outputs_of_another_shape_are_decisions_that_differ() -> None:
    """NonZero finds another count on some samples: no error, and those samples disagree."""
    rng = np.random.default_rng(13)
    data = [rng.standard_normal((1, 5)).astype(np.float32) for _ in range(20)]
    out = compare_models(_thresholded(0.0, "NonZero"), _thresholded(0.3, "NonZero"),
                         (({"x": d}, 1) for d in data)).outputs[0]
    other = sum(int(d[0, 0] > 0) != int(d[0, 0] + np.float32(0.3) > 0) for d in data)
    assert 0 < other < 20
    assert out.top1_agreement == pytest.approx(1 - other / 20)


@pytest.mark.parametrize(("quantized", "floor", "fails"),
                         [(10, 70.0, True), (70, 70.0, False), (0, 0.0, False), (10, None, False)])
def test_the_coverage_floor_is_a_gate_when_the_fallback_is_on(
    quantized: int, floor: float | None, fails: bool
) -> None:
    """With the fallback on (the default), less than the coverage floor's share of the compute
    running in integers fails the run, whatever kept it float; --no-fallback (no floor) and
    --min-coverage 0 let such a model through."""
    coverage = Coverage(basis="macs", compute_nodes=2, quantized_nodes=1, macs_total=100,
                        macs_quantized=quantized)
    results = check_gates(Gates(coverage_floor=floor), None, coverage)
    assert [r.option for r in results] == (["coverage-floor"] if fails else [])
    if fails:
        assert results[0].value == pytest.approx(quantized) and not results[0].passed
        assert "the coverage floor 70 (--min-coverage): FAILED" in results[0].describe()


def test_a_model_without_compute_fails_the_coverage_floor_only_with_nothing_quantized() -> None:
    """A model with no Conv/MatMul/Gemm of which no node is quantized is the float model (a
    logistic regression's LinearClassifier exited 0 so); one with other nodes quantized is not."""
    coverage = Coverage(basis="nodes", compute_nodes=0, quantized_nodes=0, macs_total=None,
                        macs_quantized=None, anything_quantized=False)
    (gate,) = check_gates(Gates(coverage_floor=70.0), None, coverage)
    assert gate.option == "coverage-floor" and not gate.passed and gate.value == 0.0
    assert "the model has none, and no other node of it is quantized" in gate.measure
    something = dataclasses.replace(coverage, anything_quantized=True)
    assert check_gates(Gates(coverage_floor=70.0), None, something) == []


def _spelled_softmax(shift: float, normalise: bool = True) -> onnx.ModelProto:
    """softmax(x + shift on class 0) as jax2tf writes it: Exp, ReduceSum, Div (or, without
    `normalise`, the Exp alone: positive scores whose rows do not sum to 1)."""
    nodes = [helper.make_node("Add", ["x", "t"], ["shifted"]),
             helper.make_node("Exp", ["shifted"], ["e" if normalise else "y"])]
    if normalise:
        nodes += [helper.make_node("ReduceSum", ["e", "axes"], ["total"], keepdims=1),
                  helper.make_node("Div", ["e", "total"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializer=[onnx.numpy_helper.from_array(np.array([shift, 0, 0, 0, 0], np.float32), "t"),
                     onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_softmax_however_spelled_is_read_as_decisions() -> None:
    """No Softmax node: the rows measured as probability distributions on every batch make
    the output's argmax the decisions (agreement counted independently here)."""
    rng = np.random.default_rng(14)
    data = [rng.standard_normal((8, 5)).astype(np.float32) for _ in range(3)]
    out = compare_models(_spelled_softmax(0.0), _spelled_softmax(0.5),
                         (({"x": d}, 8) for d in data)).outputs[0]
    x = np.concatenate(data)
    expected = np.mean(np.argmax(x, 1) == np.argmax(x + np.array([0.5, 0, 0, 0, 0], np.float32), 1))
    assert 0 < expected < 1 and out.top1_agreement == pytest.approx(expected)
    # Positive scores whose rows do not sum to 1 are no distributions: SQNR and cosine only.
    scores = compare_models(_spelled_softmax(0.0, False), _spelled_softmax(0.5, False),
                            (({"x": d}, 8) for d in data)).outputs[0]
    assert scores.top1_agreement is None and scores.sqnr_db is not None


def test_rows_that_stop_being_distributions_are_not_decisions() -> None:
    """Measured on every batch: rows that sum to 1 in the first batch only say nothing."""
    rng = np.random.default_rng(15)
    first = rng.dirichlet(np.ones(5), size=4).astype(np.float32)
    later = rng.standard_normal((4, 5)).astype(np.float32)
    out = compare_models(_scale_model(1.0, "Mul"), _scale_model(1.1, "Mul"),
                         iter([({"x": first}, 4), ({"x": later}, 4)])).outputs[0]
    assert out.top1_agreement is None
    only_first = compare_models(_scale_model(1.0, "Mul"), _scale_model(1.1, "Mul"),
                                iter([({"x": first}, 4)])).outputs[0]
    assert only_first.top1_agreement == 1.0  # scaling keeps every argmax


def _conv_head(weight: np.ndarray, head: str) -> onnx.ModelProto:
    """A convolutional classifier head on [N, 4, 3, 3] features: a 1x1 Conv to 5 class maps,
    then Relu -> GlobalAveragePool -> Flatten (SqueezeNet), or GlobalAveragePool -> Conv ->
    Reshape (Keras MobileNetV3), or the maps' mean over a model's hidden states (no scores)."""
    w = onnx.numpy_helper.from_array(weight, "w")
    shape = onnx.numpy_helper.from_array(np.array([-1, 5], np.int64), "shape")
    if head == "squeezenet":  # its bias added on its own, as paddle2onnx writes it
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="cls"),
                 helper.make_node("Add", ["c", "b"], ["maps"], name="bias"),
                 helper.make_node("Relu", ["maps"], ["r"], name="relu"),
                 helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
                 helper.make_node("Flatten", ["p"], ["y"], name="flat")]
    elif head == "mobilenet":
        nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"], name="gap"),
                 helper.make_node("Conv", ["p", "w"], ["maps"], name="cls"),
                 helper.make_node("Reshape", ["maps", "shape"], ["y"], name="flat")]
    elif head == "landmarks":  # a Conv over the whole map, reshaped: coordinates (MediaPipe)
        nodes = [helper.make_node("Conv", ["x", "w"], ["coords"], name="points"),
                 helper.make_node("Reshape", ["coords", "shape"], ["y"], name="flat")]
        w = onnx.numpy_helper.from_array(np.tile(weight, (1, 1, 3, 3)), "w")
    else:  # pooled hidden states of a linear layer: an embedding, not scores
        nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1], name="nhwc"),
                 helper.make_node("MatMul", ["t", "wt"], ["h"], name="proj"),
                 helper.make_node("ReduceMean", ["h", "axes"], ["y"], keepdims=0, name="mean")]
        w = onnx.numpy_helper.from_array(weight.reshape(5, 4).T.copy(), "wt")
        shape = onnx.numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializer=[w, shape, onnx.numpy_helper.from_array(
            np.linspace(-0.2, 0.2, 5, dtype=np.float32).reshape(1, 5, 1, 1), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize(("head", "scores"), [("squeezenet", True), ("mobilenet", True),
                                              ("embedding", False), ("landmarks", False)])
def test_a_convolutional_classifier_head_is_read_by_its_decisions(head: str, scores: bool) -> None:
    """Class maps pooled (or a 1x1 Conv on pooled features) and flattened are scores: their
    argmax agreement is counted, as an independent argmax says; the mean of a linear layer's
    hidden states is an embedding and has none, nor a Conv over a feature map reshaped to
    [N, K] (MediaPipe's landmark models write their coordinates so: the argmax of 213
    coordinates failed an iris model's floor at 87.5 % while its points moved 0.5 px)."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((16, 4, 3, 3)).astype(np.float32)
    w = rng.standard_normal((5, 4, 1, 1)).astype(np.float32)
    noisy = (w + rng.standard_normal(w.shape).astype(np.float32) * 0.6).astype(np.float32)
    out = compare_models(_conv_head(w, head), _conv_head(noisy, head),
                         [({"x": x}, 16)]).outputs[0]
    if not scores:
        assert out.top1_agreement is None
        return
    expected = _argmax_agreement(_conv_head(w, head), _conv_head(noisy, head), x)
    assert 0 < expected < 1
    assert out.top1_agreement == pytest.approx(expected)


def _argmax_agreement(a: onnx.ModelProto, b: onnx.ModelProto, x: np.ndarray) -> float:
    """The share of positions where two models' outputs on `x` have the same argmax over axis
    1, run in onnxruntime and counted with numpy."""
    import onnxruntime as ort

    def run(model: onnx.ModelProto) -> np.ndarray:
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return np.asarray(session.run(None, {"x": x})[0])

    return float(np.mean(run(a).argmax(1) == run(b).argmax(1)))


def test_a_flip_between_classes_the_float_model_scores_alike_is_no_disagreement() -> None:
    """The float model's top two within a hundred float32 steps: a tie it does not hold
    itself (untrained networks, near-uniform softmax); a real margin flips as before."""
    from qcal.accuracy.decision_counts import TIE_TOLERANCE, DecisionRule

    rule = DecisionRule()
    x = np.array([[0.2, 0.2 - 1e-7, 0.1], [0.2, 0.19, 0.1]], np.float32)
    y = np.array([[0.2, 0.2 + 1e-6, 0.1], [0.2, 0.21, 0.1]], np.float32)
    assert 1e-7 < TIE_TOLERANCE * 0.2 < 0.01
    agree, decisions, classes = rule.count(x, y)
    assert (agree, decisions) == (1, 2) and list(classes) == [0, 0]  # the second flip counts
    sigmoid = DecisionRule(threshold=True)
    p = np.array([0.5 + 1e-7, 0.6], np.float32)
    q = np.array([0.5 - 1e-7, 0.4], np.float32)
    assert sigmoid.count(p, q)[:2] == (1, 2)


@pytest.mark.parametrize(("name", "decisions"), [("logits", True), ("text_embeds", False),
                                                 ("pred_boxes", False), ("scores", True)])
def test_an_output_named_as_a_value_holds_no_decisions(name: str, decisions: bool) -> None:
    """A CLIP tower's projected embedding and a DETR head's boxes come from a linear layer or a
    sigmoid as scores do; their names say they are values, and no argmax is counted."""
    model = _scale_model(1.0)
    model.graph.node[0].output[0] = name
    model.graph.output[0].name = name
    data = [np.arange(10, dtype=np.float32).reshape(2, 5)]
    out = compare_models(model, model, (({"x": d}, 2) for d in data)).outputs[0]
    assert (out.top1_agreement == 1.0) if decisions else (out.top1_agreement is None)


@pytest.mark.parametrize(("value", "decimals", "shown"), [
    (9.956, 1, "9.9"),  # under the 10 dB floor: never "10.0"
    (98.996, 2, "98.99"),  # under the 99 % floor: never "99.00"
    (100 * 0.29, 2, "29.00"),  # 28.999999999999996 in binary: still 29.00
    (41.25, 1, "41.2"),
    (-3.21, 1, "-3.3"),  # down, not toward zero
    (100.0, 2, "100.00"),
])
def test_a_figure_just_under_a_floor_never_shows_as_the_floor(
    value: float, decimals: int, shown: str
) -> None:
    from qcal.accuracy.target import shown_down

    assert shown_down(value, decimals) == shown


def _map_head(weight: np.ndarray, head: str) -> onnx.ModelProto:
    """x [N, 4, 6, 6] -> a 1x1 Conv of `weight` (classes x 4) -> per `head`: "resized" (a
    Resize to 12 x 12, a segmentation's logits brought to the image), "softmax" (a softmax over
    the channels) or "stride" (the Conv's maps as they are, a detector's head), output "y";
    "logits": those maps as they are, output "logits"."""
    classes = weight.shape[0]
    out = "logits" if head == "logits" else "y"
    nodes = [helper.make_node("Conv", ["x", "w"], [out if head in ("stride", "logits")
                                                   else "maps"], name="head")]
    if head == "resized":
        nodes.append(helper.make_node("Resize", ["maps", "", "scales"], ["y"], name="up",
                                      mode="linear"))
    elif head == "softmax":
        nodes.append(helper.make_node("Softmax", ["maps"], ["y"], name="probs", axis=1))
    side = 12 if head == "resized" else 6
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", classes, side, side])],
        initializer=[onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(
            np.array([1, 1, 2, 2], np.float32), "scales")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize(("head", "classes", "decisions"), [
    ("resized", 5, True), ("softmax", 2, True), ("stride", 5, False), ("resized", 2, False),
    ("logits", 5, True)])
def test_a_segmentations_maps_are_read_as_a_class_per_pixel(head: str, classes: int,
                                                            decisions: bool) -> None:
    """A segmentation's logits upsampled by a Resize, or a softmax over a map's channels, hold
    one decision per pixel: the argmax over axis 1, as an independent argmax says (LRASPP and
    DeepLabV3 passed the SQNR floor on values while 15-25 % of their pixels changed class), and
    so do a Conv's maps named logits (a UNet's, a SegFormer's). A Conv's maps at its own stride
    otherwise named (a detector's heads, a pose model's heatmaps) stay values, and so do two
    channels resized (a flow's dx and dy)."""
    rng = np.random.default_rng(41)
    x = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
    w = rng.standard_normal((classes, 4, 1, 1)).astype(np.float32)
    noisy = (w + rng.standard_normal(w.shape).astype(np.float32) * 0.5).astype(np.float32)
    out = compare_models(_map_head(w, head), _map_head(noisy, head), [({"x": x}, 8)]).outputs[0]
    if not decisions:
        assert out.top1_agreement is None
        return
    expected = _argmax_agreement(_map_head(w, head), _map_head(noisy, head), x)
    assert 0 < expected < 1
    assert out.decisions == "argmax"
    assert out.top1_agreement == pytest.approx(expected)
