"""qdq_round_trip is what onnxruntime's QuantizeLinear -> DequantizeLinear computes, ties and
saturation included."""

from __future__ import annotations

import numpy as np
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import helper

from qcal.numerics.onnx_mapping import qdq_round_trip


@pytest.mark.parametrize(("scale", "zero_point", "dtype"),
                         [(0.05, 128, np.uint8), (0.013, 0, np.uint8), (0.5, -3, np.int8)])
def test_the_round_trip_is_onnxruntime_s(scale: float, zero_point: int, dtype: type) -> None:
    codes = np.iinfo(dtype)
    inits = {"s": np.array(scale, np.float32), "z": np.array(zero_point, dtype)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = build_model(nodes, [float_input("x", [4096])], ["y"], inits)
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 300 * scale
    x[:64] = (np.arange(64, dtype=np.float32) - 32 + 0.5) * np.float32(scale)  # exact ties
    (want,) = run(model, {"x": x})
    np.testing.assert_array_equal(
        qdq_round_trip(x, scale, zero_point, int(codes.min), int(codes.max)), want)
