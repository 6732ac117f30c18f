"""The written QDQ layout is one onnxruntime's CPU provider turns into integer kernels: constants
of Add/Mul in the activation type, Relu/Clip after Add/Mul left to the QuantizeLinear, data
movement on shared parameters, and integer kernels whose readers are float."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input, optimized_ops
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import SelectionRules, plan_quantization, prepare_model
from qcal.pipeline import CalibrationResult, calibrate


def _run(
    model: onnx.ModelProto, tmp_path: Path, x: np.ndarray, **options: Any
) -> CalibrationResult:
    """`model` calibrated on `x` (input "x") with these config options."""
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=x)
    config = CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", **options)
    return calibrate(tmp_path / "m.onnx", config)


def _calibrate(model: onnx.ModelProto, tmp_path: Path, x: np.ndarray) -> onnx.ModelProto:
    """Every node with a rule quantized (placement "all"): the layout onnxruntime fuses."""
    return _run(model, tmp_path, x, placement="all").model


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _conv_weights(rng: np.random.Generator, layers: dict[str, tuple[tuple[int, ...], float]],
                  *, bias_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random Conv weights ``w<name>`` (of `shape`, times `scale`) and biases ``b<name>`` (one
    per output channel, times `bias_scale`), drawn layer by layer, weight then bias."""
    inits = {}
    for name, (shape, scale) in layers.items():
        inits[f"w{name}"] = rng.standard_normal(shape).astype(np.float32) * scale
        inits[f"b{name}"] = rng.standard_normal(shape[0]).astype(np.float32) * bias_scale
    return inits


def _hard_swish_block(rng: np.random.Generator, *, in_channels: int = 3) -> onnx.ModelProto:
    """conv -> hard-swish written out (Add 3, Clip 0..6, Mul, Div 6) -> scalar affine ->
    max pool -> SE-style conv -> HardSigmoid -> Mul -> conv: PP-LCNet's building blocks. Under
    placement "auto" a first conv of fewer than 8 input channels stays float."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "three"], ["a1"], name="add3"),
        helper.make_node("Clip", ["a1", "zero", "six"], ["r6"], name="relu6"),
        helper.make_node("Mul", ["c1", "r6"], ["m1"], name="mul"),
        helper.make_node("Div", ["m1", "six"], ["hs"], name="div6"),
        helper.make_node("Mul", ["hs", "scale"], ["scaled"], name="lab_scale"),
        helper.make_node("Add", ["scaled", "bias"], ["shifted"], name="lab_bias"),
        helper.make_node(
            "MaxPool", ["shifted"], ["pooled"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["pooled", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("HardSigmoid", ["c2"], ["gate"], name="gate"),
        helper.make_node("Mul", ["pooled", "gate"], ["gated"], name="se_mul"),
        helper.make_node("Conv", ["gated", "w3", "b3"], ["y"], name="conv3"),
    ]
    inits = {
        **_conv_weights(rng, {"1": ((8, in_channels, 3, 3), 0.5), "2": ((8, 8, 1, 1), 0.3),
                              "3": ((4, 8, 1, 1), 0.3)}),
        "three": np.array(3.0, np.float32),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
        "scale": np.array([1.3], np.float32),
        "bias": np.array([-0.2], np.float32),
    }
    return build_model(nodes, [float_input("x", ["N", in_channels, 16, 16])], ["y"], inits)


def test_every_compute_node_runs_in_integers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    model = _hard_swish_block(rng)
    x = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    ops = optimized_ops(quantized, tmp_path)
    # Only the HardSigmoid (no integer kernel) stays float, with one pair around it; the last
    # Conv writes the model's output through a pair of its own. The Div by 6 is gone: folded
    # into the scale of the DequantizeLinear that the next Mul reads; so is the Mul by the
    # scalar 1.3 after it.
    assert ops["QLinearConv"] == 3 and ops["QLinearAdd"] == 2 and ops["QLinearMul"] == 2
    assert not {"Conv", "FusedConv", "Add", "Mul", "Clip", "Relu", "Div"} & set(ops), ops
    assert ops["HardSigmoid"] == 1
    # Q: input, HardSigmoid; DQ: HardSigmoid, the output.
    assert ops["QuantizeLinear"] == 2 and ops["DequantizeLinear"] == 2, ops
    # The max pool runs on the integers: equal parameters on both sides, no pair around it.
    assert ops["MaxPool"] + ops["NhwcMaxPool"] == 1
    reference = _outputs(model, x[:4])
    error = np.abs(_outputs(quantized, x[:4]) - reference).max()
    assert error < 0.05 * np.abs(reference).max()


def test_plan_shares_parameters_across_data_movement() -> None:
    rng = np.random.default_rng(1)
    prepared, _ = prepare_model(_hard_swish_block(rng, in_channels=8))
    auto = {t.tensor: t for t in plan_quantization(prepared, SelectionRules()).activations}
    # placement auto leaves the MaxPool float (onnxruntime's uint8 MaxPool is slow): its output
    # gets parameters of its own, for the Conv. The elementwise chain before it is quantized:
    # it reaches the Conv through the MaxPool, which onnxruntime moves a QuantizeLinear through.
    # Placed with everything else, the MaxPool's output shares its input's parameters.
    assert auto["pooled"].same_as is None and "shifted" in auto
    plan = plan_quantization(prepared, SelectionRules(placement="all"))
    targets = {t.tensor: t for t in plan.activations}
    assert targets["pooled"].same_as == "shifted" and targets["pooled"].divisor == 1.0
    # The Div by 6 of hard-swish: its output takes the Mul's parameters, scale divided by 6.
    assert targets["hs"].same_as == "m1" and targets["hs"].divisor == 6.0
    # The Mul by 1.3 after it: a division by 1 / 1.3, shared the same way.
    assert targets["scaled"].same_as == "m1"
    assert targets["scaled"].divisor == pytest.approx(6.0 / np.float32(1.3), rel=1e-12)
    shared = {"pooled", "hs", "scaled"}
    assert all(t.same_as is None for name, t in targets.items() if name not in shared)
    # Clip after Add is left to the QuantizeLinear: the tensor between them is not quantized.
    assert "a1" not in targets and "r6" in targets
    roles = {w.tensor: w.role for w in plan.weights}
    assert roles["w1"] == "weight" and roles["three"] == "operand" and "scale" not in roles


def test_shared_outputs_take_the_source_parameters(tmp_path: Path) -> None:
    """Reshape -> Transpose -> MaxPool chain: one observer, identical parameters on all."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("MaxPool", ["t"], ["p"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("Conv", ["p", "w2"], ["y"], name="conv2"),
    ]
    inits = {
        "w": rng.standard_normal((4, 3, 1, 1)).astype(np.float32),
        "shape": np.array([0, 4, 8, 8], np.int64),
        "w2": rng.standard_normal((2, 4, 1, 1)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz",
                                                               placement="all"))
    records = {t["name"]: t for t in result.report["tensors"] if t["role"] == "activation"}
    for name in ("r", "t", "p"):
        assert records[name]["onnx"] == records["c"]["onnx"]
        assert records[name]["range"]["same_as"] == "c"
    ops = optimized_ops(result.model, tmp_path)
    # Reshape, Transpose and MaxPool run on the integers, between two integer convolutions
    # (the second writes the model's output through a DequantizeLinear).
    assert ops["QLinearConv"] == 2 and ops["QuantizeLinear"] == 1, ops
    assert {"Reshape", "Transpose"} <= set(ops) and ops["DequantizeLinear"] == 1, ops


