"""Model preparation: each pass keeps onnxruntime outputs equal and reports what it did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import (
    batchnorm_relu,
    build_model,
    conv_bn_relu,
    float_input,
    residual_classifier,
    run,
    run_optimized,
)
from onnx import TensorProto, helper, numpy_helper

from qcal.config import CalibrationConfig
from qcal.graph.files import large as _large
from qcal.graph.model import prepare_model
from qcal.graph.passes import (
    ConstantsToInitializers,
    EliminateIdentity,
    FoldBatchNorm,
    InferShapes,
    NameNodes,
    UpgradeOpset,
)
from qcal.graph.passes import upgrade_opset as upgrade_module
from qcal.numerics.errors import ConfigError, ModelError
from qcal.pipeline import CalibrationResult, calibrate


def _feed(rng: np.random.Generator, shape: tuple[int, ...] = (2, 3, 8, 8)) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal(shape).astype(np.float32)}


def _assert_same_outputs(
    before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> None:
    for want, got in zip(run(before, feeds), run(after, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _steps(steps: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {s.name: s.detail for s in steps}


def _calibrated(model: onnx.ModelProto, folder: Path, **calibration: np.ndarray) -> CalibrationResult:
    """`model` saved in `folder` and calibrated on `calibration` (input name -> samples) by
    qcal's defaults without the fallback: what the prepared model gives the planner."""
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "calib.npz", **calibration)
    return calibrate(folder / "m.onnx",
                     CalibrationConfig(min_product_macs=0, data=folder / "calib.npz", fallback=False))


# ----------------------------------------------------------------------------- prepare_model


def test_prepare_does_not_change_its_input() -> None:
    model = conv_bn_relu(np.random.default_rng(0))
    model.opset_import[0].version = 11
    before = model.SerializeToString()
    prepare_model(model)
    assert model.SerializeToString() == before


def test_prepare_is_deterministic() -> None:
    model = conv_bn_relu(np.random.default_rng(1))
    first, first_steps = prepare_model(model)
    second, second_steps = prepare_model(model)
    assert first.SerializeToString() == second.SerializeToString()
    assert first_steps == second_steps


def test_prepare_rejects_an_unsorted_graph() -> None:
    model = conv_bn_relu(np.random.default_rng(2))
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    with pytest.raises(ModelError, match="before anything produces it"):
        prepare_model(model)


def test_prepare_rejects_an_unknown_min_opset() -> None:
    with pytest.raises(ConfigError, match="min_opset 999"):
        prepare_model(conv_bn_relu(np.random.default_rng(0)), min_opset=999)


# ------------------------------------------------------------------------------ fold-batchnorm


@pytest.mark.parametrize(("with_bias", "opset"), [(True, 13), (False, 13), (True, 11)])
def test_batchnorm_after_conv_is_folded(with_bias: bool, opset: int) -> None:
    rng = np.random.default_rng(3)
    model = conv_bn_relu(rng, with_bias=with_bias)
    model.opset_import[0].version = opset
    prepared, steps = prepare_model(model)
    assert "BatchNormalization" not in _ops(prepared)
    assert _steps(steps)["fold-batchnorm"] == "folded 1 BatchNormalization into Conv"
    assert {t.name for t in prepared.graph.initializer} >= {"W"}
    assert not {"bn_scale", "bn_shift", "bn_mean", "bn_var"} & {
        t.name for t in prepared.graph.initializer
    }
    _assert_same_outputs(model, prepared, _feed(rng))


def _gemm_bn(rng: np.random.Generator, *, trans_b: int, with_bias: bool,
             alpha: float = 1.0) -> onnx.ModelProto:
    """x -> Gemm -> BatchNormalization -> Relu: a Linear followed by a BatchNorm1d."""
    inits = {"G": rng.standard_normal((6, 5) if trans_b else (5, 6)).astype(np.float32)}
    bn_inits, bn_nodes = batchnorm_relu(rng, "g", 6, variance=(0.5, 2.0))
    inits.update(bn_inits)
    inputs = ["x", "G"]
    if with_bias:
        inits["C"] = rng.standard_normal(6).astype(np.float32)
        inputs.append("C")
    nodes = [helper.make_node("Gemm", inputs, ["g"], name="fc", transB=trans_b, alpha=alpha),
             *bn_nodes]
    return build_model(nodes, [float_input("x", ["N", 5])], ["y"], inits)


