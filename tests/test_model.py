"""Loading (safe external data, hostile files), model inputs and the quantization plan."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, conv_bn_relu, float_input
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.files.load import load_model
from qcal.graph.model import (
    OP_RULES,
    ActivationTarget,
    BiasTarget,
    InputSpec,
    QuantPlan,
    SelectionRules,
    WeightTarget,
    model_inputs,
    plan_quantization,
    prepare_model,
    rules_table,
)
from qcal.numerics.errors import ConfigError, ModelError

# ------------------------------------------------------------------------------------ loading


def _matmul_model(rng: np.random.Generator) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    inits = {"W": rng.standard_normal((16, 8)).astype(np.float32)}
    return build_model(nodes, [float_input("x", ["N", 16])], ["y"], inits)


def _save_external(model: onnx.ModelProto, folder: Path, location: str = "weights.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    model = onnx.ModelProto.FromString(model.SerializeToString())  # saving edits the proto
    onnx.save_model(model, path, save_as_external_data=True, location="w.tmp", size_threshold=0)
    # onnx writes into the model's folder only; move the file where the test wants it.
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    (folder / "w.tmp").rename(folder / location)
    for tensor in model.graph.initializer:
        _set_location(path, tensor.name, location)
    return path


def _set_location(path: Path, tensor: str, location: str) -> None:
    """Point `tensor`'s external data somewhere else, without touching any data file."""
    model = onnx.load_model(path, load_external_data=False)
    for initializer in model.graph.initializer:
        if initializer.name == tensor:
            for entry in initializer.external_data:
                if entry.key == "location":
                    entry.value = location
    path.write_bytes(model.SerializeToString())


def test_load_returns_the_model_and_the_file_hash(tmp_path: Path) -> None:
    model = _matmul_model(np.random.default_rng(0))
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path)
    loaded = load_model(path)
    assert loaded.path == path
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.model.SerializeToString() == model.SerializeToString()


def test_an_ir3_model_whose_initializers_are_not_inputs_loads_as_onnxruntime_runs_it(
        tmp_path: Path) -> None:
    """IR 3 lists every initializer as a graph input, and onnx.checker holds a model to it;
    onnxruntime runs such a file (Caffe2's exports) with the initializers constants, as IR 4
    reads it. It loads as IR 4, computing what onnxruntime computes."""
    rng = np.random.default_rng(2)
    model = _matmul_model(rng)
    model.ir_version = 3
    model.opset_import[0].version = 7
    del model.graph.value_info[:]
    assert [i.name for i in model.graph.input] == ["x"]
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(onnx.checker.ValidationError, match="not in graph input"):
        onnx.checker.check_model(model)
    loaded = load_model(path)
    assert loaded.model.ir_version == 4
    onnx.checker.check_model(loaded.model)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    weights = numpy_helper.to_array(model.graph.initializer[0])
    session = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weights, rtol=1e-5)
    prepared, _ = prepare_model(loaded.model)
    onnx.checker.check_model(prepared)


def test_load_reads_safe_external_data(tmp_path: Path) -> None:
    model = _matmul_model(np.random.default_rng(1))
    path = _save_external(model, tmp_path / "m", location="data/weights.bin")
    loaded = load_model(path)
    (weight,) = loaded.model.graph.initializer
    assert weight.data_location == TensorProto.DEFAULT and not weight.external_data
    np.testing.assert_array_equal(
        numpy_helper.to_array(weight), numpy_helper.to_array(model.graph.initializer[0])
    )


def test_symlink_inside_the_model_folder_is_refused_as_onnx_does(tmp_path: Path) -> None:
    path = _save_external(_matmul_model(np.random.default_rng(2)), tmp_path / "m")
    (tmp_path / "m" / "alias.bin").symlink_to(tmp_path / "m" / "weights.bin")
    _set_location(path, "W", "alias.bin")
    with pytest.raises(ModelError, match="tensor 'W': 'alias.bin' is a symbolic link"):
        load_model(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "model file not found"),
        (b"", "model file is empty"),
        (b"not a model at all", "not an ONNX model"),
        (bytes(range(256)) * 4, "not an ONNX model"),
    ],
)
def test_unreadable_model_files_are_model_errors(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=message) as caught:
        load_model(path)
    assert "bad.onnx" in str(caught.value) and "\n" not in str(caught.value)