def test_a_slice_between_integer_convolutions_moves_their_codes(tmp_path: Path) -> None:
    """torch's ``x.chunk(2, dim=1)`` as TorchScript writes it, a Slice of the channels between
    two Convs: placed by default, it takes its input's parameters and onnxruntime slices the
    integer codes (with its own parameters it sliced floats between a DequantizeLinear and a
    QuantizeLinear)."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["half"], name="chunk"),
        helper.make_node("Conv", ["half", "w2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv3"),
    ]
    inits = {
        "w": rng.standard_normal((16, 8, 1, 1)).astype(np.float32),
        "starts": np.array([0], np.int64), "ends": np.array([8], np.int64),
        "axes": np.array([1], np.int64),
        "w2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32),
        "w3": rng.standard_normal((2, 8, 1, 1)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 8, 8, 8)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(
        min_product_macs=0, data=tmp_path / "calib.npz", fallback=False), enforce_gates=False)
    decisions = {d["name"]: d for d in result.report["nodes"]}
    assert decisions["chunk"]["quantized"], decisions["chunk"]
    records = {t["name"]: t for t in result.report["tensors"] if t["role"] == "activation"}
    assert records["half"]["onnx"] == records["r"]["onnx"]
    assert records["half"]["range"]["same_as"] == "r"
    optimized_ops(result.model, tmp_path)
    ran = onnx.load(tmp_path / "optimized.onnx").graph.node
    producer = {v: n for n in ran for v in n.output}
    (chunk,) = [n for n in ran if n.op_type == "Slice"]
    assert producer[chunk.input[0]].op_type != "DequantizeLinear"


def test_graph_outputs_stay_float(tmp_path: Path) -> None:
    """An Add whose output is a graph output keeps it float (no QuantizeLinear on it)."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "x"], ["y"], name="add"),
    ]
    model = build_model(
        nodes, [float_input("x", ["N", 6])], ["y"], {"k": np.array([0.5], np.float32)}
    )
    quantized = _calibrate(model, tmp_path, rng.standard_normal((8, 6)).astype(np.float32))
    producers = {o: n for n in quantized.graph.node for o in n.output}
    assert producers["y"].op_type == "Add"
    assert all(n.input[0] != "y" for n in quantized.graph.node if n.op_type == "QuantizeLinear")


def _division_model(
    rng: np.random.Generator, divisor: np.ndarray, outputs: tuple[str, ...] = ("y", "e"),
    *, channels: tuple[int, int] = (3, 6),
) -> onnx.ModelProto:
    """conv -> Relu6 -> Div -> conv, and the quotient also read by an Erf (no integer kernel);
    `channels`: the input's and the first conv's output's (under placement "auto" a conv of
    fewer than 8 input channels stays float)."""
    inputs, middle = channels
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1"),
        helper.make_node("Clip", ["c1", "zero", "six"], ["r6"], name="relu6"),
        helper.make_node("Div", ["r6", "divisor"], ["q"], name="div"),
        helper.make_node("Conv", ["q", "w2", "b2"], ["y"], name="conv2"),
        helper.make_node("Erf", ["q"], ["e"], name="erf"),
    ]
    inits = {
        **_conv_weights(rng, {"1": ((middle, inputs, 1, 1), 1.0), "2": ((4, middle, 1, 1), 1.0)}),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
        "divisor": divisor,
    }
    return build_model(nodes, [float_input("x", ["N", inputs, 8, 8])], list(outputs), inits)


