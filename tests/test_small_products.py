"""Placement "auto" keeps a MatMul/Gemm float when it computes fewer multiply-adds per run than
`--min-product-macs` (2^18 by default) at the calibration data's shapes: its input would be
quantized at every run for an integer kernel that saves less than that costs. A model with
nothing else to quantize then fails the coverage floor, saying why, instead of running slower
than float."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, optimized_ops
from click.testing import CliRunner
from onnx import TensorProto, helper

from qcal.cli import main
from qcal.config import CalibrationConfig
from qcal.graph.placement import SMALL_PRODUCT, SMALL_PRODUCT_MACS
from qcal.pipeline import calibrate


def _two_products(tokens: int, folder: Path) -> Path:
    """x [N, tokens, 64] -> MatMul 64x64 -> Relu -> MatMul 64x64 -> y, with calibration data."""
    rng = np.random.default_rng(0)
    inits = {name: (rng.standard_normal((64, 64)) * 0.15).astype(np.float32)
             for name in ("w1", "w2")}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="second")]
    model = build_model(nodes, [float_input("x", ["N", tokens, 64])], ["y"], inits)
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "calib.npz",
             x=rng.standard_normal((24, tokens, 64)).astype(np.float32))
    return folder / "m.onnx"


def _decisions(result: object) -> dict[str, dict]:
    return {d["name"]: d for d in result.report["nodes"]}  # type: ignore[attr-defined]


def test_products_at_the_minimum_are_quantized_and_smaller_ones_stay_float(
        tmp_path: Path) -> None:
    # 64 tokens x 64 x 64 = 2^18 multiply-adds per sample: at the minimum, quantized.
    assert 64 * 64 * 64 == SMALL_PRODUCT_MACS
    big = tmp_path / "big"
    big.mkdir()
    result = calibrate(_two_products(64, big), CalibrationConfig(data=big / "calib.npz"),
                       enforce_gates=False)
    assert all(_decisions(result)[n]["quantized"] for n in ("first", "second"))
    ops = optimized_ops(result.model, big)
    assert ops["MatMul"] == 0 and ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] == 2
    # 63 tokens: 258048 each, one token short of it: float, each saying its count.
    small = tmp_path / "small"
    small.mkdir()
    result = calibrate(_two_products(63, small), CalibrationConfig(data=small / "calib.npz"),
                       enforce_gates=False)
    for name in ("first", "second"):
        decision = _decisions(result)[name]
        assert not decision["quantized"]
        assert decision["reason"].startswith(SMALL_PRODUCT)
        assert f"{63 * 64 * 64} multiply-adds" in decision["reason"]
    ops = optimized_ops(result.model, small)
    assert ops["MatMul"] == 2 and ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] == 0
    # Asked for, every product is quantized again; emulation (placement "all") never weighs size.
    for options in ({"min_product_macs": 0}, {"placement": "all"}):
        again = calibrate(small / "m.onnx", CalibrationConfig(data=small / "calib.npz", **options),
                          enforce_gates=False)
        assert all(_decisions(again)[n]["quantized"] for n in ("first", "second"))


def test_a_model_of_small_products_alone_fails_the_coverage_floor_saying_why(
        tmp_path: Path) -> None:
    model = _two_products(8, tmp_path)
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data",
                                       str(tmp_path / "calib.npz"), "-o", str(out),
                                       "--report", str(report), "-q"])
    assert result.exit_code == 7, result.output
    assert "coverage floor" in result.output
    assert "2 of 2 compute nodes (100.0% of the MACs) left float as too small for an integer " \
        "kernel to pay" in " ".join(result.output.split())
    # ...and how to go on where the model will run on larger batches
    assert "--min-product-macs 0 quantizes them" in " ".join(result.output.split())
    assert out.is_file() and report.is_file()  # the evidence is written
    # Asked for, they are quantized: the coverage floor holds (a near-tie of these random
    # weights flipping is not the point).
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data",
                                       str(tmp_path / "calib.npz"), "-o", str(out), "--report",
                                       str(report), "-q", "--force", "--min-product-macs", "0",
                                       "--no-fallback"])
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["coverage"]["macs_quantized_fraction"] == 1.0


@pytest.mark.parametrize(("value", "code"), [("-1", 3), ("x", 2)])
def test_a_negative_or_non_integer_minimum_is_refused(tmp_path: Path, value: str,
                                                      code: int) -> None:
    model = _two_products(8, tmp_path)
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data",
                                       str(tmp_path / "calib.npz"), "-o", str(tmp_path / "q.onnx"),
                                       "--min-product-macs", value])
    assert result.exit_code == code, result.output  # bad configuration / bad usage
    assert "min-product-macs" in result.output
    assert not (tmp_path / "q.onnx").exists()


def test_products_inside_an_if_branch_are_held_to_the_same_minimum(tmp_path: Path) -> None:
    """A branch's products are sized per call at the calibration data's shapes, as the main
    graph's are: the else branch's product of a pooled row (4096 multiply-adds) stays float,
    the then branch's of the whole input (2^18) is quantized, as the main graph's is."""
    rng = np.random.default_rng(3)
    w = {name: (rng.standard_normal((64, 64)) * 0.15).astype(np.float32)
         for name in ("w0", "w1", "w2")}
    then = helper.make_graph(
        [helper.make_node("MatMul", ["r", "w1"], ["t"], name="then_mm")], "then", [],
        [float_input("t", ["N", 64, 64])])
    other = helper.make_graph(
        [helper.make_node("ReduceMean", ["r"], ["pooled"], name="pool", axes=[1]),
         helper.make_node("MatMul", ["pooled", "w2"], ["e"], name="else_mm"),
         helper.make_node("Add", ["r", "e"], ["s"], name="else_add")], "else", [],
        [float_input("s", ["N", 64, 64])])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m"], name="mm0"),
             helper.make_node("Relu", ["m"], ["r"], name="relu0"),
             helper.make_node("ReduceMean", ["x"], ["mean"], name="mean", keepdims=0),
             helper.make_node("Greater", ["mean", "zero"], ["cond"], name="positive"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then,
                              else_branch=other)]
    model = build_model(nodes, [float_input("x", ["N", 64, 64])], ["y"],
                        {**w, "zero": np.float32(0)})
    onnx.save(model, tmp_path / "m.onnx")
    x = rng.standard_normal((24, 64, 64)).astype(np.float32)
    x += np.where(np.arange(24) % 2, 0.05, -0.05).astype(np.float32)[:, None, None]  # both branches
    np.savez(tmp_path / "calib.npz", x=x)
    config = CalibrationConfig(data=tmp_path / "calib.npz")
    decisions = _decisions(calibrate(tmp_path / "m.onnx", config, enforce_gates=False))
    assert decisions["mm0"]["quantized"] and decisions["then_mm"]["quantized"]
    assert not decisions["else_mm"]["quantized"]
    assert decisions["else_mm"]["reason"].startswith(SMALL_PRODUCT)
    assert f"{64 * 64} multiply-adds" in decisions["else_mm"]["reason"]
    # the size is what keeps it float: with no minimum it is quantized like the others
    again = calibrate(tmp_path / "m.onnx", CalibrationConfig(data=tmp_path / "calib.npz",
                                                             min_product_macs=0),
                      enforce_gates=False)
    assert _decisions(again)["else_mm"]["quantized"]


def test_the_coverage_floor_names_compute_without_an_integer_kernel(tmp_path: Path) -> None:
    """A decoder whose work is a ConvTranspose (no integer kernel on the CPU provider) after a
    small Conv: the coverage floor's reason named only the small products' share before."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("ConvTranspose", ["r", "wt"], ["up"], name="up", strides=[2, 2],
                         kernel_shape=[4, 4], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["up"], ["y"], name="relu_up"),
    ]
    inits = {"w0": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2,
             "wt": rng.standard_normal((16, 64, 4, 4)).astype(np.float32) * 0.1}
    model = build_model(nodes, [float_input("x", ["N", 8, 16, 16])], ["y"], inits)
    said = _coverage_floor_failed(model, rng.standard_normal((16, 8, 16, 16)), tmp_path)
    # per input position, 16 x 64 channels x 16 taps; the Conv's, 8 x 16 channels x 9 taps
    share = 16 * 64 * 16 / (16 * 64 * 16 + 8 * 16 * 9)
    assert (f"1 of 2 compute nodes ({share:.1%} of the MACs) left float as onnxruntime has no "
            "integer kernel for their form") in said, said