def test_truncated_model_file_is_a_model_error(tmp_path: Path) -> None:
    data = _matmul_model(np.random.default_rng(3)).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cut.onnx"):
        load_model(path)


def test_model_failing_the_checker_is_a_model_error(tmp_path: Path) -> None:
    model = _matmul_model(np.random.default_rng(4))
    model.graph.node[0].input[0] = "nowhere"  # reads a value nothing produces
    path = tmp_path / "broken.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match=r"broken.onnx: fails onnx.checker: .*nowhere"):
        load_model(path)


def _unsorted_chain(rng: np.random.Generator) -> onnx.ModelProto:
    """x -> Relu -> MatMul -> Identity, with an If whose branch reads the Relu's output, the
    nodes written in reverse: onnxruntime runs it, onnx.checker refuses it."""
    branch = helper.make_graph(
        [helper.make_node("Neg", ["r"], ["b"], name="neg")], "branch", [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 16])])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W"], ["m"], name="mm"),
        helper.make_node("Identity", ["m"], ["y"], name="id"),
        helper.make_node("If", ["flag"], ["z"], name="if", then_branch=branch,
                         else_branch=branch),
    ]
    inits = {"W": rng.standard_normal((16, 8)).astype(np.float32),
             "flag": np.array(True)}
    model = build_model(nodes, [float_input("x", [2, 16])], ["y", "z"], inits)
    written = list(reversed(model.graph.node))
    del model.graph.node[:]
    model.graph.node.extend(written)
    return model


def test_a_model_whose_nodes_are_out_of_order_is_sorted_and_computes_the_same(
    tmp_path: Path,
) -> None:

    rng = np.random.default_rng(8)
    model = _unsorted_chain(rng)
    path = tmp_path / "unsorted.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model)
    loaded = load_model(path)
    assert [n.name for n in loaded.model.graph.node] == ["relu", "if", "mm", "id"]  # stable
    onnx.checker.check_model(loaded.model)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            .run(None, {"x": x}) for m in (model, loaded.model)]
    for before, after in zip(*runs):
        np.testing.assert_array_equal(before, after)


def test_a_cycle_is_refused_on_one_line_naming_the_file(tmp_path: Path) -> None:
    model = _matmul_model(np.random.default_rng(9))
    model.graph.node.append(helper.make_node("Relu", ["y"], ["y2"], name="relu"))
    model.graph.node[0].input[0] = "y2"  # mm reads relu, relu reads mm
    path = tmp_path / "cycle.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match=r"cycle.onnx: fails onnx.checker: .*sorted") as caught:
        load_model(path)
    # the checker's whole complaint, the node it names included, on one line
    assert "\n" not in str(caught.value) and "mm" in str(caught.value).split("sorted")[1]


def test_an_output_declared_without_a_shape_gets_the_inferred_one(tmp_path: Path) -> None:
    """onnxruntime runs a model whose output type lost its shape (cleared by hand); onnx.checker
    refuses it. The output is declared with the shape onnx infers (here from the input's
    symbolic batch), and the model loads, checks and computes as before."""
    rng = np.random.default_rng(6)
    model = _matmul_model(rng)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    path = tmp_path / "shapeless.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(onnx.checker.ValidationError, match="shape"):
        onnx.checker.check_model(model)
    loaded = load_model(path)
    dims = loaded.model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["N", 8]
    onnx.checker.check_model(loaded.model)
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # the file's own