def test_division_by_a_constant_is_folded_into_the_dequantize_scale(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    model = _division_model(rng, np.array([6.0], np.float32))
    x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=x)
    # Placement "all", which quantizes the Div whatever its neighbours.
    result = calibrate(tmp_path / "m.onnx",
                       CalibrationConfig(data=tmp_path / "calib.npz", placement="all"))
    quantized = result.model
    # The Div is gone: both of its readers read a DequantizeLinear of the Clip's codes.
    assert "Div" not in {n.op_type for n in quantized.graph.node}
    producers = {o: n for n in quantized.graph.node for o in n.output}
    readers = [n for n in quantized.graph.node if n.name in ("conv2", "erf")]
    for reader in readers:
        dequantize = producers[reader.input[0]]
        assert dequantize.op_type == "DequantizeLinear"
        assert producers[dequantize.input[0]].op_type == "QuantizeLinear"
        assert producers[producers[dequantize.input[0]].input[0]].output[0] == "r6"
    records = {t["name"]: t for t in result.report["tensors"] if t["role"] == "activation"}
    assert records["q"]["range"]["same_as"] == "r6" and records["q"]["range"]["divided_by"] == 6
    source_scale = records["r6"]["onnx"]["scale"][0]
    assert records["q"]["onnx"]["scale"][0] == pytest.approx(source_scale / 6, rel=1e-6)
    assert records["q"]["onnx"]["zero_point"] == records["r6"]["onnx"]["zero_point"]
    # The conv computes what it computed with the Div left float and its output quantized
    # (requantizing the quotient of codes with these parameters gives the same codes): the
    # fold only removes work. The Erf now reads the quantized quotient, as float readers of
    # integer kernels do: within half a step of it (Erf's slope is at most 2 / sqrt(pi)).
    kept = calibrate(
        tmp_path / "m.onnx",
        CalibrationConfig(data=tmp_path / "calib.npz", exclude_op_types=("Div",), placement="all"),
    ).model
    assert "Div" in {n.op_type for n in kept.graph.node}
    (y, e), (y_kept, e_kept) = _all_outputs(quantized, x[:4]), _all_outputs(kept, x[:4])
    assert np.abs(y - y_kept).max() <= 1e-4 * np.abs(y_kept).max()
    step = records["q"]["onnx"]["scale"][0]
    assert np.abs(e - e_kept).max() <= 1.13 * step / 2 + 1e-6
    ops = optimized_ops(quantized, tmp_path)
    assert ops["QLinearConv"] == 2 and "Div" not in ops, ops


def _all_outputs(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, {"x": x})]


@pytest.mark.parametrize(
    ("divisor", "why"),
    [
        (np.array(-6.0, np.float32), "not a positive constant scalar"),
        (np.array(0.0, np.float32), "not a positive constant scalar"),
        (np.full((1, 8, 1, 1), 6.0, np.float32), "not a positive constant scalar"),
    ],
)
def test_division_by_anything_else_is_not_quantized(divisor: np.ndarray, why: str) -> None:
    prepared, _ = prepare_model(_division_model(np.random.default_rng(6), divisor,
                                                channels=(8, 8)))
    plan = plan_quantization(prepared, SelectionRules())
    decision = next(d for d in plan.nodes if d.node == "div")
    assert not decision.quantized and why in decision.reason
    assert all(t.divisor == 1.0 for t in plan.activations)


