"""Models whose work happens inside an If (a streaming model choosing its path by the sample
rate): their outputs read as decisions, their error localised inside the branch, and what a
tensor kept float there takes with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.decisions import decision_rules
from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.localise import localise_error
from qcal.accuracy.restrict import restrict_plan
from qcal.graph.integer_kernels import integer_output_writers
from qcal.graph.model import SelectionRules, plan_quantization, prepare_model

_OPSET = [helper.make_opsetid("", 17)]


def _branch(name: str, nodes: list[onnx.NodeProto], output: str,
            constants: dict[str, np.ndarray] | None = None) -> onnx.GraphProto:
    return helper.make_graph(
        nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in (constants or {}).items()])


def _if_model(then_branch: onnx.GraphProto, else_branch: onnx.GraphProto,
              x_shape: list[int | str]) -> onnx.ModelProto:
    """y = If(flag) over `x` of `x_shape` read from the outer scope, returned through an
    Identity (as torch.onnx writes a scripted model's output)."""
    nodes = [helper.make_node("If", ["flag"], ["chosen"], name="choose",
                              then_branch=then_branch, else_branch=else_branch),
             helper.make_node("Identity", ["chosen"], ["y"], name="out")]
    graph = helper.make_graph(
        nodes, "g", [float_input("x", x_shape),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=_OPSET, ir_version=8)


def _pooled_sigmoid(prefix: str, bias: float) -> onnx.GraphProto:
    """Sigmoid(x + bias) averaged over axis 1, as a voice-activity model scores a chunk; the
    Sigmoid's input is read from a nested If (a squeeze only when axis 0 is 1)."""
    squeeze = helper.make_node(
        "If", [f"{prefix}_one"], [f"{prefix}_s"], name=f"{prefix}_squeeze",
        then_branch=_branch(f"{prefix}_sq", [helper.make_node("Identity", [f"{prefix}_p"],
                                                              [f"{prefix}_sq_out"])],
                            f"{prefix}_sq_out"),
        else_branch=_branch(f"{prefix}_id", [helper.make_node("Identity", [f"{prefix}_p"],
                                                              [f"{prefix}_id_out"])],
                            f"{prefix}_id_out"))
    nodes = [helper.make_node("Add", ["x", f"{prefix}_b"], [f"{prefix}_t"]),
             helper.make_node("Sigmoid", [f"{prefix}_t"], [f"{prefix}_p"]),
             helper.make_node("Constant", [], [f"{prefix}_one"],
                              value=numpy_helper.from_array(np.array(True))),
             squeeze,
             helper.make_node("ReduceMean", [f"{prefix}_s"], [f"{prefix}_m"], axes=[1],
                              keepdims=0),
             helper.make_node("Unsqueeze", [f"{prefix}_m", f"{prefix}_axes"], [f"{prefix}_o"])]
    return _branch(prefix, nodes, f"{prefix}_o",
                   {f"{prefix}_b": np.array(bias, np.float32),
                    f"{prefix}_axes": np.array([1], np.int64)})


def test_a_sigmoid_every_branch_of_an_if_returns_is_read_as_yes_no_decisions() -> None:
    """The If's output holds decisions at 0.5 when each branch computes it from a Sigmoid
    (through a nested If, a mean and reshapes); the agreement counts them as an independent
    threshold does. A branch returning anything else makes it a value."""
    model = _if_model(_pooled_sigmoid("a", 0.0), _pooled_sigmoid("b", 0.0), ["N", 6])
    assert decision_rules(model)["y"].threshold
    shifted = _if_model(_pooled_sigmoid("a", 3.0), _pooled_sigmoid("b", 3.0), ["N", 6])
    rng = np.random.default_rng(3)
    # a trained model's rows: sigmoids near 0 or 1 (means of them too), a few undecided
    x = (rng.standard_normal((64, 1)) * 6 + rng.standard_normal((64, 6)) * 0.5).astype(np.float32)
    feed = {"x": x, "flag": np.array(True)}

    def mean_sigmoid(bias: float) -> np.ndarray:
        return np.mean(1.0 / (1.0 + np.exp(-(x + bias))), axis=1)

    expected = float(np.mean((mean_sigmoid(0.0) > 0.5) == (mean_sigmoid(3.0) > 0.5)))
    assert 0.0 < expected < 1.0
    out = compare_models(model, shifted, [(feed, 64)]).outputs[0]
    assert out.top1_agreement == pytest.approx(expected)

    relu = _branch("r", [helper.make_node("Relu", ["x"], ["r_o"])], "r_o")
    assert "y" not in decision_rules(_if_model(_pooled_sigmoid("a", 0.0), relu, ["N", 6]))


def _matmul_branch() -> onnx.GraphProto:
    rng = np.random.default_rng(5)
    weights = {f"w{i}": (rng.standard_normal((8, 8)) * 0.4).astype(np.float32)
               for i in (1, 2, 3)}
    nodes, previous = [], "x"
    for i in (1, 2, 3):
        nodes += [helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"h{i}"], name=f"tanh{i}")]
        previous = f"h{i}"
    return _branch("then", nodes, "h3", weights)


