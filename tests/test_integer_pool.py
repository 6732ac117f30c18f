"""An AveragePool between quantized layers is written as a depthwise Conv of weight 1 / k (times
a constant map of k / taps inside where it does not count its padding): onnxruntime's
QLinearAveragePool is a plain loop many times its float kernel, its integer depthwise Conv is
not. With ceil_mode, a divisor map beyond the codes, or where the placement emulates a
target, it stays an AveragePool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input, optimized_ops
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.pipeline import calibrate

CONVERTED: list[dict[str, Any]] = [
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"},
]
# Padding not counted: the divisor is the taps inside (Keras's and Paddle's "same" pools).
UNCOUNTED: list[dict[str, Any]] = [
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [5, 5], "strides": [1, 1], "pads": [2, 1, 2, 1]},  # ratios of 25 / 9
]
KEPT: list[dict[str, Any]] = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1,
     "ceil_mode": 1},
    # a corner of one tap in 256: a divisor ratio over the largest code
    {"kernel_shape": [16, 16], "strides": [1, 1], "pads": [15, 15, 15, 15]},
]


def _pool_block(attributes: dict[str, Any]) -> onnx.ModelProto:
    """conv -> relu -> AveragePool -> conv -> relu -> 1x1 head."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("AveragePool", ["r1"], ["p"], name="pool", **attributes),
        helper.make_node("Conv", ["p", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["y"], name="head"),
    ]
    inits: dict[str, np.ndarray] = {}
    for name, shape in {"w1": (16, 8, 3, 3), "w2": (8, 16, 3, 3), "w3": (4, 8, 1, 1)}.items():
        inits[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        inits["b" + name[1:]] = (rng.standard_normal(shape[0]) * 0.1).astype(np.float32)
    return build_model(nodes, [float_input("x", ["N", 8, 13, 13])], ["y"], inits, opset=13)


def _quantize(model: onnx.ModelProto, tmp_path: Path, **options: Any
              ) -> tuple[onnx.ModelProto, np.ndarray]:
    onnx.save(model, tmp_path / "m.onnx")
    x = np.random.default_rng(6).standard_normal((16, 8, 13, 13)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    config = CalibrationConfig(data=tmp_path / "calib.npz", fallback=False, **options)
    return calibrate(tmp_path / "m.onnx", config, enforce_gates=False).model, x


def _run(model: onnx.ModelProto, x: np.ndarray, *, optimized: bool = True) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimized:  # the graph as written, each node in float: the QDQ model's definition
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _sqnr(got: np.ndarray, want: np.ndarray) -> float:
    noise = float(np.sum((got.astype(np.float64) - want) ** 2))
    return np.inf if noise == 0 else float(10 * np.log10(np.sum(want.astype(np.float64) ** 2)
                                                         / noise))


@pytest.mark.parametrize("attributes", CONVERTED + UNCOUNTED)
def test_an_average_pool_runs_as_an_integer_depthwise_conv(
    tmp_path: Path, attributes: dict[str, Any]
) -> None:
    model = _pool_block(attributes)
    quantized, x = _quantize(model, tmp_path)
    onnx.checker.check_model(quantized, full_check=True)
    assert not [n for n in quantized.graph.node if n.op_type == "AveragePool"]
    pool = next(n for n in quantized.graph.node if n.name == "pool")
    assert pool.op_type == "Conv"
    assert next(a.i for a in pool.attribute if a.name == "group") == 16
    ops = optimized_ops(quantized, tmp_path)
    assert "QLinearAveragePool" not in ops and ops["QLinearConv"] == 4, ops  # with the head
    if attributes in UNCOUNTED:  # and the map of divisors, an integer Mul
        assert ops["QLinearMul"] == 1 and "Mul" not in ops, ops
    # The form computes what the pool does: the same written model with an AveragePool in
    # place of the form's nodes (those named after the pool), both run node by node in float.
    form_nodes = [n for n in quantized.graph.node if n.name.startswith("pool_")]
    mul = next((n for n in form_nodes if n.op_type == "Mul"), pool)
    average = helper.make_node("AveragePool", [pool.input[0]], [mul.output[0]], name="pool",
                               **attributes)
    pooled = onnx.ModelProto()
    pooled.CopyFrom(quantized)
    del pooled.graph.node[:]
    pooled.graph.node.extend(average if n.name == "pool" else n for n in quantized.graph.node
                             if n not in form_nodes)
    form, reference = _run(quantized, x, optimized=False), _run(pooled, x, optimized=False)
    # a code at most apart where the rounding falls differently; one rounding more on the
    # border positions of a pool that does not count its padding
    assert _sqnr(form, reference) > (30 if attributes in UNCOUNTED else 45)
    assert _sqnr(_run(quantized, x), _run(model, x)) > 25


@pytest.mark.parametrize("attributes", KEPT)
def test_an_average_pool_the_form_does_not_fit_stays_a_pool(
    tmp_path: Path, attributes: dict[str, Any]
) -> None:
    quantized, _ = _quantize(_pool_block(attributes), tmp_path)
    pool = next(n for n in quantized.graph.node if n.name == "pool")
    assert pool.op_type == "AveragePool"
    assert optimized_ops(quantized, tmp_path)["QLinearAveragePool"] == 1


def test_placement_all_keeps_the_average_pool(tmp_path: Path) -> None:
    """Emulating a target's arithmetic: the pool stays the operator the target runs."""
    quantized, _ = _quantize(_pool_block(CONVERTED[0]), tmp_path, placement="all")
    assert next(n for n in quantized.graph.node if n.name == "pool").op_type == "AveragePool"