@pytest.mark.parametrize(("trans_b", "with_bias"), [(0, True), (1, True), (1, False)])
def test_batchnorm_after_gemm_is_folded(trans_b: int, with_bias: bool) -> None:
    rng = np.random.default_rng(6)
    model = _gemm_bn(rng, trans_b=trans_b, with_bias=with_bias)
    prepared, steps = prepare_model(model)
    assert "BatchNormalization" not in _ops(prepared)
    assert _steps(steps)["fold-batchnorm"] == "folded 1 BatchNormalization into Conv/Gemm"
    feeds = {"x": rng.standard_normal((7, 5)).astype(np.float32)}
    _assert_same_outputs(model, prepared, feeds)


def test_batchnorm_after_a_scaled_gemm_stays() -> None:
    model = _gemm_bn(np.random.default_rng(7), trans_b=1, with_bias=True, alpha=0.5)
    assert not FoldBatchNorm()(_copy(model)).modified


def test_folding_copies_a_weight_other_nodes_read() -> None:
    rng = np.random.default_rng(4)
    model = conv_bn_relu(rng)
    # A second Conv reads the same weight without a BN after it.
    model.graph.node.append(
        helper.make_node("Conv", ["x", "W"], ["other"], name="conv2", pads=[1] * 4)
    )
    model.graph.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, None))
    prepared, _ = prepare_model(model)
    assert "BatchNormalization" not in _ops(prepared)
    original_w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    kept_w = numpy_helper.to_array(next(t for t in prepared.graph.initializer if t.name == "W"))
    np.testing.assert_array_equal(kept_w, original_w)
    _assert_same_outputs(model, prepared, _feed(rng))


def test_batchnorm_is_not_folded_when_the_conv_output_has_other_readers() -> None:
    rng = np.random.default_rng(5)
    model = conv_bn_relu(rng)
    model.graph.output.append(helper.make_tensor_value_info("conv_out", TensorProto.FLOAT, None))
    result = FoldBatchNorm()(_copy(model))
    assert not result.modified
    assert "BatchNormalization" in _ops(result.model)


def test_batchnorm_with_runtime_statistics_is_not_folded() -> None:
    rng = np.random.default_rng(6)
    model = conv_bn_relu(rng)
    # The mean comes from the graph, not from a constant.
    model.graph.input.append(float_input("mean_in", [4]))
    model.graph.node[1].input[3] = "mean_in"
    assert not FoldBatchNorm()(_copy(model)).modified


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


# ------------------------------------------------------------------------------ upgrade-opset


