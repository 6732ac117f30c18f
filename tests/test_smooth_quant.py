"""SmoothQuant (`--smooth-quant`): the scales follow the formula, the float model keeps its
outputs, the row sample ignores data order and batching, and a model with outlier activation
channels quantizes better."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from click.testing import CliRunner
from onnx import helper

from qcal.calibration.channel_stats import ROWS, ChannelStats
from qcal.cli import main
from qcal.config import CalibrationConfig
from qcal.graph.passes.smooth_quant import apply_smoothing, find_smooth_targets
from qcal.numerics.errors import ConfigError
from qcal.numerics.smoothing import smoothing_scales
from qcal.report import report_schema

K = 16


def _outlier_model(seed: int) -> onnx.ModelProto:
    """x -> LayerNormalization (gamma 40x on two channels) -> MatMul W1 -> Relu
    -> (h * gamma2 + beta2, a decomposed affine with a 30x channel) -> MatMul W2 and Gemm W3
    (transB) -> outputs: the outliers LLM activations have, in both foldable forms."""
    rng = np.random.default_rng(seed)
    gamma = np.ones(K, np.float32)
    gamma[[3, 11]] = 40.0
    gamma2 = np.ones(2 * K, np.float32)
    gamma2[5] = 30.0
    inits = {
        "gamma": gamma, "beta": rng.normal(size=K).astype(np.float32),
        "w1": rng.normal(size=(K, 2 * K)).astype(np.float32) / 4,
        "gamma2": gamma2, "beta2": rng.normal(size=2 * K).astype(np.float32),
        "w2": rng.normal(size=(2 * K, 8)).astype(np.float32) / 4,
        "w3": rng.normal(size=(6, 2 * K)).astype(np.float32) / 4,
    }
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["ln", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "gamma2"], ["scaled"], name="affine_mul"),
        helper.make_node("Add", ["scaled", "beta2"], ["shifted"], name="affine_add"),
        helper.make_node("MatMul", ["shifted", "w2"], ["y"], name="fc2"),
        helper.make_node("Gemm", ["shifted", "w3"], ["z"], name="fc3", transB=1),
    ]
    return build_model(nodes, [float_input("x", ["N", K])], ["y", "z"], inits, opset=17)


def _rows(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, K)).astype(np.float32)


def test_scales_follow_the_formula() -> None:
    x = np.array([8.0, 0.5, 0.0, 3.0])
    w = np.array([0.5, 2.0, 1.0, 0.0])
    got = smoothing_scales(x, w, 0.7)
    assert got[0] == pytest.approx(8.0**0.7 / 0.5**0.3, rel=1e-12)
    assert got[1] == pytest.approx(0.5**0.7 / 2.0**0.3, rel=1e-12)
    assert list(got[2:]) == [1.0, 1.0]  # a channel without range in either keeps its scale


def test_targets_and_float_equivalence() -> None:
    model = _outlier_model(0)
    x = _rows(1, 64)
    expected = run(model, {"x": x})
    targets = find_smooth_targets(model)
    assert [(t.activation, t.layers, t.divided) for t in targets] == [
        ("ln", ("fc1",), ("gamma", "beta")),
        ("shifted", ("fc2", "fc3"), ("beta2", "gamma2")),
    ]
    rng = np.random.default_rng(2)
    for target in targets:
        apply_smoothing(model, target, rng.uniform(0.05, 20.0, target.channels))
    onnx.checker.check_model(model)
    for got, want in zip(run(model, {"x": x}), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_activations_that_cannot_absorb_the_division_are_no_targets() -> None:
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="fc"),
             helper.make_node("MatMul", ["x", "w2"], ["z"], name="direct")]
    model = build_model(nodes, [float_input("x", ["N", K])], ["y", "z"],
                        {"w": rng.normal(size=(K, 4)).astype(np.float32),
                         "w2": rng.normal(size=(K, 4)).astype(np.float32)})
    assert find_smooth_targets(model) == []  # a Relu output, a graph input


def test_row_sample_ignores_order_and_batching() -> None:
    rows = _rows(4, 3 * ROWS)
    whole, pieces = ChannelStats(K), ChannelStats(K)
    whole.update(rows)
    for chunk in np.array_split(rows[::-1], 7):
        pieces.update(chunk.reshape(-1, 1, K))  # any leading shape: rows of the last axis
    assert whole.rows.shape == (ROWS, K)
    np.testing.assert_array_equal(whole.rows, pieces.rows)
    np.testing.assert_array_equal(whole.min, rows.min(axis=0))
    np.testing.assert_array_equal(pieces.max, rows.max(axis=0))
    kept = {r.tobytes() for r in whole.rows}
    assert kept <= {r.tobytes() for r in rows} and len(kept) == ROWS


@pytest.mark.parametrize("value", [1.5, -0.1, "often", True])
def test_alpha_is_checked(value: object) -> None:
    with pytest.raises(ConfigError, match="smooth-quant"):
        CalibrationConfig(smooth_quant=value)  # type: ignore[arg-type]
    assert CalibrationConfig(smooth_quant="0.5").smooth_quant == 0.5


# ---------------------------------------------------------------------- end to end


@pytest.fixture()
def outliers(tmp_path: Path) -> Path:
    path = tmp_path / "outliers.onnx"
    onnx.save(_outlier_model(5), path)
    # More rows than the sample keeps: the order test below sees the bottom-k choice at work.
    np.savez(tmp_path / "calib.npz", x=_rows(6, ROWS + 200))
    np.savez(tmp_path / "reversed.npz", x=_rows(6, ROWS + 200)[::-1])
    return path


def _calibrate(tmp: Path, model: Path, name: str, *args: str, data: str = "calib.npz") -> dict:
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(model), "--data", str(tmp / data), "--eval-data", str(tmp / "calib.npz"),
        "-o", str(tmp / f"{name}.onnx"), "--report", str(tmp / f"{name}.json"), "--no-fallback",
        "-q", *args])
    assert result.exit_code == 0, result.output
    return json.loads((tmp / f"{name}.json").read_text())


def test_smooth_quant_lowers_the_error_of_outlier_channels(tmp_path: Path, outliers: Path) -> None:
    plain = _calibrate(tmp_path, outliers, "plain")
    smooth = _calibrate(tmp_path, outliers, "smooth", "--smooth-quant", "auto")
    onnx.checker.check_model(str(tmp_path / "smooth.onnx"))
    sqnr = lambda r: min(o["sqnr_db"] for o in r["evaluation"]["outputs"])
    assert sqnr(smooth) > sqnr(plain) + 3.0
    layers = smooth["transforms"]["smooth_quant"]["layers"]
    assert [entry["activation"] for entry in layers] == ["ln", "shifted"]
    for entry in layers:
        assert entry["alpha"] in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) and entry["max_scale"] > 1
        assert entry["output_error_after"] < entry["output_error_before"]
    assert smooth["config"]["smooth_quant"] == "auto"
    jsonschema.validate(smooth, report_schema())
    assert "transforms" not in plain and "smooth_quant" not in plain["config"]
    fixed = _calibrate(tmp_path, outliers, "fixed", "--smooth-quant", "0.5")
    assert {e["alpha"] for e in fixed["transforms"]["smooth_quant"]["layers"]} == {0.5}


def test_smooth_quant_ignores_data_order_and_batching(tmp_path: Path, outliers: Path) -> None:
    first = _calibrate(tmp_path, outliers, "a", "--smooth-quant", "auto")
    second = _calibrate(tmp_path, outliers, "b", "--smooth-quant", "auto", "--batch-size", "5",
                        data="reversed.npz")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert first["transforms"] == second["transforms"]
