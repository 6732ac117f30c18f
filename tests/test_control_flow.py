"""Control flow: tensors inside If, Loop and Scan bodies are observed during calibration (the
values of the branch actually taken, of every iteration) and quantized inside the body; a body
that never ran stays float and the report says so.

Every range is checked against the same tensor computed independently with numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.calibration.expose_subgraph_tensors import expose_subgraph_tensors
from qcal.cli import main
from qcal.config import CalibrationConfig
from qcal.pipeline import CalibrationResult, calibrate


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


def leaky_relu(x: np.ndarray, alpha: float = 0.1) -> np.ndarray:
    return np.where(x >= 0, x, np.float32(alpha) * x).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def weights(rng: np.random.Generator, *shape: int, scale: float = 0.5) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------ models


def if_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """r = Relu(x W0); if mean(x) > 0: LeakyRelu(r W1) (W1 in a Constant node), else
    Sigmoid(r W2); then y = b W3."""
    w = {
        "W0": weights(rng, 4, 6),
        "W1": weights(rng, 6, 6),
        "W2": weights(rng, 6, 6),
        "W3": weights(rng, 6, 3),
    }
    then = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["W1"], name="w1_const", value=numpy_helper.from_array(w["W1"])
            ),
            helper.make_node("MatMul", ["r", "W1"], ["t1"], name="then_mm"),
            helper.make_node("LeakyRelu", ["t1"], ["t2"], name="then_leaky", alpha=0.1),
        ],
        "then",
        [],
        [float_input("t2", ["N", 6])],
    )
    other = helper.make_graph(
        [
            helper.make_node("MatMul", ["r", "W2"], ["e1"], name="else_mm"),
            helper.make_node("Sigmoid", ["e1"], ["e2"], name="else_sigmoid"),
        ],
        "else",
        [],
        [float_input("e2", ["N", 6])],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["m"], name="mm0"),
        helper.make_node("Relu", ["m"], ["r"], name="relu0"),
        helper.make_node("ReduceMean", ["x"], ["mean"], name="mean", keepdims=0),
        helper.make_node("Greater", ["mean", "zero"], ["cond"], name="positive"),
        helper.make_node("If", ["cond"], ["b"], name="branch", then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["b", "W3"], ["y"], name="mm_out"),
    ]
    inits = {"W0": w["W0"], "W2": w["W2"], "W3": w["W3"], "zero": np.float32(0)}
    return build_model(nodes, [float_input("x", ["N", 4])], ["y"], inits), w


def if_reference(x: np.ndarray, w: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
    """Per sample (batch size 1), the values of the tensors the If model observes."""
    seen: dict[str, list[np.ndarray]] = {"r": [], "t1": [], "t2": [], "e1": [], "e2": []}
    for sample in x:
        r = relu(sample[None] @ w["W0"])
        seen["r"].append(r)
        if sample.mean() > 0:
            seen["t1"].append(r @ w["W1"])
            seen["t2"].append(leaky_relu(r @ w["W1"]))
        else:
            seen["e1"].append(r @ w["W2"])
            seen["e2"].append(sigmoid(r @ w["W2"]))
    return seen


def loop_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """h_0 = x; h_{k+1} = Relu(h_k W + x) for `trips` iterations (x read from the outer scope)."""
    w = {"W": weights(rng, 4, 4), "V": weights(rng, 4, 2)}
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "W"], ["hw"], name="body_mm"),
            helper.make_node("Add", ["hw", "x"], ["hx"], name="body_add"),
            helper.make_node("Relu", ["hx"], ["h_out"], name="body_relu"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
        ],
        "body",
        [
            helper.make_tensor_value_info("k", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            float_input("h_in", ["N", 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            float_input("h_out", ["N", 4]),
        ],
    )
    nodes = [
        helper.make_node("Loop", ["trips", "", "x"], ["h_final"], name="loop", body=body),
        helper.make_node("MatMul", ["h_final", "V"], ["y"], name="out_mm"),
    ]
    inputs = [
        float_input("x", ["N", 4]),
        helper.make_tensor_value_info("trips", TensorProto.INT64, []),
    ]
    model = build_model(nodes, inputs, [float_input("y", ["N", 2])], {"W": w["W"], "V": w["V"]})
    return model, w


def loop_reference(
    x: np.ndarray, trips: np.ndarray, w: dict[str, np.ndarray]
) -> dict[str, list[np.ndarray]]:
    seen: dict[str, list[np.ndarray]] = {"h_in": [], "hw": [], "hx": [], "h_out": []}
    for sample, count in zip(x, trips):
        h = sample[None]
        for _ in range(int(count)):
            seen["h_in"].append(h)
            seen["hw"].append(h @ w["W"])
            seen["hx"].append(h @ w["W"] + sample[None])
            h = relu(h @ w["W"] + sample[None])
            seen["h_out"].append(h)
    return seen


def scan_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Scan over axis 1 of x[N, T, 4]: s_{t+1} = Relu(x_t U + s_t); scan output s_{t+1}."""
    w = {"U": weights(rng, 4, 4)}
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["row", "U"], ["ru"], name="scan_mm"),
            helper.make_node("Add", ["ru", "s_in"], ["sa"], name="scan_add"),
            helper.make_node("Relu", ["sa"], ["s_out"], name="scan_relu"),
            helper.make_node("Identity", ["s_out"], ["o"], name="scan_copy"),
        ],
        "body",
        [float_input("s_in", ["N", 4]), float_input("row", ["N", 4])],
        [float_input("s_out", ["N", 4]), float_input("o", ["N", 4])],
    )
    nodes = [
        helper.make_node(
            "Scan",
            ["s0", "x"],
            ["s_final", "states"],
            name="scan",
            body=body,
            num_scan_inputs=1,
            scan_input_axes=[1],
            scan_output_axes=[1],
        ),
        helper.make_node("Relu", ["s_final"], ["y"], name="out_relu"),
    ]
    inputs = [float_input("x", ["N", 5, 4]), float_input("s0", ["N", 4])]
    outputs = [float_input("y", ["N", 4]), float_input("states", ["N", 5, 4])]
    return build_model(nodes, inputs, outputs, w), w