def _opset11_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Ops whose signature changed between 11 and 13 (Squeeze/Unsqueeze axes, Split)."""
    nodes = [
        helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
        helper.make_node("Squeeze", ["u"], ["s"], axes=[0]),
        helper.make_node("Split", ["s"], ["a", "b"], axis=1, split=[1, 2]),
        helper.make_node("MatMul", ["b", "W"], ["m"]),
        helper.make_node("Concat", ["a", "m"], ["y"], axis=1),
    ]
    inits = {"W": rng.standard_normal((2, 2)).astype(np.float32)}
    return build_model(nodes, [float_input("x", [4, 3])], ["y"], inits, opset=11)


def test_opset_11_is_upgraded_to_13_with_equal_outputs() -> None:
    rng = np.random.default_rng(7)
    model = _opset11_model(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["upgrade-opset"] == "opset 11 -> 13"
    assert [o.version for o in prepared.opset_import if o.domain in ("", "ai.onnx")] == [13]
    onnx.checker.check_model(prepared)
    _assert_same_outputs(model, prepared, {"x": rng.standard_normal((4, 3)).astype(np.float32)})


def test_a_per_activation_batchnorm_of_opset_7_is_upgraded_as_its_affine_map() -> None:
    """BatchNormalization's `spatial=0` (statistics per activation, [C, H, W]) of opsets 7-8,
    which onnx's converter refuses with an assertion and onnxruntime runs: the model computes
    x * a + b per activation instead, the same outputs."""
    rng = np.random.default_rng(11)
    stats = {name: rng.uniform(0.5, 2.0, (3, 4, 4)).astype(np.float32)
             for name in ("scale", "B", "mean", "var")}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "B", "mean", "var"], ["n"],
                              name="bn", spatial=0, epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"], name="relu")]
    w = rng.standard_normal((3, 1, 3, 3)).astype(np.float32)
    model = build_model(nodes, [float_input("x", [2, 1, 4, 4])],
                        [float_input("y", [2, 3, 4, 4])], {"w": w, **stats},
                        opset=7, ir_version=4)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["upgrade-opset"].startswith("opset 7 -> 13")
    assert "BatchNormalization" not in {n.op_type for n in prepared.graph.node}
    x = rng.standard_normal((2, 1, 4, 4)).astype(np.float32)
    _assert_same_outputs(model, prepared, {"x": x})
    (conv,) = run(build_model(nodes[:1], [float_input("x", [2, 1, 4, 4])],
                              [float_input("c", [2, 3, 4, 4])], {"w": w}, opset=7,
                              ir_version=4), {"x": x})
    a = stats["scale"] / np.sqrt(stats["var"] + 1e-3)
    expected = np.maximum(conv * a + stats["B"] - stats["mean"] * a, 0)
    np.testing.assert_allclose(run(prepared, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_opset_at_or_above_the_minimum_is_left_alone() -> None:
    model = _opset11_model(np.random.default_rng(8))
    assert not UpgradeOpset(11)(_copy(model)).modified
    _, steps = prepare_model(model, min_opset=11)
    assert "upgrade-opset" not in _steps(steps)


def test_upgrade_names_an_operator_onnx_does_not_know() -> None:
    nodes = [helper.make_node("Frobnicate", ["x"], ["y"], name="f")]
    graph = helper.make_graph(nodes, "g", [float_input("x", [1])], [float_input("y", [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    with pytest.raises(ModelError, match="upgrade-opset: .*Frobnicate"):
        prepare_model(model)


def test_upgrade_failure_names_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
        raise RuntimeError("No adapter for Squeeze from 11 to 12\nmore detail")

    monkeypatch.setattr(upgrade_module.version_converter, "convert_version", failing)
    with pytest.raises(ModelError, match=r"operator Squeeze \(No adapter") as caught:
        prepare_model(_opset11_model(np.random.default_rng(9)))
    assert "\n" not in str(caught.value)


def test_large_model_path_detaches_and_restores_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models over 2 GB go through the converter and inference with their weights lifted out;
    the same path is forced here on a small model."""
    monkeypatch.setattr(_large, "SERIALIZE_LIMIT_BYTES", 10)
    monkeypatch.setattr(_large, "DETACH_MIN_BYTES", 8)
    rng = np.random.default_rng(10)
    model = _opset11_model(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["upgrade-opset"] == "opset 11 -> 13"
    assert "could not" not in _steps(steps)["infer-shapes"]
    _assert_same_outputs(model, prepared, {"x": rng.standard_normal((4, 3)).astype(np.float32)})


# ----------------------------------------------------------------------------------- naming


def test_unnamed_and_repeated_node_names_become_unique() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="Relu"),  # a name the allocator must avoid
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["c"], name="dup"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="dup"),
    ]
    model = build_model(nodes, [float_input("x", [2])], ["y"])
    result = NameNodes()(_copy(model))
    names = [n.name for n in result.model.graph.node]
    assert len(set(names)) == len(names) and all(names)
    assert names[0] == "Relu" and names[2] == "dup"
    assert result.detail == "named 1 unnamed node; renamed 1 node with a repeated name"
    again = NameNodes()(_copy(model))
    assert [n.name for n in again.model.graph.node] == names


def test_subgraph_nodes_are_named_too() -> None:
    then = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])], "then", [], [float_input("t", [2])]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [float_input("e", [2])]
    )
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    model = build_model(nodes, [float_input("x", [2]), cond], ["y"])
    named = NameNodes()(_copy(model)).model
    inner = [n.name for a in named.graph.node[0].attribute for n in a.g.node]
    assert all(inner) and len(set(inner)) == 2


# -------------------------------------------------------------------- constants-to-initializers


def test_weights_in_constant_nodes_become_initializers() -> None:
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight)),
        helper.make_node("Constant", [], ["shape"], value_ints=[-1, 4]),
        helper.make_node("Constant", [], ["k"], value_float=0.5),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("MatMul", ["r", "W"], ["m"]),
        helper.make_node("Add", ["m", "k"], ["y"]),  # a bias: kept (a Mul would fold into W)
    ]
    model = build_model(nodes, [float_input("x", [4, 2])], ["y"])
    prepared, steps = prepare_model(model)
    assert "Constant" not in _ops(prepared)
    assert {"W", "shape", "k"} <= {t.name for t in prepared.graph.initializer}
    assert _steps(steps)["constants-to-initializers"] == (
        "moved 3 Constant nodes into initializers (2 float)"
    )
    _assert_same_outputs(model, prepared, {"x": rng.standard_normal((4, 2)).astype(np.float32)})


def test_constant_that_is_a_graph_output_stays_a_node() -> None:
    nodes = [helper.make_node("Constant", [], ["y"], value_float=1.0)]
    model = build_model(nodes, [], ["y"])
    assert not ConstantsToInitializers()(_copy(model)).modified