def test_a_division_writing_a_graph_output_stays(tmp_path: Path) -> None:
    """The quotient is a graph output: the Div stays for it, the conv reads the folded scale."""
    rng = np.random.default_rng(7)
    model = _division_model(rng, np.array(4.0, np.float32), outputs=("y", "e", "q"))
    quantized = _calibrate(model, tmp_path, rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    producers = {o: n for n in quantized.graph.node for o in n.output}
    assert producers["q"].op_type == "Div"
    conv2 = next(n for n in quantized.graph.node if n.name == "conv2")
    dequantize = producers[conv2.input[0]]
    assert producers[dequantize.input[0]].input[0] == "r6"  # the Clip's codes


def test_data_movement_with_float_readers_runs_on_the_integers(tmp_path: Path) -> None:
    """conv -> Transpose (also read by an Erf) -> conv: onnxruntime runs the Transpose on the
    integers, and the Erf reads the Transpose's DequantizeLinear, which holds the same values."""
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Transpose", ["c"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("Erf", ["t"], ["e"], name="erf"),
        helper.make_node("Conv", ["t", "w2"], ["y"], name="conv2"),
    ]
    inits = {
        "w": rng.standard_normal((4, 3, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((2, 4, 1, 1)).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y", "e"], inits)
    x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
    quantized = _calibrate(model, tmp_path, x)
    erf = next(n for n in quantized.graph.node if n.name == "erf")
    assert erf.input[0] != "t"  # reads the DequantizeLinear
    ops = optimized_ops(quantized, tmp_path)
    # One QuantizeLinear (the input) and no pair around the Transpose: DequantizeLinear only
    # of its integer output, for the Erf, and of conv2's, the model's output.
    assert ops["QuantizeLinear"] == 1 and ops["QLinearConv"] == 2, ops
    assert ops["Transpose"] >= 1 and ops["DequantizeLinear"] == 2, ops
    reference, got = _all_outputs(model, x[:4]), _all_outputs(quantized, x[:4])
    for expected, actual in zip(reference, got):
        assert np.abs(actual - expected).max() < 0.1 * np.abs(expected).max()


def test_a_fused_clip_with_float_readers_keeps_its_conv_integer(tmp_path: Path) -> None:
    """conv -> Clip (ReLU6, fused into the conv) read by a ReduceMean (float) and a conv: the
    ReduceMean reads the Clip's DequantizeLinear, so the QuantizeLinear is the Clip's only reader
    and onnxruntime runs both convs as QLinearConv. Read directly, the Clip stayed, and the first
    conv ran in float on dequantized weights (MobileNetV3's squeeze-excite blocks, exported by
    torch.onnx)."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c", "zero", "six"], ["r6"], name="relu6"),
        helper.make_node("ReduceMean", ["r6"], ["m"], name="mean", axes=[2, 3], keepdims=1),
        helper.make_node("Conv", ["r6", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Mul", ["c2", "m"], ["y"], name="scale"),
    ]
    inits = {
        **_conv_weights(rng, {"": ((8, 8, 3, 3), 0.5), "2": ((8, 8, 1, 1), 0.3)}),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    x = rng.standard_normal((8, 8, 8, 8)).astype(np.float32)
    quantized = _run(model, tmp_path, x).model
    mean = next(n for n in quantized.graph.node if n.name == "mean")
    assert mean.input[0] != "r6"  # reads the DequantizeLinear
    ops = optimized_ops(quantized, tmp_path)
    assert ops["QLinearConv"] == 2, ops
    assert not {"Conv", "FusedConv", "Clip"} & set(ops), ops
    expected, actual = _outputs(model, x), _outputs(quantized, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("bias_shape", [(5,), (1, 5)])
def test_a_bias_added_after_a_matmul_is_stored_as_int32(
    tmp_path: Path, bias_shape: tuple[int, ...]
) -> None:
    """conv -> Flatten -> MatMul -> Add(constant) -> output, as Keras, JAX and paddle exports
    write a dense layer: the Add's constant is written as int32 codes at input scale x weight
    scale, and onnxruntime fuses the MatMul and the Add into one integer Gemm (with a float
    bias it ran a float Gemm on dequantized weights)."""
    rng = np.random.default_rng(11)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Flatten", ["r1"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "w"], ["m"], name="dense"),
        helper.make_node("Add", ["m", "b"], ["y"], name="dense_bias"),
    ]
    inits = {
        "w1": rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(4).astype(np.float32),
        "w": rng.standard_normal((4 * 6 * 6, 5)).astype(np.float32) * 0.1,
        "b": rng.standard_normal(bias_shape).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)
    x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
    # Without bias correction (tested below), the codes are the bias's own.
    result = _run(model, tmp_path, x, fallback=False, bias_correction=False)
    records = {t["name"]: t for t in result.report["tensors"]}
    assert records["b"]["role"] == "bias" and records["b"]["consumers"] == ["dense_bias"]
    scales = {name: np.asarray(records[name]["onnx"]["scale"], np.float32) for name in ("f", "w")}
    expected_scale = (scales["f"] * scales["w"]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(records["b"]["onnx"]["scale"], np.float32),
                                  expected_scale)
    codes = next(i for i in result.model.graph.initializer if i.name == "b_quantized")
    assert codes.data_type == onnx.TensorProto.INT32
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(codes).reshape(-1),
        np.round(inits["b"].reshape(-1) / expected_scale).astype(np.int32))
    ops = optimized_ops(result.model, tmp_path)
    assert ops["QGemm"] == 1 and not {"Gemm", "MatMul", "Add"} & set(ops), ops
    expected, actual = _outputs(model, x), _outputs(result.model, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


def test_a_linear_relu_mlp_between_float_ops_runs_as_integer_gemms(tmp_path: Path) -> None:
    """Gemm -> Relu -> Gemm -> Relu between float Tanhs (torch's Linear-ReLU on 2-D inputs).
    With the last Relu's output float, onnxruntime fused each Gemm with its Relu into a float
    FusedGemm on dequantized weights, so both were kept float: the activation's output is
    quantized instead, and onnxruntime runs two integer QGemms."""
    rng = np.random.default_rng(11)
    nodes = [
        helper.make_node("Tanh", ["x"], ["t"], name="pre"),
        helper.make_node("Gemm", ["t", "w1", "b1"], ["g1"], name="fc1", transB=1),
        helper.make_node("Relu", ["g1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["g2"], name="fc2", transB=1),
        helper.make_node("Relu", ["g2"], ["r2"], name="relu2"),
        helper.make_node("Tanh", ["r2"], ["y"], name="post"),
    ]
    inits = {
        "w1": rng.standard_normal((16, 8)).astype(np.float32) * 0.4,
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((12, 16)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(12).astype(np.float32) * 0.1,
    }
    model = build_model(nodes, [float_input("x", ["N", 8])], ["y"], inits)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["fc1"] and decisions["fc2"]
    assert {"r1", "r2"} <= {t["name"] for t in result.report["tensors"]}
    ops = optimized_ops(result.model, tmp_path)
    assert ops["QGemm"] == 2 and not {"Gemm", "FusedGemm"} & set(ops), ops
    expected, actual = _outputs(model, x), _outputs(result.model, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_a_matmul_relu_mlp_on_tokens_between_float_ops_runs_in_integers(
    tmp_path: Path, activation: str
) -> None:
    """MatMul -> Relu -> MatMul -> Relu on 3-D inputs (tokens, no bias: a bias-free MLP)
    before a float ReduceMean. onnxruntime turns a MatMul on dequantized inputs into an integer
    MatMulIntegerToFloat only when no Relu or Clip reads its output: with the last activation's
    output float, both MatMuls were kept float and none of the model's compute ran in integers.
    The activation's output is quantized instead, as a Gemm's is."""
    rng = np.random.default_rng(13)
    bounds = ["lo", "hi"] if activation == "Clip" else []
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
        helper.make_node(activation, ["m1", *bounds], ["r1"], name="act1"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="fc2"),
        helper.make_node(activation, ["m2", *bounds], ["r2"], name="act2"),
        helper.make_node("ReduceMean", ["r2"], ["y"], name="pool", axes=[1]),
    ]
    inits = {
        "w1": rng.standard_normal((32, 48)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal((48, 24)).astype(np.float32) * 0.2,
        "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 16, 32])], ["y"], inits)
    x = rng.standard_normal((16, 1, 16, 32)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["fc1"] and decisions["fc2"], result.report["nodes"]
    assert result.report["coverage"]["macs_quantized_fraction"] == 1.0
    ops = optimized_ops(result.model, tmp_path)
    assert not {"MatMul", "FusedMatMul"} & set(ops), ops
    expected, actual = _outputs(model, x[:, 0]), _outputs(result.model, x[:, 0])
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


def test_a_linear_relu_before_a_float_transposed_convolution_stays_integer(tmp_path: Path) -> None:
    """A VAE's decoder: Gemm -> Relu -> Reshape -> ConvTranspose. Planned first with the
    Reshape between quantized anchors, the ConvTranspose then turns out float (onnxruntime has
    no integer kernel for it) and the plan is made again without it. The Relu's output must
    keep its pair in that plan although its only reader is now a float Reshape: the writer
    judged that by the parameters calibration had found for the Reshape's output, not by the
    new plan, left the output float, and onnxruntime fused the pair into a float FusedGemm."""
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["g1"], name="fc1", transB=1),
        helper.make_node("Relu", ["g1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["g2"], name="fc2", transB=1),
        helper.make_node("Relu", ["g2"], ["r2"], name="relu2"),
        helper.make_node("Reshape", ["r2", "shape"], ["grid"], name="unflatten"),
        helper.make_node("ConvTranspose", ["grid", "wt", "bt"], ["y"], name="deconv",
                         strides=[2, 2], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": rng.standard_normal((32, 8)).astype(np.float32) * 0.4,
        "b1": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((128, 32)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(128).astype(np.float32) * 0.1,
        "shape": np.array([-1, 8, 4, 4], np.int64),
        "wt": rng.standard_normal((8, 3, 4, 4)).astype(np.float32) * 0.3,
        "bt": rng.standard_normal(3).astype(np.float32) * 0.1,
    }
    model = build_model(nodes, [float_input("x", ["N", 8])], ["y"], inits)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["fc1"] and decisions["fc2"] and not decisions["deconv"]
    ops = optimized_ops(result.model, tmp_path)
    assert ops["QGemm"] == 2 and not {"Gemm", "FusedGemm"} & set(ops), ops
    expected, actual = _outputs(model, x), _outputs(result.model, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize(("rows", "batch"), [(None, "N"), (6, "N"), (6, 1)])
def test_a_bias_add_between_two_dense_layers_stays_a_bias(
    tmp_path: Path, rows: int | None, batch: str | int
) -> None:
    """MatMul -> Add(row) -> Relu -> MatMul -> Add(row), as tf2onnx writes two Dense layers: the
    first Add sits between quantized anchors, yet it is not quantized itself (an integer Add of
    the product and an 8-bit copy of the bias, one requantization more): it stays float and its
    row goes in as the first MatMul's int32 bias, so onnxruntime runs each layer as one integer
    kernel. Also with a rank-3 input (`rows`): of static shape, onnxruntime flattens it to 2-D
    for the same integer Gemm; with a dynamic batch it keeps MatMul and Add apart."""
    rng = np.random.default_rng(21)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="dense1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="dense1_bias"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="dense2"),
        helper.make_node("Add", ["m2", "b2"], ["y"], name="dense2_bias"),
    ]
    inits = {
        "w1": rng.standard_normal((32, 64)).astype(np.float32) * 0.2,
        "b1": rng.standard_normal(64).astype(np.float32),
        "w2": rng.standard_normal((64, 10)).astype(np.float32) * 0.1,
        "b2": rng.standard_normal(10).astype(np.float32),
    }
    shape: list[str | int] = [batch, 32] if rows is None else [batch, rows, 32]
    model = build_model(nodes, [float_input("x", shape)], ["y"], inits)
    x = rng.standard_normal((16, 32) if rows is None else (16, rows, 32)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False, bias_correction=False)
    decisions = {d["name"]: d for d in result.report["nodes"]}
    assert not decisions["dense1_bias"]["quantized"]
    assert "takes it as its bias" in decisions["dense1_bias"]["reason"]
    ops = optimized_ops(result.model, tmp_path)
    assert not {"QLinearAdd", "QLinearMatMul", "Gemm", "MatMul"} & set(ops), ops
    records = {t["name"]: t for t in result.report["tensors"]}
    add = next(n for n in result.model.graph.node if n.name == "dense1_bias")
    if rows is None or batch == 1:  # one integer Gemm per layer, the row as its int32 bias
        assert records["b1"]["role"] == "bias" and records["b1"]["consumers"] == ["dense1_bias"]
        assert ops["QGemm"] == 2, ops
    else:
        # MatMulIntegerToFloat takes no bias: the Add reads the float row itself, not int32
        # codes through a DequantizeLinear that would run at every run.
        assert "b1" not in records and add.input[1] == "b1"
        assert ops["MatMulIntegerToFloat"] == 2 and ops["DequantizeLinear"] == 0, ops
    sample = x[:1] if batch == 1 else x
    expected, actual = _outputs(model, sample), _outputs(result.model, sample)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("preset", ["pytorch", "pytorch-symmetric", "tensorflow"])
def test_conv_relu_runs_in_integers_whatever_the_activation_zero_point(
    tmp_path: Path, preset: str
) -> None:
    """conv -> Relu -> conv -> Relu -> conv: onnxruntime drops a Relu before a QuantizeLinear
    only when a range from 0 gets the lowest code as zero point (asymmetric activations). With a
    symmetric preset the Relu stays, so the Conv's own output is quantized too: every conv runs
    as QLinearConv (left to the Relu, the convs ran in float on dequantized weights)."""
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("Relu", ["c3"], ["y"], name="relu3"),
    ]
    inits = {
        **_conv_weights(rng, {"1": ((8, 8, 3, 3), 0.5), "2": ((8, 8, 3, 3), 0.2),
                              "3": ((4, 8, 1, 1), 0.3)}, bias_scale=0.1),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    x = rng.standard_normal((8, 8, 8, 8)).astype(np.float32)
    quantized = _run(model, tmp_path, x, preset=preset, fallback=False).model
    ops = optimized_ops(quantized, tmp_path)
    # conv3 writes the graph output through its Relu, in float: onnxruntime runs it in float.
    assert ops["QLinearConv"] >= 2 and ops["FusedConv"] + ops["Conv"] <= 1, ops
    expected, actual = _outputs(model, x), _outputs(quantized, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


def test_weights_onnxruntime_would_dequantize_into_float_nodes_stay_float(tmp_path: Path) -> None:
    """conv -> ConvTranspose -> conv -> conv (writing the output): onnxruntime's CPU provider
    has no integer ConvTranspose, so with Q/DQ it runs it in float on dequantized weights. qcal
    reads back the graph onnxruntime runs and keeps such nodes float (their decisions say why),
    planned again without them so that the first conv still writes integers: no weight is
    dequantized into a float compute node. The last conv writes the model's output through a
    pair of its own, which onnxruntime's integer Conv needs."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("ConvTranspose", ["c1", "wt", "bt"], ["up"], name="up",
                         strides=[2, 2], kernel_shape=[2, 2]),
        helper.make_node("Conv", ["up", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Conv", ["c2", "w3", "b3"], ["y"], name="conv3"),
    ]
    inits = {
        "w1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(8).astype(np.float32),
        "w3": rng.standard_normal((2, 8, 1, 1)).astype(np.float32) * 0.5,
        "b3": rng.standard_normal(2).astype(np.float32),
        "wt": rng.standard_normal((8, 8, 2, 2)).astype(np.float32) * 0.5,
        "bt": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32) * 0.5,
        "b2": rng.standard_normal(8).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    x = rng.standard_normal((8, 8, 8, 8)).astype(np.float32)
    result = _run(model, tmp_path, x, min_coverage=0.0)  # much of the compute stays float here
    decisions = {n["name"]: n for n in result.report["nodes"]}
    nodes = {n.name: n for n in result.model.graph.node}
    ops = optimized_ops(result.model, tmp_path)
    if "ConvTranspose" in ops:  # float in onnxruntime: kept float, and the report says why
        assert not decisions["up"]["quantized"] and nodes["up"].input[1] == "wt"
        assert "onnxruntime runs it in float" in decisions["up"]["reason"]
    assert decisions["conv3"]["quantized"] and nodes["conv3"].input[1] != "w3"
    writers = {v: n for n in result.model.graph.node for v in n.output}
    assert writers[result.model.graph.output[0].name].op_type == "DequantizeLinear"
    # conv1, conv2 after the float ConvTranspose and conv3 run as integer kernels; the coverage
    # counts them.
    assert ops["QLinearConv"] == 3 and "Conv" not in ops, ops
    assert result.report["coverage"]["quantized_compute_nodes"] == 3
    expected, actual = _outputs(model, x), _outputs(result.model, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


def test_bias_correction_reaches_the_bias_an_add_gives_a_matmul(tmp_path: Path) -> None:
    """x (mean far from 0) -> MatMul -> Add(constant) -> y: the Add's int32 bias takes back the
    mean output shift of the quantized MatMul, measured on held-out data, as a Gemm's does; only
    that bias changes."""
    rng = np.random.default_rng(13)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="dense"),
        helper.make_node("Add", ["m", "b"], ["y"], name="dense_bias"),
    ]
    inits = {
        "w": rng.standard_normal((6, 32)).astype(np.float32),
        "b": rng.standard_normal(32).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 6])], ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    calib = (3.0 + rng.standard_normal((64, 6))).astype(np.float32)
    held_out = (3.0 + rng.standard_normal((256, 6))).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=calib)
    shifts = {}
    models = {}
    for correct in (False, True):
        config = CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", fallback=False,
                                   bias_correction=correct)
        models[correct] = calibrate(tmp_path / "m.onnx", config).model
        error = _outputs(models[correct], held_out) - _outputs(model, held_out)
        shifts[correct] = float(np.abs(error.mean(axis=0)).mean())
    assert shifts[True] < 0.5 * shifts[False], shifts
    before = {i.name: i for i in models[False].graph.initializer}
    changed = [i.name for i in models[True].graph.initializer
               if i.SerializeToString() != before[i.name].SerializeToString()]
    assert changed == ["b_quantized"]