def test_the_coverage_floor_names_products_of_two_activations(tmp_path: Path) -> None:
    """Attention scores (q @ k^T of 256 tokens) hold most of the work and stay float under
    placement auto; the coverage floor's reason named only the small projections before."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="query"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="key"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["y"], name="scores")]
    inits = {"wq": rng.standard_normal((16, 16)).astype(np.float32),
             "wk": rng.standard_normal((16, 16)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 256, 16])], ["y"], inits)
    said = _coverage_floor_failed(model, rng.standard_normal((8, 1, 256, 16)), tmp_path)
    attention, projections = 256 * 256 * 16, 2 * 256 * 16 * 16
    assert (f"1 of 3 compute nodes ({attention / (attention + projections):.1%} of the MACs) "
            "left float as products of two activations") in said, said
    assert "2 of 3 compute nodes" in said and "too small for an integer kernel" in said, said


def test_the_coverage_floor_names_narrow_convolutions(tmp_path: Path) -> None:
    """A 3-D Conv over 4 channels, a large one, and a grouped Conv of 2 channels per group:
    placement auto keeps both float as too narrow for the integer kernel, and the floor's
    reason gave no cause at all before (0.00 % against the floor, nothing more)."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Conv", ["x", "w3"], ["c"], name="conv3d",
                              pads=[1, 1, 1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wg"], ["y"], name="grouped", group=4,
                              pads=[1, 1, 1, 1, 1, 1])]
    inits = {"w3": rng.standard_normal((8, 4, 3, 3, 3)).astype(np.float32) * 0.2,
             "wg": rng.standard_normal((8, 2, 3, 3, 3)).astype(np.float32) * 0.2}
    model = build_model(nodes, [float_input("x", ["N", 4, 8, 16, 16])], ["y"], inits)
    said = _coverage_floor_failed(model, rng.standard_normal((8, 4, 8, 16, 16)), tmp_path)
    assert ("2 of 2 compute nodes (100.0% of the MACs) left float as convolutions too narrow"
            in said), said