def test_old_ir_lists_new_initializers_as_inputs() -> None:
    nodes = [
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(2.0))),
        helper.make_node("Mul", ["x", "k"], ["y"]),
    ]
    model = build_model(nodes, [float_input("x", [2])], ["y"], opset=7, ir_version=3)
    out = ConstantsToInitializers()(_copy(model)).model
    assert "k" in {v.name for v in out.graph.input}
    onnx.checker.check_model(out)


# ------------------------------------------------------------------------ eliminate-identity


def test_identity_chains_are_removed_but_output_identities_stay() -> None:
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("Identity", ["W"], ["W1"]),
        helper.make_node("Identity", ["x"], ["x1"]),
        helper.make_node("Identity", ["x1"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W1"], ["m"]),
        helper.make_node("Identity", ["m"], ["y"]),
    ]
    inits = {"W": rng.standard_normal((3, 3)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", [2, 3])], ["y"], inits)
    prepared, steps = prepare_model(model)
    assert _ops(prepared) == Counter({"MatMul": 1, "Identity": 1})
    matmul = next(n for n in prepared.graph.node if n.op_type == "MatMul")
    assert list(matmul.input) == ["x", "W"]
    assert _steps(steps)["eliminate-identity"] == "removed 3 Identity nodes"
    _assert_same_outputs(model, prepared, {"x": rng.standard_normal((2, 3)).astype(np.float32)})


def test_identity_read_inside_a_subgraph_is_redirected_there() -> None:
    rng = np.random.default_rng(13)
    then = helper.make_graph(
        [helper.make_node("Relu", ["x1"], ["t"])], "then", [], [float_input("t", [3])]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x1"], ["e"])], "else", [], [float_input("e", [3])]
    )
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    model = build_model(nodes, [float_input("x", [3]), cond], ["y"])
    result = EliminateIdentity()(_copy(model))
    assert result.modified and "Identity" not in _ops(result.model)
    onnx.checker.check_model(result.model)
    x = rng.standard_normal(3).astype(np.float32)
    for branch in (True, False):
        feeds = {"x": x, "c": np.array(branch)}
        _assert_same_outputs(model, result.model, feeds)


# ------------------------------------------------------------------------------ infer-shapes


def test_shape_inference_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model: onnx.ModelProto, **kwargs: object) -> onnx.ModelProto:
        raise onnx.shape_inference.InferenceError("[ShapeInferenceError] cannot infer Foo")

    model = conv_bn_relu(np.random.default_rng(14))
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", broken)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["infer-shapes"] == (
        "shape inference could not complete: [ShapeInferenceError] cannot infer Foo"
    )
    assert prepared.graph.node


def test_partial_inference_keeps_what_it_found() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Foo", ["r"], ["f"], domain="com.example"),
        helper.make_node("Relu", ["f"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [float_input("x", [2])], [float_input("y", None)])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)]
    )
    model.ir_version = 8
    result = InferShapes()(_copy(model))
    typed = {v.name for v in result.model.graph.value_info}
    assert "r" in typed and "f" not in typed
    assert "of 3 intermediate tensors" in result.detail