def test_an_input_declared_without_a_shape_is_refused_by_name(tmp_path: Path) -> None:
    model = _matmul_model(np.random.default_rng(7))
    model.graph.input[0].type.tensor_type.ClearField("shape")
    path = tmp_path / "noshape.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match=r"noshape.onnx: input 'x' declares no shape"):
        load_model(path)


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a regular file"):
        load_model(tmp_path)


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_external_data_leaving_the_model_folder_is_refused(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "m"
    path = _save_external(_matmul_model(np.random.default_rng(5)), folder)
    # A real file outside the folder, of exactly the right size: only the path is wrong.
    outside = tmp_path / "secret.bin"
    outside.write_bytes((folder / "weights.bin").read_bytes())
    location = {
        "absolute": str(outside),
        "dotdot": "../secret.bin",
        "symlink": "link.bin",
    }[kind]
    if kind == "symlink":
        (folder / "link.bin").symlink_to(outside)
    _set_location(path, "W", location)
    expected = "absolute path" if kind == "absolute" else "outside the model's folder"
    with pytest.raises(ModelError, match=expected) as caught:
        load_model(path)
    assert "model.onnx" in str(caught.value) and "'W'" in str(caught.value)


def test_missing_external_file_is_refused(tmp_path: Path) -> None:
    path = _save_external(_matmul_model(np.random.default_rng(6)), tmp_path)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ModelError, match=r"tensor 'W': file 'weights.bin' not found"):
        load_model(path)


def test_truncated_external_file_is_refused(tmp_path: Path) -> None:
    path = _save_external(_matmul_model(np.random.default_rng(7)), tmp_path)
    data = (tmp_path / "weights.bin").read_bytes()
    (tmp_path / "weights.bin").write_bytes(data[:-4])
    with pytest.raises(ModelError, match=r"tensor 'W': 'weights.bin'.*truncated"):
        load_model(path)


def test_external_length_not_matching_the_tensor_is_refused(tmp_path: Path) -> None:
    path = _save_external(_matmul_model(np.random.default_rng(8)), tmp_path)
    data = (tmp_path / "weights.bin").read_bytes()
    (tmp_path / "weights.bin").write_bytes(data + b"\0" * 8)  # no length entry: reads to the end
    model = onnx.load_model(path, load_external_data=False)
    for entry in list(model.graph.initializer[0].external_data):
        if entry.key == "length":
            model.graph.initializer[0].external_data.remove(entry)
    path.write_bytes(model.SerializeToString())
    needed = 16 * 8 * 4
    with pytest.raises(ModelError, match=f"holds {needed + 8} bytes.*need {needed}"):
        load_model(path)


def test_external_data_of_a_constant_attribute_is_loaded(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    weight = rng.standard_normal((4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight, "W")),
        helper.make_node("MatMul", ["x", "W"], ["y"]),
    ]
    model = build_model(nodes, [float_input("x", [1, 4])], ["y"])
    onnx.save_model(
        model,
        tmp_path / "c.onnx",
        save_as_external_data=True,
        location="c.bin",
        size_threshold=0,
        convert_attribute=True,
    )
    loaded = load_model(tmp_path / "c.onnx")
    np.testing.assert_array_equal(
        numpy_helper.to_array(loaded.model.graph.node[0].attribute[0].t), weight
    )


# ------------------------------------------------------------------------------------- inputs


def test_model_inputs_skip_initializers_and_keep_dims() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Gather", ["r", "idx"], ["g"]),
        helper.make_node("Where", ["mask", "g", "g"], ["y"]),
    ]
    inputs = [
        float_input("x", ["batch", 4, None]),
        helper.make_tensor_value_info("idx", TensorProto.INT64, [2]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [1]),
        helper.make_tensor_value_info(
            "shape", TensorProto.INT64, [2]
        ),  # IR<4 style: also an initializer
    ]
    model = build_model(nodes, inputs, ["y"], {"shape": np.array([-1, 2], np.int64)})
    assert model_inputs(model) == [
        InputSpec("x", np.dtype(np.float32), ("batch", 4, None)),
        InputSpec("idx", np.dtype(np.int64), (2,)),
        InputSpec("mask", np.dtype(np.bool_), (1,)),
    ]


def test_model_input_without_a_tensor_type_is_a_model_error() -> None:
    model = _matmul_model(np.random.default_rng(10))
    sequence = helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)
    model.graph.input.append(sequence)
    with pytest.raises(ModelError, match="'seq' is a sequence_type"):
        model_inputs(model)