def test_the_coverage_floor_names_compute_in_double(tmp_path: Path) -> None:
    """A dense layer in double (an skl2onnx MLP converted with float64 inputs) beside a small
    float one: the floor's reason named only the small one's 12 %."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Gemm", ["x", "w64", "b64"], ["h64"], name="dense64"),
             helper.make_node("Cast", ["h64"], ["h"], name="narrow", to=TensorProto.FLOAT),
             helper.make_node("Gemm", ["h", "w"], ["y"], name="head")]
    inits = {"w64": rng.standard_normal((1024, 512)) * 0.05, "b64": np.zeros(512),
             "w": rng.standard_normal((512, 10)).astype(np.float32) * 0.05}
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 1024])
    model = build_model(nodes, [x], ["y"], inits)
    said = _coverage_floor_failed(model, rng.standard_normal((8, 1024)), tmp_path,
                                  dtype=np.float64)
    # 1024 x 512 and 512 x 10 multiply-adds a row: 99.0 % and 1.0 %
    assert ("1 of 2 compute nodes (99.0% of the MACs) left as they are: they compute in another "
            "type than float" in said), said
    assert "1 of 2 compute nodes (1.0% of the MACs) left float as too small" in said, said


def test_the_coverage_floor_names_products_only_comparisons_read(tmp_path: Path) -> None:
    """A tree ensemble compiled to matrix products (hummingbird's GEMM strategy): which splits
    hold, summed per leaf path and compared for equality with each path's length, feeds only
    that comparison, whose operands stay exact; the floor's reason named only the small
    product of the leaves after it, 1 % of the MACs."""
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="splits"),
             helper.make_node("LessOrEqual", ["h", "thresholds"], ["below"], name="compare"),
             helper.make_node("Cast", ["below"], ["held"], name="held", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["held", "paths"], ["counts"], name="paths"),
             # as hummingbird writes it: the constant first, the computed operand second
             helper.make_node("Equal", ["lengths", "counts"], ["reached"], name="reached"),
             helper.make_node("Cast", ["reached"], ["leaf"], name="leaf", to=TensorProto.FLOAT),
             helper.make_node("Gemm", ["leaf", "values"], ["y"], name="values")]
    inits = {"w": rng.standard_normal((1024, 512)).astype(np.float32),
             "thresholds": rng.standard_normal(512).astype(np.float32),
             "paths": (rng.random((512, 512)) < 0.01).astype(np.float32),
             "lengths": np.full(512, 5.0, np.float32),
             "values": rng.standard_normal((512, 10)).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 1024])], ["y"], inits)
    said = _coverage_floor_failed(model, rng.standard_normal((8, 1024)), tmp_path)
    # multiply-adds a row: 1024 x 512 and 512 x 512 exact, 512 x 10 too small
    exact = 100 * (1024 * 512 + 512 * 512) / (1024 * 512 + 512 * 512 + 512 * 10)
    assert (f"2 of 3 compute nodes ({exact:.1f}% of the MACs) left float as they compute only "
            "what other operators read as exact parameters" in said), said


def _coverage_floor_failed(model: onnx.ModelProto, x: np.ndarray, folder: Path,
                           dtype: type = np.float32) -> str:
    """`qcal calibrate` of `model` on `x` (as `dtype`) from the command line, which must exit
    7: its output on one line."""
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "calib.npz", x=x.astype(dtype))
    result = CliRunner().invoke(main, ["calibrate", str(folder / "m.onnx"), "--data",
                                       str(folder / "calib.npz"), "-o", str(folder / "q.onnx"),
                                       "-q"])
    assert result.exit_code == 7, result.output
    return " ".join(result.output.split())


def test_the_coverage_floor_names_operators_without_a_rule(tmp_path: Path) -> None:
    """A model onnxruntime optimised and saved (its com.microsoft FusedConv): the floor's reason
    named only the small Gemm after it, 0.3 % of the MACs, and not the fused convolutions."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("FusedConv", ["x", "w", "b"], ["c"], name="fused",
                              domain="com.microsoft", activation="Relu", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "g"], ["y"], name="head")]
    inits = {"w": rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1,
             "b": np.zeros(32, np.float32),
             "g": rng.standard_normal((32, 10)).astype(np.float32)}
    graph = helper.make_graph(
        nodes, "fused", [float_input("x", ["N", 16, 24, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
        value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", 32, 24, 24])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    said = _coverage_floor_failed(model, rng.standard_normal((8, 16, 24, 24)), tmp_path)
    assert ("1 of 2 compute nodes (100.0% of the MACs) left float as operators qcal has no "
            "quantization rule for" in said), said


def test_products_in_double_are_float_for_their_type_not_their_size(tmp_path: Path) -> None:
    # The type is what keeps them float: a size, and --min-product-macs 0 as a way on, would
    # send the user the wrong way (a torch .double() MLP).
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="second")]
    model = build_model(
        nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, ["N", 8, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, ["N", 8, 64])],
        {name: rng.standard_normal((64, 64)) * 0.15 for name in ("w1", "w2")})
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((24, 8, 64)))
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data",
                                       str(tmp_path / "calib.npz"), "-o", str(tmp_path / "q.onnx")])
    said = " ".join(result.output.split())
    assert result.exit_code == 7, said
    assert "2 of 2 compute nodes (100.0% of the MACs) left as they are: they compute in another " \
        "type than float" in said, said
    assert "too small" not in said and "--min-product-macs" not in said