def test_inference_states_only_the_dimension_names_the_model_states() -> None:
    """A size computed from the data (the count NonZero finds) has no name of its own: shape
    inference makes one up (``unk__0``), and onnxruntime, told that two tensors share it, folds
    a Reshape between them into a target that fails on zero boxes (a RetinaNet's detections).
    The pass records such a dimension as unknown, and keeps the names the model gives."""
    nodes = [
        helper.make_node("Greater", ["scores", "threshold"], ["keep"]),
        helper.make_node("NonZero", ["keep"], ["where"]),
        helper.make_node("Squeeze", ["where", "axis0"], ["picked"]),
        helper.make_node("Gather", ["boxes", "picked"], ["kept"], axis=0),
        helper.make_node("Relu", ["kept"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [float_input("scores", ["anchors"]), float_input("boxes", ["anchors", 4])],
        [float_input("y", None)],
        initializer=[numpy_helper.from_array(np.float32(0.5), "threshold"),
                     numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    inferred = onnx.shape_inference.infer_shapes(model)
    assert any(d.dim_param.startswith("unk__") for v in inferred.graph.value_info
               for d in v.type.tensor_type.shape.dim)  # what the pass must not pass on
    result = InferShapes()(_copy(model))
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                     for d in v.type.tensor_type.shape.dim]
            for v in (*result.model.graph.value_info, *result.model.graph.output)}
    assert dims["kept"] == [None, 4] and dims["y"] == [None, 4]
    assert dims["keep"] == ["anchors"]
    boxes = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    for scores in (np.zeros(6, np.float32), np.linspace(0, 1, 6, dtype=np.float32)):
        expected = np.maximum(boxes[scores > 0.5], 0)
        got = run(result.model, {"scores": scores, "boxes": boxes})[0]
        np.testing.assert_array_equal(got, expected)


def test_an_old_ir_model_is_converted_whole_and_says_so() -> None:
    """IR 3 lists every initializer as a graph input too; the opset-13 model needs IR 7, where
    such inputs would read as values a caller may override: they are dropped, and the step says
    so. Outputs stay those of the original model."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "old",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    prepared, steps = prepare_model(model)
    details = {step.name: step.detail for step in steps}
    assert "IR 3 -> 7" in details["upgrade-opset"]
    assert details["initializers-not-inputs"] == "1 initializers no longer listed as graph inputs"
    assert [v.name for v in prepared.graph.input] == ["x"]
    onnx.checker.check_model(prepared, full_check=True)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(prepared, {"x": x})[0], x @ w, rtol=1e-6)


# ------------------------------------------------------------------------------ unshare-biases


def _shared_bias_convs(
    rng: np.random.Generator, *, in_channels: int = 3, channels: int = 4
) -> onnx.ModelProto:
    """Two Convs whose biases are one zero vector behind Identity nodes, as torch.onnx writes
    the folded biases of freshly initialised BatchNormalizations (under placement "auto" a Conv
    of fewer than 8 input channels stays float)."""
    nodes = [
        helper.make_node("Identity", ["zero"], ["b1"], name="id1"),
        helper.make_node("Identity", ["zero"], ["b2"], name="id2"),
        helper.make_node("Conv", ["x", "W1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["y"], name="gap"),
    ]
    inits = {
        "W1": rng.standard_normal((channels, in_channels, 3, 3)).astype(np.float32),
        "W2": rng.standard_normal((channels, channels, 3, 3)).astype(np.float32),
        "zero": np.zeros(channels, np.float32),
    }
    return build_model(nodes, [float_input("x", ["N", in_channels, 8, 8])], ["y"], inits)


def test_each_conv_gets_a_bias_of_its_own() -> None:
    rng = np.random.default_rng(8)
    model = _shared_bias_convs(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["unshare-biases"] == "gave 1 node a bias of their own"
    biases = {n.name: n.input[2] for n in prepared.graph.node if n.op_type == "Conv"}
    assert biases["conv1"] != biases["conv2"]
    initializers = {t.name for t in prepared.graph.initializer}
    assert set(biases.values()) <= initializers
    _assert_same_outputs(model, prepared, _feed(rng))


def test_shared_biases_are_quantized_for_each_conv(tmp_path: Path) -> None:
    """With a bias of its own, each Conv's bias is int32 at its own scale, and onnxruntime
    runs both as QLinearConv (a shared float bias left them in float on dequantized weights)."""
    rng = np.random.default_rng(9)
    model = _shared_bias_convs(rng, in_channels=8, channels=8)
    result = _calibrated(model, tmp_path, x=rng.standard_normal((8, 8, 8, 8)).astype(np.float32))
    biases = [t for t in result.report["tensors"] if t["role"] == "bias"]
    assert len(biases) == 2
    assert result.report["coverage"]["quantized_compute_nodes"] == 2


def test_a_bias_a_layer_norm_also_reads_is_copied_for_the_conv(tmp_path: Path) -> None:
    """torch.onnx stores one zero vector for a Conv's bias and a LayerNormalization's: the Conv
    gets a copy of its own (else it stays float on dequantized weights), the LayerNorm keeps
    the original, and onnxruntime runs the Conv as QLinearConv."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Conv", ["x", "W", "zero"], ["c"], name="patch", pads=[1] * 4),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["t"], name="nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["t", "ones", "zero"], ["n"], name="norm",
                         axis=-1),
        helper.make_node("MatMul", ["n", "V"], ["y"], name="head"),
    ]
    inits = {
        "W": rng.standard_normal((4, 8, 3, 3)).astype(np.float32),
        "V": rng.standard_normal((4, 5)).astype(np.float32),
        "zero": np.zeros(4, np.float32),
        "ones": np.ones(4, np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits, opset=17)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["unshare-biases"] == "gave 1 node a bias of their own"
    readers = {n.name: list(n.input) for n in prepared.graph.node}
    assert readers["norm"][2] == "zero" and readers["patch"][2] not in ("zero", "")
    _assert_same_outputs(model, prepared, _feed(rng, (2, 8, 8, 8)))
    result = _calibrated(model, tmp_path, x=rng.standard_normal((8, 8, 8, 8)).astype(np.float32))
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["patch"]["quantized"], decisions["patch"]["reason"]


# --------------------------------------------------------------------------- fold-constant-weights


def _tied_head(rng: np.random.Generator) -> onnx.ModelProto:
    """A language model's head tied to its embedding, as torch.onnx's dynamo exporter writes
    it: ids -> Gather(E) -> MatMul(Transpose(E)); plus a weight reshaped and squeezed on its
    way to a second MatMul (views of views fold too)."""
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["g"], name="embed"),
        helper.make_node("MatMul", ["g", "W"], ["h"], name="layer"),
        helper.make_node("Transpose", ["E"], ["Et"], name="tie", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head"),
        helper.make_node("Reshape", ["P", "shape"], ["P2"], name="view"),
        helper.make_node("Squeeze", ["P2", "axis"], ["P3"], name="drop"),
        helper.make_node("MatMul", ["logits", "P3"], ["y"], name="proj"),
    ]
    inits = {
        "E": rng.standard_normal((10, 6)).astype(np.float32),
        "W": rng.standard_normal((6, 6)).astype(np.float32),
        "P": rng.standard_normal((10, 4)).astype(np.float32),
        "shape": np.array([1, 10, 4], np.int64),
        "axis": np.array([0], np.int64),
    }
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 5])
    return build_model(nodes, [ids], ["y"], inits)


