"""`--weight-rounding auto`: GPTQ codes for MatMul/Gemm weights (the codes `gptq` writes for
them), rounding to nearest for Conv weights (the codes `nearest` writes), and on a model without
MatMul/Gemm no Hessian measured at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal import pipeline
from qcal.calibration.hessians import HessianTarget
from qcal.cli import main

ROUNDINGS = ("nearest", "gptq", "auto")


def _conv_mlp(folder: Path, rng: np.random.Generator, *, head: bool) -> tuple[Path, Path]:
    """Two Convs with biases, then (with `head`) a Gemm with a bias and a MatMul without; and
    spatially smooth data, whose neighbouring pixels correlate as images' do (GPTQ then has
    something to gain on the Convs too)."""
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
    ]
    weights = {"W1": rng.normal(size=(8, 8, 3, 3)) * 0.3, "B1": rng.normal(size=8) * 0.1,
               "W2": rng.normal(size=(8, 8, 3, 3)) * 0.15, "B2": rng.normal(size=8) * 0.1}
    output = "r2"
    if head:
        nodes += [
            helper.make_node("Flatten", ["r2"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "G", "gb"], ["h"], name="fc", transB=1),
            helper.make_node("Relu", ["h"], ["rh"], name="relu3"),
            helper.make_node("MatMul", ["rh", "M"], ["y"], name="mm"),
        ]
        weights |= {"G": rng.normal(size=(24, 8 * 6 * 6)) * 0.05, "gb": rng.normal(size=24) * 0.1,
                    "M": rng.normal(size=(24, 10)) * 0.2}
        output = "y"
    graph = helper.make_graph(
        nodes, "conv_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 6, 6])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["n", 10] if head else ["n", 8, 6, 6])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    noise = rng.normal(size=(48, 8, 8, 8))
    smooth = (noise[:, :, :6, :6] + noise[:, :, 1:7, 1:7] + noise[:, :, 2:, 2:]
              + noise[:, :, 1:7, :6] + noise[:, :, :6, 1:7])
    onnx.save(model, folder / "m.onnx")
    np.savez(folder / "d.npz", x=smooth.astype(np.float32))
    return folder / "m.onnx", folder / "d.npz"


def _calibrate(folder: Path, model: Path, data: Path, name: str, *flags: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(model), "--data", str(data), "-o", str(folder / f"{name}.onnx"),
        "--report", str(folder / f"{name}.json"), "--no-fallback", "-q", *flags])
    assert result.exit_code == 0, result.output
    written = onnx.load(str(folder / f"{name}.onnx"))
    onnx.checker.check_model(written)
    report: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    return report


def _weight_codes(path: Path) -> dict[str, np.ndarray]:
    """Each layer's weight codes in the written model: the initializer its weight's
    DequantizeLinear reads, by layer name."""
    model = onnx.load(str(path))
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            dq = producers[node.input[1]]
            assert dq.op_type == "DequantizeLinear"
            codes[node.name] = initializers[dq.input[0]]
    return codes


def test_auto_takes_gptq_codes_for_matmul_gemm_and_nearest_for_conv(tmp_path: Path) -> None:
    model, data = _conv_mlp(tmp_path, np.random.default_rng(3), head=True)
    reports = {r: _calibrate(tmp_path, model, data, r, "--weight-rounding", r) for r in ROUNDINGS}
    codes = {r: _weight_codes(tmp_path / f"{r}.onnx") for r in ROUNDINGS}
    assert set(codes["auto"]) == {"conv1", "conv2", "fc", "mm"}
    for layer in ("conv1", "conv2", "fc", "mm"):  # GPTQ moves codes of every layer here
        assert not np.array_equal(codes["gptq"][layer], codes["nearest"][layer]), layer
    for layer in ("conv1", "conv2"):
        assert np.array_equal(codes["auto"][layer], codes["nearest"][layer]), layer
    for layer in ("fc", "mm"):
        assert np.array_equal(codes["auto"][layer], codes["gptq"][layer]), layer
    # The report: a rounding entry for the weights GPTQ chose, the same as gptq's for them.
    rounding = {r: {t["name"]: t.get("rounding") for t in reports[r]["tensors"]
                    if t["role"] == "weight"} for r in ROUNDINGS}
    assert rounding["auto"] == {"W1": None, "W2": None, "G": rounding["gptq"]["G"],
                                "M": rounding["gptq"]["M"]}
    assert all(rounding["gptq"][w] is not None for w in ("W1", "W2", "G", "M"))
    assert reports["auto"]["config"]["weight_rounding"] == "auto"


def test_auto_and_bias_correction_share_one_layer_input_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass measures the Gemm/MatMul Hessians and the Conv/Gemm bias sums; the Convs'
    Hessians are not measured."""
    model, data = _conv_mlp(tmp_path, np.random.default_rng(3), head=True)
    passes = _record_layer_input_passes(monkeypatch)
    report = _calibrate(tmp_path, model, data, "auto", "--weight-rounding", "auto")
    assert len(passes) == 1
    assert passes[0] == {"conv1": False, "conv2": False, "fc": True, "mm": True}
    assert sum(1 for stage in report["timings_seconds"] if stage == "layer inputs") == 1


def test_auto_on_a_conv_only_model_measures_no_hessian(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without MatMul/Gemm, auto is nearest: the same bytes; the layer-input pass measures the
    biases' sums alone (as with nearest), and without bias correction it does not run."""
    model, data = _conv_mlp(tmp_path, np.random.default_rng(4), head=False)
    passes = _record_layer_input_passes(monkeypatch)
    for rounding in ROUNDINGS:
        _calibrate(tmp_path, model, data, rounding, "--weight-rounding", rounding)
    assert passes == [{"conv1": False, "conv2": False}, {"conv1": True, "conv2": True},
                      {"conv1": False, "conv2": False}]  # nearest, gptq, auto
    model_bytes = {r: (tmp_path / f"{r}.onnx").read_bytes() for r in ROUNDINGS}
    assert model_bytes["auto"] == model_bytes["nearest"] != model_bytes["gptq"]

    passes.clear()
    plain = {r: _calibrate(tmp_path, model, data, f"{r}-plain", "--weight-rounding", r,
                           "--no-bias-correction") for r in ("auto", "gptq")}
    assert passes == [{"conv1": True, "conv2": True}]  # gptq's alone
    assert "layer inputs" not in plain["auto"]["timings_seconds"]
    assert "layer inputs" in plain["gptq"]["timings_seconds"]


def _record_layer_input_passes(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bool]]:
    """Each layer-input pass the pipeline runs, as {layer: whether its Hessian is measured}."""
    passes: list[dict[str, bool]] = []
    measure = pipeline.collect_hessians

    def recording(model: onnx.ModelProto, targets: list[HessianTarget], *args: Any,
                  **kwargs: Any) -> Any:
        passes.append({t.node: t.products for t in targets})
        return measure(model, targets, *args, **kwargs)

    monkeypatch.setattr(pipeline, "collect_hessians", recording)
    return passes