def test_the_error_made_inside_an_if_branch_is_localised_at_its_tensor() -> None:
    """Three MatMuls inside an If's branch: an error put into the second one's weight jumps
    there, so that weight and its input take the jump, and the first MatMul takes none; no
    value of the branch is an output of the model, yet each is measured."""
    other = _branch("else", [helper.make_node("Identity", ["x"], ["e_o"])], "e_o")
    model, _ = prepare_model(_if_model(_matmul_branch(), other, ["N", 8]))
    plan = plan_quantization(model, SelectionRules())
    assert {"w1", "w2", "w3"} <= {w.tensor for w in plan.weights}
    assert {"h1", "h2"} <= {a.tensor for a in plan.activations}
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    branch = next(a.g for a in broken.graph.node[0].attribute if a.name == "then_branch")
    for tensor in branch.initializer:
        if tensor.name == "w2":  # as if its quantization had gone badly wrong
            values = numpy_helper.to_array(tensor) * 1.5
            tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float32), "w2"))
    rng = np.random.default_rng(7)
    feed = {"x": rng.standard_normal((16, 8)).astype(np.float32), "flag": np.array(True)}
    harm = {s.tensor: s.harm for s in localise_error(model, broken, plan, [(feed, 16)]).tensors}
    assert harm["w2"] > 0.01 and harm["h1"] == harm["w2"]
    assert harm.get("w1", 0.0) == 0.0 and harm.get("w3", 0.0) < 0.1 * harm["w2"]


def test_an_input_kept_float_takes_the_weight_of_the_conv_reading_it() -> None:
    """Given a float input, onnxruntime has no integer kernel for a Conv: its weight would be
    dequantized at every run for a float Conv. Keeping the input float keeps the weight float
    too, and the Conv is no longer quantized, with the reason."""
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv3", pads=[1, 1, 1, 1])]
    weights = {f"w{i}": (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
               for i in (1, 2, 3)}
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"],
                                         weights))
    plan = plan_quantization(model, SelectionRules())
    assert {"r1", "w2"} <= {a.tensor for a in plan.activations} | {w.tensor for w in plan.weights}
    restricted = restrict_plan(plan, {"r1": "test"}, integer_output_writers(model.graph))
    # conv1 writes r1 through its fused Relu: float whole (its own rule); conv3 untouched
    assert {w.tensor for w in restricted.weights} == {"w3"}
    conv2 = next(d for d in restricted.nodes if d.node == "conv2")
    assert not conv2.quantized and "dequantize the weight at every run" in conv2.reason