def test_views_of_constant_weights_are_stored_as_weights(tmp_path: Path) -> None:
    """The transposed, tied weight and the reshaped one become initializers (the embedding
    stays: its Gather still reads it); outputs are those of the float model, and calibration
    quantizes both as weights, per channel, with no QuantizeLinear left to run on them."""
    rng = np.random.default_rng(11)
    model = _tied_head(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["fold-constant-weights"] == "stored 3 views of constant weights as initializers"
    assert [n.op_type for n in prepared.graph.node] == ["Gather", "MatMul", "MatMul", "MatMul"]
    assert {"E", "Et", "P3"} <= {t.name for t in prepared.graph.initializer}
    assert not {"P", "P2", "shape"} & {t.name for t in prepared.graph.initializer}
    feeds = {"ids": rng.integers(0, 10, (3, 5))}
    _assert_same_outputs(model, prepared, feeds)
    result = _calibrated(model, tmp_path, ids=rng.integers(0, 10, (8, 5)))
    roles = {t["name"]: t["role"] for t in result.report["tensors"]}
    assert roles["Et"] == roles["P3"] == "weight"
    quantize_inputs = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert not {"Et", "P3"} & quantize_inputs


def _weight_normalized_convs(rng: np.random.Generator) -> onnx.ModelProto:
    """Two Convs whose weights are normalized at run time, as torch.onnx's dynamo exporter
    writes ``weight_norm`` (w = g * v / ||v||, the norm over all axes but the first), plus a
    constant mask tiled far beyond its operands' size that a third reader multiplies in."""
    nodes = []
    for i, (out_ch, in_ch) in enumerate([(8, 8), (4, 8)], start=1):
        nodes += [
            helper.make_node("ReduceL2", [f"v{i}"], [f"n{i}"], name=f"norm{i}", axes=[1, 2, 3],
                             keepdims=1),
            helper.make_node("Div", [f"g{i}", f"n{i}"], [f"s{i}"], name=f"scale{i}"),
            helper.make_node("Mul", [f"v{i}", f"s{i}"], [f"w{i}"], name=f"weight{i}"),
        ]
    nodes += [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
        helper.make_node("Flatten", ["c2"], ["f"], name="flat"),
        helper.make_node("Tile", ["m", "reps"], ["mask"], name="tile"),
        helper.make_node("MatMul", ["f", "mask"], ["y"], name="masked"),
    ]
    inits = {
        "v1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32),
        "g1": np.abs(rng.standard_normal((8, 1, 1, 1))).astype(np.float32) + 0.5,
        "b1": rng.standard_normal(8).astype(np.float32) * 0.1,
        "v2": rng.standard_normal((4, 8, 3, 3)).astype(np.float32),
        "g2": np.abs(rng.standard_normal((4, 1, 1, 1))).astype(np.float32) + 0.5,
        "b2": rng.standard_normal(4).astype(np.float32) * 0.1,
        "m": rng.standard_normal((1, 1)).astype(np.float32),
        "reps": np.array([256, 300], np.int64),  # 76 800 values from one
    }
    return build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)


