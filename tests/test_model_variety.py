"""Models as converters of many years write them: old opsets, weights in Constant nodes, unfused
BatchNormalization, Identity chains, dynamic and zero-size shapes, shape inference that cannot
complete, several inputs and outputs of other types, float16. Each calibrates, and the result
runs in onnxruntime close to the float model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input, run
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.cli import main
from qcal.graph.model import prepare_model
from qcal.report import report_schema


def calibrate_cli(
    tmp_path: Path, model: onnx.ModelProto, data: Path, *flags: str
) -> dict[str, Any]:
    """Run `qcal calibrate` and return the report (validated against the shipped schema).
    Every node with a rule is quantized (placement "all"): the models here are small, and the
    tests are about what qcal reads and writes, not about where Q/DQ pays."""
    onnx.save(model, tmp_path / "model.onnx")
    result = CliRunner().invoke(
        main,
        [
            "calibrate",
            str(tmp_path / "model.onnx"),
            "--data",
            str(data),
            "-o",
            str(tmp_path / "q.onnx"),
            "--report",
            str(tmp_path / "q.json"),
            "--force",
            "--placement",
            "all",
            *flags,
        ],
    )
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads((tmp_path / "q.json").read_text())
    jsonschema.validate(report, report_schema())
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"), full_check=True)
    return {**report, "console": " ".join(result.output.split())}


def quantized(tmp_path: Path) -> onnx.ModelProto:
    return onnx.load(tmp_path / "q.onnx")


def npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def steps(report: dict[str, Any]) -> dict[str, str]:
    return {s["step"]: s["detail"] for s in report["input_model"]["preparation"]}


def worst_sqnr(report: dict[str, Any]) -> float:
    values = [o["sqnr_db"] for o in report["evaluation"]["outputs"] if o["sqnr_db"] is not None]
    return min(values)


# ------------------------------------------------------------------------------- old opsets


def old_exporter_model(opset: int, rng: np.random.Generator) -> onnx.ModelProto:
    """Constant-node weight behind an Identity chain, Conv + unfused BatchNormalization, Clip
    with constant bounds, Flatten, Gemm: the shape of many opset-11/12 exports."""
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    nodes = [
        helper.make_node("Constant", [], ["w"], name="w_const", value=weight),
        helper.make_node("Identity", ["w"], ["w1"], name="id_a"),
        helper.make_node("Identity", ["w1"], ["w2"], name="id_b"),
        helper.make_node("Conv", ["x", "w2"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["r1"], name="id_c"),
        helper.make_node("Clip", ["r1", "lo", "hi"], ["cl"], name="clip"),
        helper.make_node("Flatten", ["cl"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "G", "gb"], ["y"], name="fc", transB=1),
    ]
    inits = {
        "s": rng.uniform(0.5, 2, 4).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "m": rng.standard_normal(4).astype(np.float32) * 0.1,
        "v": rng.uniform(0.5, 2, 4).astype(np.float32),
        "lo": np.float32(0.0),
        "hi": np.float32(6.0),
        "G": (rng.standard_normal((10, 4 * 8 * 8)) * 0.1).astype(np.float32),
        "gb": rng.standard_normal(10).astype(np.float32),
    }
    return build_model(
        nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits, opset=opset, ir_version=6
    )


@pytest.mark.parametrize(
    ("opset", "mode", "scales"),
    [(8, "linear", [1, 1, 2, 2]), (8, "linear", [1, 1, 3, 1.5]), (9, "linear", [1, 1, 2.5, 2]),
     (10, "linear", [1, 1, 2, 3]), (8, "nearest", [1, 1, 3, 3]), (9, "nearest", [1, 1, 3, 2]),
     (10, "nearest", [1, 1, 0.5, 0.5])],
)
def test_old_upsample_and_resize_compute_the_same_after_the_upgrade(
    opset: int, mode: str, scales: list[float]
) -> None:
    """Before opset 11 Upsample and Resize map coordinates as x / scale (onnxruntime takes
    the index below in nearest mode, above when downsampling); onnx's converter wrote opset
    11's defaults, half-pixel coordinates (a linear upsampling off by up to 1.5 here)."""
    x = np.random.default_rng(opset).standard_normal((1, 2, 5, 7)).astype(np.float32)
    if opset == 8:
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode,
                                scales=[float(s) for s in scales])
        inits = []
    else:
        node = helper.make_node("Upsample" if opset == 9 else "Resize", ["x", "s"], ["y"],
                                mode=mode)
        inits = [numpy_helper.from_array(np.array(scales, np.float32), "s")]
    # a reader after it: onnx's converter then renames the output it writes
    after = helper.make_node("Neg", ["up"], ["y"], name="neg")
    node.output[0] = "up"
    graph = helper.make_graph([node, after], "old", [float_input("x", [1, 2, 5, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 4
    prepared, steps = prepare_model(model)
    assert any(s.name == "upgrade-opset" for s in steps)
    np.testing.assert_array_equal(run(prepared, {"x": x})[0], run(model, {"x": x})[0])


@pytest.mark.parametrize("opset", [11, 12])
def test_old_opset_with_constant_weights_unfused_bn_and_identity_chains(
    tmp_path: Path, opset: int
) -> None:
    rng = np.random.default_rng(opset)
    model = old_exporter_model(opset, rng)
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    report = calibrate_cli(tmp_path, model, data)
    done = steps(report)
    # opset 13 needs IR 7 (onnx's table); the test models are written with IR 6
    assert done["upgrade-opset"] == f"opset {opset} -> 13, IR 6 -> 7"
    assert "moved 1 Constant node" in done["constants-to-initializers"]
    assert done["eliminate-identity"] == "removed 3 Identity nodes"
    assert done["fold-batchnorm"] == "folded 1 BatchNormalization into Conv"
    q = quantized(tmp_path)
    ops = [n.op_type for n in q.graph.node]
    assert "BatchNormalization" not in ops and "Identity" not in ops
    producers = {o: n for n in q.graph.node for o in n.output}
    inits = {i.name: i for i in q.graph.initializer}
    for node in q.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            dq = producers[node.input[1]]
            assert inits[dq.input[0]].data_type == TensorProto.INT8
    assert all(d["quantized"] for d in report["nodes"] if d["op_type"] in ("Conv", "Gemm"))
    assert worst_sqnr(report) > 25


# ----------------------------------------------------------------------------- dynamic shapes


def fully_convolutional(rng: np.random.Generator) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[1, 1]),
    ]
    inits = {"W": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    return build_model(nodes, [float_input("x", ["N", 3, "H", "W"])], ["y"], inits)


def test_symbolic_batch_and_spatial_dims_with_samples_of_different_sizes(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    folder = tmp_path / "samples"
    folder.mkdir()
    sizes = [(8, 8), (5, 7), (8, 8), (8, 8), (16, 4), (1, 1), (8, 8)]
    for i, (h, w) in enumerate(sizes):
        npz(folder / f"{i:02d}.npz", x=rng.standard_normal((1, 3, h, w)).astype(np.float32))
    # every sample calibrates (the folder is the evaluation data too: none held out)
    report = calibrate_cli(tmp_path, fully_convolutional(rng), folder, "--batch-size", "3",
                           "--eval-data", str(folder))
    assert report["data"]["samples"] == len(sizes)
    assert report["coverage"]["quantized"] == 3
    # The ranges are those of every sample, whatever its size: check the input's.
    values = np.concatenate([np.load(folder / f"{i:02d}.npz")["x"].ravel() for i in range(7)])
    stats = {t["name"]: t["statistics"] for t in report["tensors"] if t["role"] == "activation"}
    assert stats["x"]["min"][0] == pytest.approx(values.min()) and stats["x"]["max"][
        0
    ] == pytest.approx(values.max())
    assert worst_sqnr(report) > 25


def test_zero_size_tensors_are_skipped_and_an_always_empty_tensor_stays_float(
    tmp_path: Path,
) -> None:
    """A Slice that selects nothing feeds a MatMul through an Abs: that tensor never has values.
    (Not the Slice's own output: a Slice moves its input's values and takes its parameters.)"""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        helper.make_node("Slice", ["x", "start", "end", "axis"], ["cut"], name="take_nothing"),
        helper.make_node("Abs", ["cut"], ["none"], name="magnitude"),
        helper.make_node("MatMul", ["none", "W"], ["z"], name="mm_empty"),
    ]
    inits = {
        "W": rng.standard_normal((4, 3)).astype(np.float32),
        "start": np.array([2], np.int64),
        "end": np.array([2], np.int64),
        "axis": np.array([1], np.int64),
    }
    model = build_model(nodes, [float_input("x", ["N", "K", 4])], ["y", "z"], inits)
    folder = tmp_path / "samples"
    folder.mkdir()
    shapes = [(1, 3, 4), (0, 3, 4), (1, 5, 4), (1, 0, 4)]  # empty batches and empty rows too
    for i, shape in enumerate(shapes):
        npz(folder / f"{i}.npz", x=rng.standard_normal(shape).astype(np.float32))
    report = calibrate_cli(tmp_path, model, folder)
    decisions = {n["name"]: n for n in report["nodes"]}
    assert decisions["mm"]["quantized"]
    # Its weight is still stored quantized; its input, never seen with values, stays float.
    assert "input 'none' left float: it received no values" in decisions["mm_empty"]["reason"]
    assert {"none", "z"}.isdisjoint(t["name"] for t in report["tensors"])


def test_values_onnx_cannot_type_are_typed_by_onnxruntime(tmp_path: Path) -> None:
    """onnx cannot infer through onnxruntime's com.microsoft ops (a model onnxruntime's
    optimizer has fused): onnxruntime types what follows them, so the MatMul after the Gelu is
    quantized like the one before, and the report says where the types came from."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Gelu", ["h"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("MatMul", ["g", "V"], ["y"], name="mm_after"),
    ]
    inits = {
        "W": rng.standard_normal((4, 6)).astype(np.float32),
        "V": rng.standard_normal((6, 2)).astype(np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "custom",
        [float_input("x", ["N", 4])],
        [float_input("y", ["N", 2])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32))
    report = calibrate_cli(tmp_path, model, data)
    prepared = steps(report)
    assert "of 3 intermediate tensors" in prepared["infer-shapes"]
    assert "com.microsoft" in prepared["onnxruntime-types"]
    decisions = {n["name"]: n for n in report["nodes"]}
    assert decisions["mm"]["quantized"] and decisions["mm_after"]["quantized"]
    written = onnx.load(tmp_path / "q.onnx")
    dequantized = {n.output[0] for n in written.graph.node if n.op_type == "DequantizeLinear"}
    after = next(n for n in written.graph.node if n.name == "mm_after")
    assert set(after.input) <= dequantized  # both its operands come in through Q/DQ
    assert worst_sqnr(report) > 20


def test_a_value_onnxruntime_gives_no_shape_is_not_declared_a_scalar(tmp_path: Path) -> None:
    """scikit-learn's exporter starts with ai.onnx.ml's Scaler, whose output neither onnx nor
    onnxruntime shapes (onnxruntime says [] as for a scalar): typed without a shape, the MatMul
    reading it still loads and is quantized (declared rank 0, onnxruntime refused the model)."""
    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("Scaler", ["x"], ["scaled"], name="scaler", domain="ai.onnx.ml",
                         offset=[0.5] * 4, scale=[2.0] * 4),
        helper.make_node("MatMul", ["scaled", "W"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes, "sklearn", [float_input("x", ["N", 4])], [float_input("y", ["N", 2])],
        [numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "W")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    )
    model.ir_version = 8
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32))
    report = calibrate_cli(tmp_path, model, data)
    assert {n["name"]: n for n in report["nodes"]}["mm"]["quantized"]
    assert worst_sqnr(report) > 20


# ---------------------------------------------------------------------- several inputs/outputs


def test_several_inputs_and_outputs_with_int64_and_bool_inputs(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["emb"], name="embed"),
        helper.make_node("MatMul", ["emb", "P"], ["h"], name="proj"),
        helper.make_node("Cast", ["mask"], ["mf"], name="mask_float", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mf", "axis"], ["mu"], name="mask_axis"),
        helper.make_node("Mul", ["h", "mu"], ["hm"], name="apply_mask"),
        helper.make_node("Add", ["hm", "x"], ["y1"], name="residual"),
        helper.make_node("Relu", ["y1"], ["y2"], name="relu"),
        helper.make_node("Where", ["mask", "ids", "ids"], ["y3"], name="keep_ids"),
    ]
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", "T"]),
        float_input("x", ["N", "T", 6]),
    ]
    outputs = ["y1", "y2", helper.make_tensor_value_info("y3", TensorProto.INT64, ["N", "T"])]
    inits = {
        "E": rng.standard_normal((10, 8)).astype(np.float32),
        "P": rng.standard_normal((8, 6)).astype(np.float32),
        "axis": np.array([2], np.int64),
    }
    model = build_model(nodes, inputs, outputs, inits)
    n = 12
    data = npz(
        tmp_path / "d.npz",
        ids=rng.integers(0, 10, (n, 1, 5)).astype(np.int64),
        mask=rng.random((n, 1, 5)) < 0.7,
        x=rng.standard_normal((n, 1, 5, 6)).astype(np.float32),
    )
    # The lookup stays float (a default exclusion); the projection reads its vectors quantized.
    report = calibrate_cli(tmp_path, model, data, "--batch-size", "4", "--min-coverage", "0")
    decisions = {n["name"]: n for n in report["nodes"]}
    assert not decisions["embed"]["quantized"] and decisions["proj"]["quantized"]
    quantized_tensors = {t["name"] for t in report["tensors"]}
    assert {"ids", "mask", "y3"}.isdisjoint(quantized_tensors)  # never integers or masks
    assert {"h", "x"} <= quantized_tensors
    outputs_seen = {o["name"]: o for o in report["evaluation"]["outputs"]}
    assert set(outputs_seen) == {"y1", "y2", "y3"}
    assert outputs_seen["y3"]["max_abs_error"] == 0  # integer output passes through untouched
    assert min(outputs_seen[k]["sqnr_db"] for k in ("y1", "y2")) > 25
    feeds = dict(np.load(data))
    sample = {k: v[0] for k, v in feeds.items()}
    for got, expected in zip(run(quantized(tmp_path), sample), run(model, sample)):
        assert got.shape == expected.shape and got.dtype == expected.dtype


def test_activations_below_the_presets_smallest_step_stay_float(tmp_path: Path) -> None:
    """A layer whose outputs are all about 1e-9 (the pytorch preset's smallest step is 2^-23):
    quantized, they would be a constant. Kept float, each says why, and the model's output
    keeps its signal; the tensors of ordinary size around them are quantized as usual."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
        helper.make_node("Div", ["h", "huge"], ["t"], name="shrink"),
        helper.make_node("MatMul", ["t", "V"], ["u"], name="mm2"),
        helper.make_node("Div", ["u", "tiny"], ["v"], name="grow"),
        helper.make_node("MatMul", ["v", "U"], ["y"], name="mm3"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 2, 8])], ["y"],
        {"W": rng.standard_normal((8, 16)).astype(np.float32),
         # Vectors: a Div by a scalar shares its input's parameters instead of observing.
         "tiny": np.full(16, 1e-9, np.float32), "huge": np.full(16, 1e9, np.float32),
         "V": rng.standard_normal((16, 16)).astype(np.float32),
         "U": rng.standard_normal((16, 4)).astype(np.float32)},
    )
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 2, 8)).astype(np.float32))
    # mm2 reads float values: a model this small falls under the coverage floor. Its output, a
    # linear layer's [N, 2, 4], is read per position: a random network's near-ties there are
    # not what this test is about (its SQNR is checked below).
    report = calibrate_cli(tmp_path, model, data, "--min-coverage", "0", "--no-fallback")
    quantized_tensors = {t["name"] for t in report["tensors"] if t["role"] == "activation"}
    assert {"x", "h", "v"} <= quantized_tensors and not {"t", "u"} & quantized_tensors
    reasons = {n["name"]: n["reason"] for n in report["nodes"]}
    assert "smallest scale the preset allows" in reasons["shrink"], reasons
    assert all(n["quantized"] for n in report["nodes"] if n["name"] in ("mm1", "mm3"))
    x = np.load(data)["x"]
    (got,) = run(quantized(tmp_path), {"x": x})
    (expected,) = run(model, {"x": x})
    sqnr = 10 * np.log10(np.sum(expected**2) / np.sum((got - expected) ** 2))
    assert sqnr > 20 and worst_sqnr(report) > 20