def test_a_fused_relu_read_by_a_max_pool_is_left_to_onnxruntime(tmp_path: Path) -> None:
    """conv -> Relu -> MaxPool (float) -> conv: onnxruntime moves the MaxPool output's
    QuantizeLinear up to the Relu and runs conv, pool and conv on integers. A pair on the Relu's
    output would block that (a DequantizeLinear, a float MaxPool and a QuantizeLinear more), so
    the MaxPool reads the Relu's float output."""
    rng = np.random.default_rng(14)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["y"], name="gap"),
    ]
    inits = {
        **_conv_weights(rng, {"1": ((8, 8, 3, 3), 0.5), "2": ((8, 8, 1, 1), 0.3)}, bias_scale=0.1),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], inits)
    x = rng.standard_normal((8, 8, 8, 8)).astype(np.float32)
    quantized = _run(model, tmp_path, x, fallback=False).model
    pool = next(n for n in quantized.graph.node if n.name == "pool")
    assert pool.input[0] == "r1"
    ops = optimized_ops(quantized, tmp_path)
    # One DequantizeLinear: the float GlobalAveragePool's input.
    assert ops["QLinearConv"] == 2 and ops["NhwcMaxPool"] == 1, ops
    assert ops["DequantizeLinear"] == 1 and not {"Conv", "FusedConv", "MaxPool"} & set(ops), ops