def test_weights_computed_from_constants_are_stored_as_weights(tmp_path: Path) -> None:
    """The normalized weights fold into initializers (computed by onnx's reference, within
    float32 precision of onnxruntime), the tiled mask stays a Tile (stored, it would grow the
    file), and calibration quantizes both Convs with their weights per channel, read from
    codes stored once: no QuantizeLinear runs on them (before, each was an activation
    quantized per tensor at every run)."""
    rng = np.random.default_rng(14)
    model = _weight_normalized_convs(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["fold-constant-weights"] == (
        "stored 6 computations of constant weights as initializers")
    assert _ops(prepared) == Counter({"Conv": 2, "Relu": 1, "Flatten": 1, "Tile": 1,
                                      "MatMul": 1})
    folded = {t.name: numpy_helper.to_array(t) for t in prepared.graph.initializer}
    for i in (1, 2):
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        v, g = inits[f"v{i}"].astype(np.float64), inits[f"g{i}"].astype(np.float64)
        want = g * v / np.sqrt((v * v).sum(axis=(1, 2, 3), keepdims=True))
        np.testing.assert_allclose(folded[f"w{i}"], want, rtol=1e-6)
    assert "mask" not in folded
    _assert_same_outputs(model, prepared, _feed(rng, (2, 8, 8, 8)))

    result = _calibrated(model, tmp_path, x=rng.standard_normal((16, 8, 8, 8)).astype(np.float32))
    records = {t["name"]: t for t in result.report["tensors"]}
    assert records["w1"]["role"] == records["w2"]["role"] == "weight"
    quantize_inputs = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert not {"w1", "w2"} & quantize_inputs
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["conv1"] and decisions["conv2"]


def test_a_kernel_reshaped_by_shape_arithmetic_on_constants_is_a_weight(tmp_path: Path) -> None:
    """tf2onnx's Keras EinsumDense: the kernel reaches its Gemm through a Reshape whose shape
    is computed at run time from the kernel's own shape. The shape arithmetic folds into
    initializers, the reshaped kernel becomes the Gemm's weight (per channel, codes stored once),
    and the prepared model computes what the original does."""
    rng = np.random.default_rng(12)
    kernel = rng.standard_normal((1, 8, 2, 3)).astype(np.float32)  # (1, in, heads, dim)
    nodes = [
        helper.make_node("Shape", ["K"], ["k_shape"], name="k_shape"),
        helper.make_node("Gather", ["k_shape", "axes"], ["k_dims"], name="k_dims", axis=0),
        helper.make_node("ReduceProd", ["k_dims"], ["k_cols"], name="k_cols", keepdims=1),
        helper.make_node("Concat", ["rows", "k_cols"], ["k_2d"], name="k_2d", axis=0),
        helper.make_node("Reshape", ["K", "k_2d"], ["W"], name="kernel_2d"),
        helper.make_node("Gemm", ["x", "W"], ["y"], name="dense"),
    ]
    inits = {"K": kernel, "axes": np.array([2, 3], np.int64), "rows": np.array([8], np.int64)}
    model = build_model(nodes, [float_input("x", ["N", 8])], ["y"], inits)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["fold-constant-shapes"] == (
        "folded 4 shape computations on constants into initializers")
    assert [n.op_type for n in prepared.graph.node] == ["Gemm"]
    weight = next(t for t in prepared.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(numpy_helper.to_array(weight), kernel.reshape(8, 6))
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32)}
    _assert_same_outputs(model, prepared, feeds)
    result = _calibrated(model, tmp_path, x=rng.standard_normal((16, 8)).astype(np.float32))
    roles = {t["name"]: t["role"] for t in result.report["tensors"]}
    assert roles["W"] == "weight"
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["dense"]