def test_a_narrow_range_far_from_zero_stays_quantized(tmp_path: Path) -> None:
    """Values of 100 +- 0.5 span few steps of their scale (the range includes 0, as a
    near-uniform softmax's output does), but that scale is the scheme's choice, not the
    preset's floor: the tensor is quantized as usual."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "offset"], ["t"], name="shift"),
        helper.make_node("MatMul", ["t", "V"], ["y"], name="mm2"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 2, 8])], ["y"],
        {"W": (rng.standard_normal((8, 16)) * 0.05).astype(np.float32),
         "offset": np.full(16, 100, np.float32),
         "V": rng.standard_normal((16, 4)).astype(np.float32)},
    )
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 2, 8)).astype(np.float32))
    report = calibrate_cli(tmp_path, model, data)
    assert "t" in {t["name"] for t in report["tensors"] if t["role"] == "activation"}
    assert "smallest scale" not in json.dumps(report["nodes"])


# -------------------------------------------------------------------------------- float16


def test_float16_model_is_computed_in_float32_inside_and_keeps_its_interface(
    tmp_path: Path,
) -> None:
    """onnxruntime's integer kernels take float32 graphs: a float16 model is widened inside,
    its input and output keep their float16 type, and its MatMuls run as integer kernels."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"),
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
        helper.make_node("Cast", ["r"], ["r16"], name="keep_half", to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["r16", "V"], ["m"], name="mm_out"),
        helper.make_node("Relu", ["m"], ["y"], name="relu_out"),
    ]
    model = build_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 3])],
        {
            "W": rng.standard_normal((8, 16)).astype(np.float16),
            "V": (rng.standard_normal((16, 3)) * 0.3).astype(np.float16),
        },
    )
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 8)).astype(np.float16))
    report = calibrate_cli(tmp_path, model, data, "--eval-data", str(data))
    assert steps(report)["widen-half"] == ("float16 computed in float32 (inputs and outputs "
                                           "keep their types); 1 Cast between them dropped")
    q = quantized(tmp_path)
    onnx.checker.check_model(q, full_check=True)
    assert [(v.name, v.type.tensor_type.elem_type) for v in (*q.graph.input, *q.graph.output)] \
        == [("x", TensorProto.FLOAT16), ("y", TensorProto.FLOAT16)]
    assert not [i.name for i in q.graph.initializer if i.data_type == TensorProto.FLOAT16]
    # Both MatMuls run as integer kernels in onnxruntime's own graph.
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(q.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert sum(op in ("MatMulIntegerToFloat", "QLinearMatMul") for op in ops) == 2, ops
    x = np.load(data)["x"]
    (got,) = run(q, {"x": x})
    (expected,) = run(model, {"x": x})
    assert got.dtype == np.float16 and got.shape == expected.shape
    assert worst_sqnr(report) > 20


def test_a_float16_model_onnxruntime_cannot_load_is_compared_with_its_widened_copy_and_says_so(
    tmp_path: Path,
) -> None:
    """torch.onnx writes a half-precision LayerNormalization with float32 scale and bias, which
    onnxruntime refuses to load; widened to float32 it runs, and the run says what it compared
    and timed the quantized model with."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"),
        helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "V"], ["y"], name="mm_out"),
    ]
    model = build_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 8])],
        {"W": (rng.standard_normal((64, 64)) / 8).astype(np.float16),
         "gamma": np.ones(64, np.float32), "beta": np.zeros(64, np.float32),
         "V": (rng.standard_normal((64, 8)) / 8).astype(np.float16)},
        opset=17,
    )
    with pytest.raises(Exception, match="LayerNormalization"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 64)).astype(np.float16))
    report = calibrate_cli(tmp_path, model, data, "--eval-data", str(data))
    (said,) = [w for w in report["warnings"] if w.startswith("your float model does not run")]
    assert "LayerNormalization" in said and "the float model qcal prepared from it does" in said
    assert "your float model does not run in onnxruntime" in report["console"]
    assert "latency_quantized_1_thread" in report["timings_seconds"]
    (y,) = run(quantized(tmp_path), {"x": rng.standard_normal((2, 64)).astype(np.float16)})
    assert y.dtype == np.float16 and np.isfinite(y).all()


# ---------------------------------------------------------------------------- training mode


def _exported_for_training(tmp_path: Path, dropout: bool) -> tuple[Path, Path]:
    """A Conv, a BatchNormalization in training mode (batch statistics) and, with `dropout`,
    a Dropout whose training_mode input is a constant true, as torch.onnx's TRAINING export
    writes them."""
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"],
                              ["n", "running_mean", "running_var"], name="bn", training_mode=1),
             helper.make_node("Relu", ["n"], ["r" if dropout else "y"], name="relu")]
    if dropout:
        nodes += [helper.make_node("Constant", [], ["ratio"], name="ratio_c",
                                   value=numpy_helper.from_array(np.array(0.5, np.float32))),
                  helper.make_node("Constant", [], ["train"], name="train_c",
                                   value=numpy_helper.from_array(np.array(True))),
                  helper.make_node("Dropout", ["r", "ratio", "train"], ["y"], name="drop")]
    model = build_model(
        nodes, [float_input("x", ["N", 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 16, 16])],
        {"W": (rng.standard_normal((16, 8, 3, 3)) / 8).astype(np.float32),
         "g": np.ones(16, np.float32), "b": np.zeros(16, np.float32),
         "m": np.zeros(16, np.float32), "v": np.ones(16, np.float32)}, opset=15)
    onnx.save(model, tmp_path / "model.onnx")
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 1, 8, 16, 16)).astype(np.float32))
    return tmp_path / "model.onnx", data


def test_a_model_exported_for_training_is_refused_where_random_and_said_where_not(
    tmp_path: Path,
) -> None:
    model, data = _exported_for_training(tmp_path, dropout=True)
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(data),
                                       "-o", str(tmp_path / "q.onnx")])
    said = " ".join(result.output.split())
    assert result.exit_code == 4, said
    assert "Dropout 'drop' runs in training mode" in said and "model.eval()" in said
    assert not (tmp_path / "q.onnx").exists()
    # Batch statistics are the sample's own: deterministic, calibrated as they are, and said.
    model, data = _exported_for_training(tmp_path, dropout=False)
    onnx.save(onnx.load(model), tmp_path / "bn.onnx")
    report = calibrate_cli(tmp_path, onnx.load(tmp_path / "bn.onnx"), data)
    (note,) = [w for w in report["warnings"] if w.startswith("BatchNormalization 'bn'")]
    assert "in training mode" in note and "in training mode" in report["console"]


# ------------------------------------------------------------------------------- providers


def test_the_report_and_console_say_which_providers_ran(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((4, 3, 8, 8)).astype(np.float32))
    report = calibrate_cli(
        tmp_path,
        fully_convolutional(rng),
        data,
        "--provider",
        "CPUExecutionProvider",
        "--threads",
        "1",
    )
    assert report["runtime"] == {
        "providers_requested": ["CPUExecutionProvider"],
        "providers_used": ["CPUExecutionProvider"],
        "threads": 1,
    }
    assert "3 of 3 nodes quantized" in report["console"]
    assert "with CPUExecutionProvider" in report["console"]


def test_a_conv_whose_output_is_below_the_smallest_step_stays_float(tmp_path: Path) -> None:
    """A Conv whose outputs are all about 1e-9 (a ConvNeXt block's layer scale of 1e-6 folded
    into its last Conv, random weights): its output cannot be quantized, and an integer Conv
    writes integers, so it stays float at once, saying why (onnxruntime ran it in float on
    dequantized weights, and the report blamed onnxruntime)."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["h"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "W2"], ["tiny"], name="scaled"),
        helper.make_node("Add", ["tiny", "x"], ["y"], name="residual"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 8, 6, 6])], ["y"],
        {"W1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.3,
         "W2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32) * 1e-9})
    data = npz(tmp_path / "d.npz", x=rng.standard_normal((16, 8, 6, 6)).astype(np.float32))
    report = calibrate_cli(tmp_path, model, data, "--min-coverage", "0", "--no-fallback")
    reasons = {n["name"]: (n["quantized"], n["reason"]) for n in report["nodes"]}
    assert reasons["scaled"][0] is False
    assert "its integer kernel would write its output 'tiny'" in reasons["scaled"][1]
    assert "smallest scale the preset allows" in reasons["scaled"][1]
    assert "onnxruntime runs it in float" not in reasons["scaled"][1]