def _calibrate_cli(model: onnx.ModelProto, folder: Path) -> str:
    """`qcal calibrate` on `model` (an If over x [N, 8] read by its branches) with 16 samples
    taking the then-branch; its output, whitespace joined (rich wraps lines)."""
    from click.testing import CliRunner

    from qcal.cli import main

    path = folder / "branchy.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(13)
    np.savez(folder / "data.npz", x=rng.standard_normal((16, 1, 8)).astype(np.float32),
             flag=np.ones(16, bool))
    result = CliRunner().invoke(main, ["calibrate", str(path), "--data", str(folder / "data.npz"),
                                       "-o", str(folder / "q.onnx"), "--report",
                                       str(folder / "q.json"), "--allow-slower"])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_a_model_whose_compute_is_all_in_a_branch_claims_no_share(tmp_path: Path) -> None:
    """Coverage counts the main graph: with every MatMul inside an If, there is no share of
    compute to state, and the summary says so instead of 100 % (the warning counts the
    branch's MatMuls and how many are quantized)."""
    other = _branch("else", [helper.make_node("Identity", ["x"], ["e_o"])], "e_o")
    said = _calibrate_cli(_if_model(_matmul_branch(), other, ["N", 8]), tmp_path)
    assert "no Conv/MatMul/Gemm in the main graph" in said
    assert "% of Conv/MatMul/Gemm" not in said
    assert "3 Conv/MatMul/Gemm nodes inside If/Loop/Scan bodies" in said


def test_the_summary_says_its_share_is_the_main_graphs_when_bodies_hold_compute(
        tmp_path: Path) -> None:
    """A MatMul after an If whose branch holds three: "100 %" of compute said nothing of the
    branch's (a Keras GRU that tf2onnx writes as a Loop was "100 % quantized", all float)."""
    other = _branch("else", [helper.make_node("Identity", ["x"], ["e_o"])], "e_o")
    model = _if_model(_matmul_branch(), other, ["N", 8])
    model.graph.node[-1].CopyFrom(helper.make_node("MatMul", ["chosen", "head"], ["y"],
                                                   name="head"))
    model.graph.initializer.append(numpy_helper.from_array(
        np.random.default_rng(14).standard_normal((8, 8)).astype(np.float32), "head"))
    said = _calibrate_cli(model, tmp_path)
    assert "of the main graph's Conv/MatMul/Gemm MACs (" in said
    assert "of 1 nodes; 3 more inside If/Loop/Scan bodies, not counted)" in said
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["coverage"]["compute_nodes_in_bodies"] == 3


def test_an_if_returning_indices_is_no_float_value_to_watch() -> None:
    """An If in the main graph that returns int64 indices (torchvision's detectors choose a
    Slice's end so): the localisation watches float values only, so its measuring models load
    and the error is found where it is made."""
    rng = np.random.default_rng(29)
    ends = [helper.make_node("Constant", [], [f"{b}_e"],
                             value=numpy_helper.from_array(np.array([n], np.int64)))
            for b, n in (("t", 4), ("f", 6))]
    branches = [helper.make_graph([node], b, [], [helper.make_tensor_value_info(
        f"{b}_e", TensorProto.INT64, [1])]) for node, b in zip(ends, ("t", "f"))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w0"], ["h0"], name="mm0"),
             helper.make_node("If", ["flag"], ["end"], name="choose",
                              then_branch=branches[0], else_branch=branches[1]),
             helper.make_node("Slice", ["h0", "zero", "end", "one"], ["s"], name="slice"),
             helper.make_node("MatMul", ["s", "w2"], ["y"], name="mm2")]
    weights = {"w1": (rng.standard_normal((8, 8)) * 0.5).astype(np.float32),
               "w0": (rng.standard_normal((8, 8)) * 0.5).astype(np.float32),
               "w2": (rng.standard_normal((4, 3)) * 0.5).astype(np.float32),
               "zero": np.array([0], np.int64), "one": np.array([1], np.int64)}
    graph = helper.make_graph(
        nodes, "g", [float_input("x", ["N", 8]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    model, _ = prepare_model(helper.make_model(graph, opset_imports=_OPSET, ir_version=8))
    plan = plan_quantization(model, SelectionRules())
    # as qcal hands it on: the shapes the user did not declare dropped (onnxruntime fuses
    # differently with them), so the If's output is of no known type
    del model.graph.value_info[:]
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    for tensor in broken.graph.initializer:
        if tensor.name == "w1":
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 1.5, "w1"))
    feed = {"x": rng.standard_normal((4, 8)).astype(np.float32), "flag": np.array(True)}
    harm = {s.tensor: s.harm for s in localise_error(model, broken, plan, [(feed, 4)]).tensors}
    assert harm["w1"] > 0.01 and harm.get("w0", 0.0) < 0.01 * harm["w1"]