def _model_with_a_local_function(rng: np.random.Generator) -> onnx.ModelProto:
    """Two calls of a model-local ``ConvBlock`` (Conv + Relu, as onnxscript writes a block) in
    a model of opset 11, then a Gemm head outside the calls."""
    block = helper.make_function(
        "blocks", "ConvBlock", ["x", "w", "b"], ["y"],
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        opset_imports=[helper.make_opsetid("", 11)])
    nodes = [
        helper.make_node("ConvBlock", ["x", "W1", "B1"], ["y1"], name="block1", domain="blocks"),
        helper.make_node("ConvBlock", ["y1", "W2", "B2"], ["y2"], name="block2", domain="blocks"),
        helper.make_node("GlobalAveragePool", ["y2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "Wf", "Bf"], ["y"], name="head", transB=1),
    ]
    inits = {"W1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.3,
             "B1": rng.standard_normal(8).astype(np.float32) * 0.1,
             "W2": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2,
             "B2": rng.standard_normal(16).astype(np.float32) * 0.1,
             "Wf": rng.standard_normal((10, 16)).astype(np.float32) * 0.3,
             "Bf": rng.standard_normal(10).astype(np.float32) * 0.1}
    tensors = [numpy_helper.from_array(a, n) for n, a in inits.items()]
    graph = helper.make_graph(nodes, "blocks", [float_input("x", ["N", 8, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
                              tensors)
    model = helper.make_model(
        graph, functions=[block],
        opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("blocks", 1)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_local_functions_are_inlined_so_their_convolutions_are_planned(tmp_path: Path) -> None:
    """onnxscript's blocks are model-local functions: their nodes replace the calls (before
    the opset is raised to 13), the functions and their domain go, and the model computes what
    it did. Calibrated, both convolutions inside the calls are quantized and counted in the
    coverage (before, only the Gemm outside them was seen, and the coverage said 100 %)."""
    rng = np.random.default_rng(13)
    model = _model_with_a_local_function(rng)
    prepared, steps = prepare_model(model)
    assert _steps(steps)["inline-functions"] == "inlined 2 calls of 1 local function"
    assert not prepared.functions
    assert _ops(prepared) == Counter({"Conv": 2, "Relu": 2, "GlobalAveragePool": 1,
                                      "Flatten": 1, "Gemm": 1})
    assert {o.domain for o in prepared.opset_import} == {""}
    _assert_same_outputs(model, prepared, _feed(rng, (2, 8, 8, 8)))

    result = _calibrated(model, tmp_path, x=rng.standard_normal((16, 8, 8, 8)).astype(np.float32))
    convs = [n for n in result.report["nodes"] if n["op_type"] == "Conv"]
    assert len(convs) == 2 and all(n["quantized"] for n in convs)
    assert result.report["coverage"]["quantized_compute_nodes"] == 3
    written = result.model
    onnx.checker.check_model(written)
    ops = Counter(n.op_type for n in written.graph.node)
    assert ops["Conv"] == 2 and ops["QuantizeLinear"] >= 2
    feeds = _feed(rng, (2, 8, 8, 8))
    np.testing.assert_allclose(run(written, feeds)[0], run(model, feeds)[0], atol=0.1)


def test_initializers_listed_as_inputs_are_dropped_when_the_opset_is_raised() -> None:
    """PyTorch 1.x at opset 11 listed every initializer as a graph input too. Raised to opset 13,
    a Resize whose roi and scales are an empty initializer listed so failed onnxruntime's shape
    inference ("either sizes or scales"), though the original loads: qcal's copy drops them."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(2).standard_normal((4, 3, 1, 1)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(0, np.float32), "e"),
             numpy_helper.from_array(np.array([1, 4, 8, 8], np.int64), "sizes")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
         helper.make_node("Resize", ["c", "e", "e", "sizes"], ["y"], name="resize",
                          mode="nearest")], "listed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])]
        + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)
    x = np.random.default_rng(3).standard_normal((1, 3, 4, 4)).astype(np.float32)
    (expected,) = run(model, {"x": x})
    prepared, steps = prepare_model(model)
    assert ("initializers-not-inputs", "3 initializers no longer listed as graph inputs") in [
        (step.name, step.detail) for step in steps]
    assert [v.name for v in prepared.graph.input] == ["x"]
    onnx.checker.check_model(prepared, full_check=True)
    np.testing.assert_allclose(run_optimized(prepared, {"x": x})[0], expected, rtol=1e-5,
                               atol=1e-6)


def test_weights_listed_as_inputs_are_quantized_as_the_constants_they_hold(tmp_path: Path) -> None:
    """An opset-13 model that also lists its initializers as graph inputs (PyTorch's
    keep_initializers_as_inputs, model-zoo files) is quantized as the same model listing only x:
    its weights stored as codes (per channel), not quantized at every run as activations, and
    its quantized model no longer takes them as inputs."""
    rng = np.random.default_rng(21)
    model = residual_classifier(rng, in_channels=3, channels=8, classes=5, side=8, second_scale=0.2)
    listed = onnx.ModelProto()
    listed.CopyFrom(model)
    listed.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in model.graph.initializer)
    x = rng.standard_normal((12, 1, 3, 8, 8)).astype(np.float32)
    (tmp_path / "plain").mkdir()
    (tmp_path / "listed").mkdir()
    plain_result = _calibrated(model, tmp_path / "plain", x=x)
    listed_result = _calibrated(listed, tmp_path / "listed", x=x)
    quantized = listed_result.model
    assert [v.name for v in quantized.graph.input] == ["x"]
    onnx.checker.check_model(quantized, full_check=True)
    weights = {n.input[1] for n in quantized.graph.node if n.op_type in ("Conv", "Gemm")}
    codes = {t.name: t for t in quantized.graph.initializer}
    for node in quantized.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in weights:
            assert codes[node.input[0]].data_type == TensorProto.INT8  # stored codes
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in {"W1", "W2", "G"}
                   for n in quantized.graph.node)
    feeds = {"x": x[:4, 0]}
    for want, got in zip(run(plain_result.model, feeds), run(quantized, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
