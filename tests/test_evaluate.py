"""Metrics against independent computation on hand-made models."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal.accuracy.evaluate import compare_models


def _scale_model(factor: float) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="mul")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
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


def test_sign_flip_breaks_agreement() -> None:
    data = [np.arange(10, dtype=np.float32).reshape(2, 5)]
    out = compare_models(_scale_model(1.0), _scale_model(-1.0), (({"x": d}, 2) for d in data)).outputs[0]
    assert out.top1_agreement == 0.0 and out.cosine == pytest.approx(-1.0)