def scan_reference(
    x: np.ndarray, s0: np.ndarray, w: dict[str, np.ndarray]
) -> dict[str, list[np.ndarray]]:
    seen: dict[str, list[np.ndarray]] = {"row": [], "ru": [], "sa": [], "s_out": [], "s_in": []}
    for rows, state in zip(x, s0):
        s = state
        for t in range(rows.shape[1]):
            row = rows[:, t]
            seen["row"].append(row)
            seen["s_in"].append(s)
            seen["ru"].append(row @ w["U"])
            seen["sa"].append(row @ w["U"] + s)
            s = relu(row @ w["U"] + s)
            seen["s_out"].append(s)
    return seen


def nested_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A Loop whose body holds an If: odd iterations LeakyRelu(h A), even ones Sigmoid(h B)."""
    w = {"A": weights(rng, 3, 3), "B": weights(rng, 3, 3)}
    odd = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "A"], ["ha"], name="odd_mm"),
            helper.make_node("LeakyRelu", ["ha"], ["odd_out"], name="odd_leaky", alpha=0.1),
        ],
        "odd",
        [],
        [float_input("odd_out", ["N", 3])],
    )
    even = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "B"], ["hb"], name="even_mm"),
            helper.make_node("Sigmoid", ["hb"], ["even_out"], name="even_sigmoid"),
        ],
        "even",
        [],
        [float_input("even_out", ["N", 3])],
    )
    body = helper.make_graph(
        [
            helper.make_node("Mod", ["k", "two"], ["parity"], name="parity"),
            helper.make_node("Equal", ["parity", "one"], ["is_odd"], name="is_odd"),
            helper.make_node(
                "If", ["is_odd"], ["h_out"], name="step", then_branch=odd, else_branch=even
            ),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
        ],
        "body",
        [
            helper.make_tensor_value_info("k", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            float_input("h_in", ["N", 3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            float_input("h_out", ["N", 3]),
        ],
    )
    nodes = [helper.make_node("Loop", ["trips", "", "x"], ["y"], name="loop", body=body)]
    inits = {**w, "trips": np.int64(4), "two": np.int64(2), "one": np.int64(1)}
    return build_model(nodes, [float_input("x", ["N", 3])], [float_input("y", ["N", 3])], inits), w


# ----------------------------------------------------------------------------------- helpers


def calibrated(tmp_path: Path, model: onnx.ModelProto, **arrays: np.ndarray) -> CalibrationResult:
    """Every node with a rule quantized (placement "all"): these tests are about observing
    tensors inside bodies, which the small models here hold in elementwise ops. The data is
    the evaluation data too, so that every sample is observed (none held out for the floor)."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "calib.npz", **arrays)
    result = calibrate(path, CalibrationConfig(data=tmp_path / "calib.npz",
                                               eval_data=tmp_path / "calib.npz", placement="all"))
    onnx.checker.check_model(result.model, full_check=True)
    return result