@pytest.mark.parametrize("side", ["input", "output"])
def test_a_bfloat16_input_or_output_is_refused_by_name(side: str) -> None:
    """numpy has no bfloat16 and onnxruntime's Python API neither takes nor returns one: such a
    model cannot be run for calibration (a bfloat16 output was blamed on the data)."""
    nodes = [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT if side == "input"
                              else TensorProto.BFLOAT16)]
    types = (TensorProto.BFLOAT16, TensorProto.FLOAT) if side == "input" else \
        (TensorProto.FLOAT, TensorProto.BFLOAT16)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", types[0], ["N", 4])],
                              [helper.make_tensor_value_info("y", types[1], ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    name = "x" if side == "input" else "y"
    with pytest.raises(ModelError, match=f"model {side} '{name}' is bfloat16"):
        model_inputs(model)


# --------------------------------------------------------------------------------------- plan


def _plan(model: onnx.ModelProto, **rules: object) -> QuantPlan:
    """The plan under the per-operator rules alone (placement "all", unless `rules` say)."""
    prepared, _ = prepare_model(model)
    rules.setdefault("placement", "all")
    return plan_quantization(prepared, SelectionRules(**rules))  # type: ignore[arg-type]


def _activations(plan: QuantPlan) -> dict[str, tuple[str, ...]]:
    return {a.tensor: a.consumers for a in plan.activations}


def _decision(plan: QuantPlan, node: str) -> tuple[bool, str]:
    (found,) = [d for d in plan.nodes if d.node == node]
    return found.quantized, found.reason


def test_conv_relu_is_planned_for_fusion() -> None:
    """Conv rule: x and the weight (axis 0) quantized, bias int32; the Conv output that only a
    Relu reads stays float and the Relu output is quantized instead."""
    plan = _plan(conv_bn_relu(np.random.default_rng(11)))
    assert _activations(plan) == {"x": ("conv",), "y": ()}
    assert plan.weights == (WeightTarget("W", "conv", "Conv", 0),)
    assert plan.biases == (BiasTarget("B", "conv", "x", "W"),)
    assert _decision(plan, "conv")[0] and "fuses the following 'relu'" in _decision(plan, "conv")[1]
    assert (
        _decision(plan, "relu")[0] and "fuses this Relu into 'conv'" in _decision(plan, "relu")[1]
    )


def test_weight_held_in_a_constant_node_is_planned_as_a_weight() -> None:
    rng = np.random.default_rng(25)
    weight = rng.standard_normal((2, 3, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight)),
        helper.make_node("Identity", ["W"], ["W_alias"]),
        helper.make_node("Conv", ["x", "W_alias"], ["y"], name="conv"),
    ]
    plan = _plan(build_model(nodes, [float_input("x", [1, 3, 4, 4])], ["y"]))
    assert plan.weights == (WeightTarget("W", "conv", "Conv", 0),)
    assert _activations(plan) == {"x": ("conv",), "y": ()}


def test_excluded_relu_keeps_its_input_quantized_by_the_conv() -> None:
    plan = _plan(conv_bn_relu(np.random.default_rng(12)), exclude_op_types=frozenset({"Relu"}))
    assert _activations(plan) == {"x": ("conv",), "bn_out": ()}
    assert _decision(plan, "relu") == (False, "op type Relu excluded by --exclude-op-types")


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_weight_axis_follows_trans_b(trans_b: int) -> None:
    rng = np.random.default_rng(13)
    k, n = 6, 5
    weight_shape = (n, k) if trans_b else (k, n)
    nodes = [helper.make_node("Gemm", ["x", "W", "C"], ["y"], name="fc", transB=trans_b)]
    inits = {
        "W": rng.standard_normal(weight_shape).astype(np.float32),
        "C": rng.standard_normal(n).astype(np.float32),
    }
    plan = _plan(build_model(nodes, [float_input("x", [2, k])], ["y"], inits))
    output_channel_axis = weight_shape.index(n)
    assert plan.weights == (WeightTarget("W", "fc", "Gemm", output_channel_axis),)
    assert plan.biases == (BiasTarget("C", "fc", "x", "W"),)
    assert _activations(plan) == {"x": ("fc",), "y": ()}


def test_gemm_bias_with_beta_not_one_stays_float() -> None:
    rng = np.random.default_rng(14)
    nodes = [helper.make_node("Gemm", ["x", "W", "C"], ["y"], name="fc", beta=0.5)]
    inits = {
        "W": rng.standard_normal((4, 3)).astype(np.float32),
        "C": rng.standard_normal(3).astype(np.float32),
    }
    plan = _plan(build_model(nodes, [float_input("x", [2, 4])], ["y"], inits))
    assert plan.biases == ()
    assert "bias 'C' stays float: alpha or beta is not 1" in _decision(plan, "fc")[1]


@pytest.mark.parametrize(
    ("weight_shape", "per_channel", "axis"),
    [
        ((4, 3), True, 1),
        # a stack of matrices: onnxruntime's integer MatMul takes per-column scales for a 2-D
        # B only (it fails at run time on a stack), so per tensor
        ((2, 4, 3), True, None),
        ((4, 3), False, None),
    ],
)
def test_matmul_constant_weight_is_per_channel_on_its_last_axis(
    weight_shape: tuple[int, ...], per_channel: bool, axis: int | None
) -> None:
    rng = np.random.default_rng(15)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    inits = {"W": rng.standard_normal(weight_shape).astype(np.float32)}
    plan = _plan(
        build_model(nodes, [float_input("x", [2, 4])], ["y"], inits), per_channel=per_channel
    )
    assert plan.weights == (WeightTarget("W", "mm", "MatMul", axis),)
    assert _activations(plan) == {"x": ("mm",), "y": ()}


def test_conv_transpose_weight_is_per_channel_on_axis_1_and_its_bias_stays_float() -> None:
    rng = np.random.default_rng(26)
    nodes = [helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], name="up", strides=[2, 2])]
    inits = {
        "W": rng.standard_normal((3, 2, 2, 2)).astype(np.float32),  # (C_in, C_out, kH, kW)
        "B": rng.standard_normal(2).astype(np.float32),
    }
    plan = _plan(build_model(nodes, [float_input("x", [1, 3, 4, 4])], ["y"], inits))
    assert plan.weights == (WeightTarget("W", "up", "ConvTranspose", 1),)
    assert plan.biases == ()
    assert _activations(plan) == {"x": ("up",), "y": ()}