def test_a_graph_onnxruntime_cannot_write_out_skips_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where onnxruntime cannot write its optimized graph out, the model is judged as before
    (it runs, so it is kept), with no check of its fusions, instead of being called unrunnable."""
    from qcal.accuracy import runnable

    real = runnable.create_session
    asked: list[bool] = []

    def no_write_out(model: onnx.ModelProto, **kwargs: object) -> object:
        asked.append(kwargs.get("optimized_to") is not None)
        if kwargs.get("optimized_to") is not None:
            raise RuntimeError("Unable to serialize model as it contains compiled nodes")
        return real(model, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runnable, "create_session", no_write_out)
    rng = np.random.default_rng(15)
    model = _hard_swish_block(rng)
    x = rng.standard_normal((8, 3, 16, 16)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    assert asked[:2] == [True, False]
    assert result.report["coverage"]["quantized_compute_nodes"] >= 1


def test_a_residual_block_after_a_max_pool_runs_in_integers(tmp_path: Path) -> None:
    """conv -> Relu -> MaxPool -> [conv -> Relu -> conv, and the shortcut] -> Add -> Relu ->
    conv, as a ResNet's stem and first block: the residual Add reads the MaxPool's output, which
    the block's first conv reads quantized anyway, so the Add is quantized too and every conv
    runs as QLinearConv (with the Add left float, the block's second conv, whose output only
    the Add reads, ran in float on dequantized weights, and so did the stem)."""
    rng = np.random.default_rng(16)
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="stem_relu"),
        helper.make_node("MaxPool", ["r0"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="gap"),
    ]
    inits = {
        **_conv_weights(rng, {"0": ((8, 8, 3, 3), 0.5), "1": ((8, 8, 3, 3), 0.2),
                              "2": ((8, 8, 3, 3), 0.2), "3": ((4, 8, 1, 1), 0.3)}, bias_scale=0.1),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 16, 16])], ["y"], inits)
    x = rng.standard_normal((8, 8, 16, 16)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["residual"]["quantized"] and not decisions["pool"]["quantized"]
    assert result.report["coverage"]["quantized_compute_nodes"] == 4
    ops = optimized_ops(result.model, tmp_path)
    assert ops["QLinearConv"] == 4 and ops["QLinearAdd"] == 1, ops
    assert not {"Conv", "FusedConv", "Add"} & set(ops), ops
    expected, actual = _outputs(model, x), _outputs(result.model, x)
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


def _hard_activation_block(rng: np.random.Generator) -> onnx.ModelProto:
    """conv -> HardSwish -> conv -> HardSigmoid (paddle's slope 0.2) gating the HardSwish's
    output -> conv -> conv (the head, which writes the output in float), as MobileNetV3's
    blocks are exported."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["hs"], name="hswish"),
        helper.make_node("Conv", ["hs", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("HardSigmoid", ["c2"], ["gate"], name="hsigmoid", alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["hs", "gate"], ["gated"], name="se_mul"),
        helper.make_node("Conv", ["gated", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("Conv", ["c3", "w4", "b4"], ["y"], name="head"),
    ]
    inits = _conv_weights(rng, {"1": ((8, 8, 3, 3), 0.5), "2": ((8, 8, 1, 1), 0.4),
                                "3": ((8, 8, 1, 1), 0.3), "4": ((4, 8, 1, 1), 0.3)})
    return build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["y"], inits,
                       opset=14)


def test_hard_swish_and_hard_sigmoid_between_integer_convs_run_on_integers(
    tmp_path: Path,
) -> None:
    """onnxruntime has no integer kernel for either; under placement auto the writer spells them
    as integer Add (and Mul), so nothing between the first and the last Conv runs in float.
    Placement "all" emulates a target: the nodes stay, between their pairs."""
    rng = np.random.default_rng(21)
    model = _hard_activation_block(rng)
    x = rng.standard_normal((16, 8, 12, 12)).astype(np.float32)
    written = _run(model, tmp_path, x, fallback=False).model
    onnx.checker.check_model(written)
    assert not {"HardSwish", "HardSigmoid"} & {n.op_type for n in written.graph.node}
    ops = optimized_ops(written, tmp_path)
    assert not {"HardSwish", "HardSigmoid", "Add", "Mul", "FusedConv"} & set(ops), ops
    # HardSwish: Add and Mul; HardSigmoid: Add; the gating Mul
    assert ops["QLinearAdd"] == 2 and ops["QLinearMul"] == 2, ops
    reference = _outputs(model, x[:4])
    error = np.abs(_outputs(written, x[:4]) - reference).max()
    assert error < 0.05 * np.abs(reference).max()

    emulated = _run(model, tmp_path, x, fallback=False, placement="all").model
    kept = Counter(n.op_type for n in emulated.graph.node)
    assert kept["HardSwish"] == 1 and kept["HardSigmoid"] == 1
    # int8 codes (the tensorflow preset): onnxruntime converts them to uint8 for its x86
    # kernels only where a QuantizeLinear has one reader, and HardSwish's form reads x twice,
    # so it stays a node there, and the Conv writing x stays integer (as do the other three)
    signed = _run(model, tmp_path, x, fallback=False, preset="tensorflow").model
    assert Counter(n.op_type for n in signed.graph.node)["HardSwish"] == 1
    assert optimized_ops(signed, tmp_path)["QLinearConv"] == 4


def _between_pair(op_type: str, y_scale: float, **attributes: float) -> onnx.ModelProto:
    """uint8 codes -> DequantizeLinear -> `op_type` -> QuantizeLinear -> uint8 codes."""
    nodes = [
        helper.make_node("DequantizeLinear", ["codes", "xs", "xz"], ["x"], name="dq"),
        helper.make_node(op_type, ["x"], ["y"], name="act", **attributes),
        helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["out"], name="q"),
    ]
    graph = helper.make_graph(
        nodes, "pair", [helper.make_tensor_value_info("codes", onnx.TensorProto.UINT8, [256])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.UINT8, [256])],
        [onnx.numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in (
            ("xs", 0.05, np.float32), ("xz", 120, np.uint8),
            ("ys", y_scale, np.float32), ("yz", 0, np.uint8))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _codes(model: onnx.ModelProto, *, optimized: bool) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    every = np.arange(256, dtype=np.uint8)
    return np.asarray(session.run(None, {"codes": every})[0]).astype(np.int64)


def _quantize(values: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """numpy's QuantizeLinear to uint8: float32 division, half to even, saturation."""
    steps = np.rint(values.astype(np.float32) / np.float32(scale)).astype(np.int64) + zero_point
    return np.clip(steps, 0, 255)


@pytest.mark.parametrize(("op_type", "beta"), [("HardSwish", None), ("HardSigmoid", 0.5),
                                              ("HardSigmoid", 0.0), ("HardSigmoid", -0.25)])
def test_the_integer_forms_compute_what_they_document(op_type: str, beta: float | None) -> None:
    """Every one of the 256 input codes: the rewritten pair computes the documented arithmetic
    (numpy, below), onnxruntime's fused integer kernels agree with it to a code, and
    both stay within a code (HardSigmoid) or two (HardSwish, whose gate x + 3 is rounded to 8
    bits) of the node it replaces."""
    from qcal.graph.qdq._integer_forms import write_integer_forms

    attributes = {"alpha": 0.2, "beta": beta} if op_type == "HardSigmoid" else {}
    y_scale = 1 / 255 if op_type == "HardSigmoid" else 0.03
    model = _between_pair(op_type, y_scale, **attributes)
    original = _codes(model, optimized=False)
    assert write_integer_forms(model, frozenset({"act"})) == 1
    onnx.checker.check_model(model)
    assert op_type not in {n.op_type for n in model.graph.node}
    written, fused = _codes(model, optimized=False), _codes(model, optimized=True)

    x = ((np.arange(256) - 120) * np.float32(0.05)).astype(np.float32)
    if beta is not None:  # one Add of beta / alpha, quantized with scale y_scale / alpha
        # the constant: the extreme code of its sign, scale |beta / alpha| / 255 (0: code 0)
        step = np.float32(abs(float(np.float32(beta)) / float(np.float32(0.2))) / 255)
        shift = np.float32(np.sign(beta) * 255 * step)
        expected = _quantize(x + shift, float(np.float32(y_scale)) / float(np.float32(0.2)), 0)
    else:  # x + 3 on [0, min(6, 3 + the top of x)], times x, quantized with scale 6 * y_scale
        gate_scale = np.float32(min(6.0, 3.0 + 135 * np.float32(0.05)) / 255)
        three = np.float32(255 * np.float32(3 / 255))
        gate = _quantize(x + three, gate_scale, 0).astype(np.float32) * gate_scale
        expected = _quantize(x * gate, np.float32(np.float32(y_scale) * 6), 0)
    # onnxruntime's QuantizeLinear may round an exact tie (x.5 in float32) the other way
    assert np.abs(written - expected).max() <= 1 and (written == expected).mean() >= 0.99
    assert np.abs(fused - written).max() <= 1
    assert np.abs(written - original).max() <= (1 if op_type == "HardSigmoid" else 2)


@pytest.mark.parametrize("constant_first", [False, True])
def test_a_mul_by_a_positive_constant_scalar_is_folded_like_a_division(
    tmp_path: Path, constant_first: bool
) -> None:
    """Keras writes hard-swish as x * (relu6(x + 3) * (1 / 6)): the Mul by 1/6 takes its
    input's codes with the scale multiplied by 1/6, and goes, as the Div by 6 of
    x * relu6(x + 3) / 6 does; the model computes the same values. A scalar written first,
    Mul(1/6, r), is an ordinary quantized Mul."""
    rng = np.random.default_rng(7)
    sixth = ["sixth", "r6"] if constant_first else ["r6", "sixth"]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "three"], ["a1"], name="add3"),
        helper.make_node("Clip", ["a1", "zero", "six"], ["r6"], name="relu6"),
        helper.make_node("Mul", sixth, ["gate"], name="times_sixth"),
        helper.make_node("Mul", ["c1", "gate"], ["hs"], name="mul"),
        helper.make_node("Conv", ["hs", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["y"], name="conv3"),
    ]
    inits = {
        **_conv_weights(rng, {"1": ((8, 8, 3, 3), 0.5), "2": ((8, 8, 3, 3), 0.2),
                              "3": ((4, 8, 1, 1), 0.3)}),
        "three": np.array(3.0, np.float32), "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32), "sixth": np.array(1 / 6, np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 8, 16, 16])], ["y"], inits)
    x = rng.standard_normal((16, 8, 16, 16)).astype(np.float32)
    result = _run(model, tmp_path, x, fallback=False)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    multiplications = [n for n in result.model.graph.node if n.name == "times_sixth"]
    if constant_first:
        assert decisions["times_sixth"]["quantized"] and multiplications
    else:
        assert decisions["times_sixth"]["quantized"] and not multiplications  # folded away
        tensors = {t["name"]: t for t in result.report["tensors"]}
        scale = {name: float(np.ravel(tensors[name]["onnx"]["scale"])[0]) for name in ("gate", "r6")}
        assert scale["gate"] == pytest.approx(scale["r6"] / 6, rel=1e-6)
    reference = _outputs(model, x[:4])
    error = np.abs(_outputs(result.model, x[:4]) - reference).max()
    assert error < 0.05 * np.abs(reference).max()