def statistics(report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {
        t["name"]: (t["statistics"]["min"][0], t["statistics"]["max"][0])
        for t in report["tensors"]
        if t["role"] == "activation"
    }


def assert_ranges(
    report: dict[str, Any], reference: dict[str, list[np.ndarray]], required: set[str]
) -> None:
    """Every observed tensor of `reference` has the range numpy finds; `required` (read by
    quantized nodes inside bodies, so planned whatever the fusion rules) are observed."""
    found = statistics(report)
    assert required <= found.keys(), sorted(found)
    for tensor, values in reference.items():
        if tensor not in found or not values:
            continue
        flat = np.concatenate([v.ravel() for v in values])
        np.testing.assert_allclose(
            found[tensor], (flat.min(), flat.max()), rtol=1e-5, atol=1e-6, err_msg=tensor
        )


def body_ops(model: onnx.ModelProto, node_name: str) -> dict[str, list[str]]:
    """Op types per body of the main-graph node `node_name`."""
    node = next(n for n in model.graph.node if n.name == node_name)
    return {a.name: [n.op_type for n in a.g.node] for a in node.attribute if a.g.node}


def node_decisions(report: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    return {n["name"]: (n["quantized"], n["reason"]) for n in report["nodes"]}


# ------------------------------------------------------------------------------------- If


def test_both_if_branches_are_observed_with_the_values_of_the_branch_taken(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    model, w = if_model(rng)
    x = rng.standard_normal((24, 4)).astype(np.float32)
    reference = if_reference(x, w)
    assert reference["t2"] and reference["e1"]  # the data takes both branches
    result = calibrated(tmp_path, model, x=x)
    assert_ranges(result.report, reference, {"r", "t1", "e1"})
    ops = body_ops(result.model, "branch")
    for branch in ("then_branch", "else_branch"):
        assert "QuantizeLinear" in ops[branch] and "DequantizeLinear" in ops[branch]
    # W1 was a Constant node inside the then branch: stored as int8 codes there now.
    then = next(
        a.g
        for n in result.model.graph.node
        if n.name == "branch"
        for a in n.attribute
        if a.name == "then_branch"
    )
    assert {i.data_type for i in then.initializer if i.name.startswith("W1")} >= {TensorProto.INT8}
    decisions = node_decisions(result.report)
    assert all(decisions[n][0] for n in ("then_mm", "then_leaky", "else_mm", "else_sigmoid"))
    (output,) = result.report["evaluation"]["outputs"]
    assert output["sqnr_db"] > 25


def test_an_if_branch_never_taken_stays_float_and_is_reported(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    model, w = if_model(rng)
    x = np.abs(rng.standard_normal((12, 4))).astype(np.float32) + 0.1  # mean > 0: then only
    reference = if_reference(x, w)
    assert not reference["e1"]
    result = calibrated(tmp_path, model, x=x)
    assert_ranges(result.report, reference, {"r", "t1"})
    decisions = node_decisions(result.report)
    for node in ("else_mm", "else_sigmoid"):
        quantized, reason = decisions[node]
        assert not quantized and "never ran during calibration" in reason and "'branch'" in reason
    assert "e1" not in statistics(result.report) and "e2" not in statistics(result.report)
    ops = body_ops(result.model, "branch")
    assert ops["else_branch"] == ["MatMul", "Sigmoid"]  # untouched
    assert "QuantizeLinear" in ops["then_branch"]
    # The quantized model still runs its float else branch (on inputs outside the calibrated
    # ranges, so only the shape and finiteness of the result are checked).
    negative = -np.abs(rng.standard_normal((5, 4))).astype(np.float32)
    (got,) = run(result.model, {"x": negative})
    assert got.shape == (5, 3) and np.isfinite(got).all()


def test_the_console_summary_reports_the_branch_kept_float(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    model, _ = if_model(rng)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.abs(rng.standard_normal((6, 4))).astype(np.float32) + 0.1)
    result = CliRunner().invoke(
        main,
        [
            "calibrate",
            str(tmp_path / "m.onnx"),
            "--data",
            str(tmp_path / "d.npz"),
            "-o",
            str(tmp_path / "q.onnx"),
            "--report",
            str(tmp_path / "q.json"),
            "--placement",
            "all",
        ],
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the console wraps long lines
    assert "kept in float: 2 ×" in text and "never ran during calibration" in text


# ----------------------------------------------------------------------------------- Loop


def test_loop_body_tensors_are_observed_over_every_iteration(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    model, w = loop_model(rng)
    x = rng.standard_normal((10, 1, 4)).astype(np.float32)
    trips = rng.integers(1, 5, size=10).astype(np.int64)
    result = calibrated(tmp_path, model, x=x, trips=trips)
    assert_ranges(result.report, loop_reference(x[:, 0], trips, w), {"h_in", "hw"})
    ops = body_ops(result.model, "loop")["body"]
    # The body's MatMul weight is a main-graph initializer, dequantized inside the body; the
    # body's own tensors get their pairs there too.
    assert ops.count("QuantizeLinear") >= 2 and "DequantizeLinear" in ops
    # x's pair sits in the main graph, where x is defined; the body reads its DequantizeLinear.
    body = next(a.g for n in result.model.graph.node if n.name == "loop" for a in n.attribute)
    add = next(n for n in body.node if n.name == "body_add")
    producers = {o: n for g in (result.model.graph, body) for n in g.node for o in n.output}
    assert all(producers[i].op_type == "DequantizeLinear" for i in add.input)
    (output,) = result.report["evaluation"]["outputs"]
    assert output["sqnr_db"] > 25


def test_a_loop_that_never_iterates_leaves_its_body_float(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    model, _ = loop_model(rng)
    x = rng.standard_normal((4, 1, 4)).astype(np.float32)
    result = calibrated(tmp_path, model, x=x, trips=np.zeros(4, np.int64))
    decisions = node_decisions(result.report)
    for node in ("body_mm", "body_add", "body_relu"):
        assert not decisions[node][0] and "never ran" in decisions[node][1]
    assert "QuantizeLinear" not in body_ops(result.model, "loop")["body"]


# ----------------------------------------------------------------------------------- Scan


def test_scan_body_tensors_are_observed_and_quantized(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    model, w = scan_model(rng)
    x = rng.standard_normal((6, 1, 5, 4)).astype(np.float32)
    s0 = rng.standard_normal((6, 1, 4)).astype(np.float32)
    result = calibrated(tmp_path, model, x=x, s0=s0)
    assert_ranges(result.report, scan_reference(x, s0, w), {"row", "ru", "s_in"})
    ops = body_ops(result.model, "scan")["body"]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    outputs = {o["name"]: o for o in result.report["evaluation"]["outputs"]}
    assert outputs["y"]["sqnr_db"] > 25


# --------------------------------------------------------------------------------- nested


def test_an_if_inside_a_loop_is_observed_through_both(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    model, w = nested_model(rng)
    x = rng.standard_normal((5, 1, 3)).astype(np.float32)
    result = calibrated(tmp_path, model, x=x)
    seen: dict[str, list[np.ndarray]] = {"ha": [], "odd_out": [], "hb": [], "even_out": []}
    for sample in x:
        h = sample
        for k in range(4):
            if k % 2:
                seen["ha"].append(h @ w["A"])
                h = leaky_relu(h @ w["A"])
                seen["odd_out"].append(h)
            else:
                seen["hb"].append(h @ w["B"])
                h = sigmoid(h @ w["B"])
                seen["even_out"].append(h)
    assert_ranges(result.report, seen, {"ha", "hb"})
    loop = next(n for n in result.model.graph.node if n.name == "loop")
    step = next(n for n in loop.attribute[0].g.node if n.name == "step")
    for branch in step.attribute:
        assert "QuantizeLinear" in [n.op_type for n in branch.g.node]


# ------------------------------------------------------------------------------- routing


def test_routes_carry_exactly_the_values_of_body_tensors() -> None:
    rng = np.random.default_rng(7)
    model, w = if_model(rng)
    exposed = expose_subgraph_tensors(model, ["t2", "e2", "r"])
    assert exposed.sources["r"] == "r"  # a main-graph tensor needs no route
    names = [exposed.sources[t] for t in ("t2", "e2")]
    for sign in (1.0, -1.0):
        x = (sign * np.abs(rng.standard_normal((3, 4)))).astype(np.float32)
        outputs = dict(
            zip([o.name for o in exposed.model.graph.output], run(exposed.model, {"x": x}))
        )
        r = relu(x @ w["W0"])
        then_values = leaky_relu(r @ w["W1"]).ravel() if sign > 0 else np.zeros(0, np.float32)
        else_values = sigmoid(r @ w["W2"]).ravel() if sign < 0 else np.zeros(0, np.float32)
        np.testing.assert_allclose(outputs[names[0]], then_values, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outputs[names[1]], else_values, rtol=1e-5, atol=1e-6)
    assert expose_subgraph_tensors(model, ["r"]).model is model  # nothing to route: no copy


def test_model_written_with_control_flow_is_deterministic(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    model, _ = loop_model(rng)
    x = rng.standard_normal((6, 1, 4)).astype(np.float32)
    trips = np.full(6, 3, np.int64)
    first = calibrated(tmp_path, model, x=x, trips=trips)
    second = calibrated(tmp_path, model, x=x, trips=trips)
    assert first.model.SerializeToString() == second.model.SerializeToString()
    strip = {"timings_seconds"}
    assert json.dumps(
        {k: v for k, v in first.report.items() if k not in strip}, sort_keys=True
    ) == json.dumps({k: v for k, v in second.report.items() if k not in strip}, sort_keys=True)


@pytest.mark.parametrize("op", ["If", "Loop", "Scan"])
def test_inspect_lists_body_nodes_as_quantized(op: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    model = {"If": if_model, "Loop": loop_model, "Scan": scan_model}[op](rng)[0]
    onnx.save(model, tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    nodes = {n["name"]: n for n in json.loads(result.output)["nodes"]}
    inner = {"If": "then_mm", "Loop": "body_mm", "Scan": "scan_mm"}[op]
    assert nodes[inner]["quantized"], nodes[inner]


def test_sensitivity_and_fallback_run_on_a_model_with_weights_inside_a_branch(
    tmp_path: Path,
) -> None:
    """The If branch holds a weight of its own (a Constant): sensitivity switches main-graph
    tensors only, and the fallback searches among them instead of failing on the branch's."""
    rng = np.random.default_rng(2)
    model, _ = if_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    result = calibrate(path, CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz",
                                               target_sqnr=60.0, sensitivity=True),
                       enforce_gates=False)
    measured = {t["tensor"] for t in result.report["sensitivity"]["tensors"]}
    assert "W1" not in measured and "W0" in measured
    assert result.report["fallback"]["steps"]
    onnx.checker.check_model(result.model, full_check=True)


@pytest.mark.parametrize("body_heavy", [True, False])
def test_the_coverage_floor_skips_a_model_whose_weights_sit_in_its_bodies(body_heavy: bool) -> None:
    """The coverage figure counts the main graph only (a body's work depends on its
    iterations); where the bodies hold most of the compute's weights (a Loop running a Conv
    over a sequence after a small Conv), a share of the main graph's is no measure of the
    model, and the coverage floor is not checked on it."""
    import dataclasses

    from qcal.accuracy.coverage import measure_coverage
    from qcal.accuracy.gates import Gates, check_gates
    from qcal.accuracy.macs import compute_macs
    from qcal.graph.model import SelectionRules, plan_quantization, prepare_model

    model, _ = loop_model(np.random.default_rng(21))
    if not body_heavy:  # the main graph's MatMul wider than the body's
        v = next(t for t in model.graph.initializer if t.name == "V")
        wide = np.zeros((4, 64), np.float32)
        v.CopyFrom(numpy_helper.from_array(wide, "V"))
        model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 64
    prepared, _ = prepare_model(model)
    plan = plan_quantization(prepared, SelectionRules())
    coverage = measure_coverage(prepared, plan, compute_macs(prepared, None))
    assert coverage.mostly_in_bodies is body_heavy
    assert coverage.note is not None
    assert ("coverage floor is not checked" in coverage.note) is body_heavy
    none_quantized = dataclasses.replace(coverage, quantized_nodes=0, macs_quantized=0)
    failed = [g.option for g in check_gates(Gates(coverage_floor=70.0), None, none_quantized)]
    assert ("coverage-floor" in failed) is not body_heavy