def test_matmul_constant_a_is_per_tensor() -> None:
    rng = np.random.default_rng(16)
    nodes = [helper.make_node("MatMul", ["A", "x"], ["y"], name="mm")]
    inits = {"A": rng.standard_normal((3, 4)).astype(np.float32)}
    plan = _plan(build_model(nodes, [float_input("x", [4, 2])], ["y"], inits))
    # Not at the weight input: per tensor, in the activation scheme (QLinearMatMul's A type).
    assert plan.weights == (WeightTarget("A", "mm", "MatMul", None, "operand"),)
    assert _activations(plan) == {"x": ("mm",), "y": ()}


def test_attention_matmul_quantizes_both_activations() -> None:
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node("Softmax", ["scores"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"], name="pv"),
    ]
    inputs = [float_input(n, [1, 4, 8]) for n in ("q", "k", "v")]
    # The op rules alone (by default the Softmax input, attention logits, stays float).
    plan = _plan(build_model(nodes, inputs, ["y"]), default_exclusions=False)
    assert plan.weights == () and plan.biases == ()
    assert _activations(plan) == {
        "k": ("kt",),
        "kt": ("qk",),
        "q": ("qk",),
        "scores": ("softmax",),
        "p": ("pv",),
        "v": ("pv",),
        "y": (),
    }
    assert all(d.quantized for d in plan.nodes)


def test_shape_arithmetic_is_never_quantized() -> None:
    """Shape -> Gather -> Unsqueeze -> Concat is int64: those nodes have nothing to quantize;
    Reshape quantizes its data input, never its shape input."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsqueeze"),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "axes": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
    }
    # a free first axis: the shape is computed at every run (a static one would fold)
    model = build_model(nodes, [float_input("x", ["N", 3, 4])], [float_input("y", ["N", 12])],
                        inits)
    plan = _plan(model)
    assert _activations(plan) == {"x": ("reshape",), "y": ()}
    assert plan.weights == ()
    for name in ("gather", "unsqueeze", "concat"):
        assert _decision(plan, name) == (False, "no float tensor to quantize")
    assert _decision(plan, "shape") == (False, "no quantization rule for op Shape")


def test_unquantized_producer_feeds_a_quantized_consumer_through_a_dq() -> None:
    rng = np.random.default_rng(17)
    nodes = [
        helper.make_node("Erf", ["x"], ["e"], name="erf"),
        helper.make_node("MatMul", ["e", "W"], ["y"], name="mm"),
    ]
    inits = {"W": rng.standard_normal((4, 4)).astype(np.float32)}
    plan = _plan(build_model(nodes, [float_input("x", [1, 4])], ["y"], inits))
    assert _activations(plan) == {"e": ("mm",), "y": ()}
    assert _decision(plan, "erf") == (False, "no quantization rule for op Erf")


def test_selection_rules_narrow_the_plan() -> None:
    rng = np.random.default_rng(18)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="block1/mm"),
        helper.make_node("Add", ["h", "b1"], ["a"], name="block1/add"),
        helper.make_node("MatMul", ["a", "W2"], ["y"], name="head/mm"),
    ]
    inits = {
        "W1": rng.standard_normal((4, 4)).astype(np.float32),
        "b1": rng.standard_normal(4).astype(np.float32),
        "W2": rng.standard_normal((4, 2)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", [1, 4])], ["y"], inits)
    only_matmul = _plan(model, op_types=frozenset({"MatMul"}))
    assert _decision(only_matmul, "block1/add") == (False, "op type Add not in --op-types")
    assert {w.tensor for w in only_matmul.weights} == {"W1", "W2"}
    no_head = _plan(model, exclude_nodes=("head/*",))
    assert _decision(no_head, "head/mm") == (
        False,
        "node name matches --exclude-nodes pattern 'head/*'",
    )
    # The Add still quantizes its output; nothing quantized reads it.
    assert _activations(no_head) == {"x": ("block1/mm",), "h": ("block1/add",), "a": ()}
    no_h = _plan(model, exclude_tensors=frozenset({"h", "W2"}))
    assert "h" not in _activations(no_h)
    assert {w.tensor for w in no_h.weights} == {"W1", "b1"}
    assert "'h' excluded by --exclude-tensors" in _decision(no_h, "block1/add")[1]


def test_unknown_excluded_tensor_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'nope' is not a tensor of the model"):
        _plan(conv_bn_relu(np.random.default_rng(19)), exclude_tensors=frozenset({"nope"}))


def test_op_type_without_a_rule_in_op_types_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no quantization rule for op type 'Erf'"):
        _plan(conv_bn_relu(np.random.default_rng(20)), op_types=frozenset({"Conv", "Erf"}))


def test_if_branch_nodes_are_planned_with_outer_constants_as_weights() -> None:
    rng = np.random.default_rng(21)
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["t"], name="inner_mm")],
        "then",
        [],
        [float_input("t", [1, 4])],
    )
    other = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["e"], name="inner_relu")],
        "else",
        [],
        [float_input("e", [1, 4])],
    )
    nodes = [
        helper.make_node("If", ["c"], ["i"], name="branch", then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["i", "W"], ["y"], name="outer_mm"),
    ]
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    inits = {"W": rng.standard_normal((4, 4)).astype(np.float32)}
    plan = _plan(build_model(nodes, [float_input("x", [1, 4]), cond], ["y"], inits))
    order = [d.node for d in plan.nodes]
    assert order[0] == "branch" and order[-1] == "outer_mm"
    assert sorted(order[1:3]) == ["inner_mm", "inner_relu"]
    assert _decision(plan, "branch") == (False, "no quantization rule for op If")
    for inner in ("inner_mm", "inner_relu"):
        assert _decision(plan, inner)[0]
    # x is read inside both branches; W, a main-graph constant, is the inner MatMul's weight too.
    assert _activations(plan) == {
        "x": ("inner_mm", "inner_relu"), "e": (), "t": (), "i": ("outer_mm",), "y": ()
    }
    assert plan.weights == (
        WeightTarget("W", "inner_mm", "MatMul", 1),
        WeightTarget("W", "outer_mm", "MatMul", 1),
    )


def test_float16_tensors_are_quantized_and_double_ones_are_not() -> None:
    """A float16 model is computed in float32 inside (its input and output cast at the edges),
    so its tensors are quantized under their widened names; float64 ones are not quantized."""
    for elem_type, activations in (
        (TensorProto.FLOAT16, {"x_float32": ("relu",), "y_float32": ()}),
        (TensorProto.DOUBLE, None),
    ):
        nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
        x = helper.make_tensor_value_info("x", elem_type, [2])
        y = helper.make_tensor_value_info("y", elem_type, [2])
        plan = _plan(build_model(nodes, [x], [y]))
        assert _decision(plan, "relu")[0] is (activations is not None)
        if activations is not None:
            assert _activations(plan) == activations


def test_plan_needs_named_nodes_and_a_float_model() -> None:
    model = conv_bn_relu(np.random.default_rng(22))
    model.graph.node[2].name = ""
    with pytest.raises(ModelError, match="has no name"):
        plan_quantization(model, SelectionRules())
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="q"),
        helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq"),
    ]
    quantized = build_model(nodes, [float_input("x", [2])], ["y"], {"s": np.array(0.1, np.float32)})
    with pytest.raises(ModelError, match="already quantized"):
        plan_quantization(quantized, SelectionRules())


@pytest.mark.parametrize(("op", "domain"), [("MatMulNBits", "com.microsoft"),
                                            ("QLinearMatMul", ""), ("MatMulInteger", ""),
                                            ("QLinearAdd", "com.microsoft")])
def test_a_model_computing_on_integer_codes_is_already_quantized(op: str, domain: str) -> None:
    """A weight-only model's MatMulNBits reads float activations and has no Q/DQ pair; it is
    quantized all the same (it was quantized again, with nothing to show for it)."""
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"], ["y"], name="integer", domain=domain)], "g",
        [float_input("x", [2, 8])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(ModelError, match=f"'integer' is a {op}: the model is already quantized"):
        plan_quantization(model, SelectionRules())


def test_plan_is_deterministic_and_sorted() -> None:
    model = conv_bn_relu(np.random.default_rng(23))
    first, second = _plan(model), _plan(model)
    assert first == second
    tensors = [a.tensor for a in first.activations]
    assert tensors == sorted(tensors)
    assert all(
        isinstance(a, ActivationTarget) and a.consumers == tuple(sorted(a.consumers))
        for a in first.activations
    )


def test_rules_table_lists_every_rule() -> None:
    table = rules_table()
    for op_type, rule in OP_RULES.items():
        assert f"| {op_type} | {rule.summary} |" in table


def test_readme_lists_the_current_rules() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert rules_table() in readme


def test_every_rule_quantizes_what_onnx_defines_as_float() -> None:
    """A rule's quantized inputs must be positions the operator types as float (T), so an
    int64 shape or index input can never be listed by mistake."""
    float_constraints = {"tensor(float)", "tensor(float16)", "tensor(bfloat16)"}
    for op_type, rule in OP_RULES.items():
        try:
            schema = onnx.defs.get_schema(op_type, 13)
        except onnx.defs.SchemaError:  # an operator of a later opset (HardSwish: 14)
            schema = onnx.defs.get_schema(op_type)
        positions = rule.inputs if rule.inputs is not None else [0]
        for position in positions:
            formal = schema.inputs[min(position, len(schema.inputs) - 1)]
            allowed = next(
                c.allowed_type_strs
                for c in schema.type_constraints
                if c.type_param_str == formal.type_str
            )
            assert float_constraints & set(allowed), (op_type, position)
