"""`--method auto`: the mse range, except on the model's output side, where the observed
extremes are kept (a clipped tail there clips the model's outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import helper

from qcal.cli import main
from qcal.graph.output_side import output_side_tensors
from qcal.numerics.histogram import HistogramObserver, select_range
from qcal.numerics.observers import PerTensor
from qcal.numerics.presets import build_preset
from qcal.numerics.ranges import HistogramSettings, choose_range

SETTINGS = HistogramSettings(percentile=99.99, bins=2048, quantized_bins=128)


def _heavy_tailed_observer() -> HistogramObserver:
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.standard_normal(200_000), [40.0, -35.0]]).astype(np.float32)
    observer = HistogramObserver(PerTensor())
    observer.update(values)
    return observer


def test_auto_is_mse_inside_and_the_extremes_on_the_output_side() -> None:
    recipe = build_preset("pytorch").activation
    observer = _heavy_tailed_observer()
    mse = select_range(observer.state(), "mse", recipe)
    inside = choose_range(observer, recipe, "auto", SETTINGS)
    outside = choose_range(observer, recipe, "auto", SETTINGS, output_side=True)
    # inside the model: exactly mse's range, which clips the two outliers here
    assert float(inside.stats.min) == float(mse.stats.min)
    assert float(inside.stats.max) == float(mse.stats.max)
    assert float(mse.stats.max) < 40.0 and inside.summary["chose"] == "mse"
    # on the output side: the exact extremes, nothing clipped
    assert (float(outside.stats.min), float(outside.stats.max)) == (-35.0, 40.0)
    assert outside.summary["chose"] == "minmax" and outside.summary["clipped_fraction"] == [0.0]
    assert "representable_max" not in outside.summary  # mse's grid is not this range's
    # both candidates' errors are reported, and mse's is the smaller
    assert inside.summary["mse"][0] < inside.summary["mse_minmax"][0]


def test_output_side_stops_at_the_layers_that_mix_values() -> None:
    rng = np.random.default_rng(0)
    inits = {"w1": rng.normal(size=(4, 4)).astype(np.float32),
             "w2": rng.normal(size=(4, 3)).astype(np.float32),
             "b": np.ones(3, np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
        helper.make_node("Add", ["z", "b"], ["logits"], name="add"),
        helper.make_node("Sigmoid", ["logits"], ["p"], name="sig"),
    ]
    model = build_model(nodes, [float_input("x", [1, 4])], ["p", "r"], inits)
    side = output_side_tensors(model.graph)
    # p <- logits <- z (MatMul output, included) and b; r is an output itself, h behind Relu
    assert {"p", "logits", "z", "b", "r", "h"} <= side
    assert "x" not in side and "w2" not in side  # behind a MatMul


def _two_heads(tmp_path: Path) -> Path:
    """x -> MatMul -> Relu -> r (an output, and the input of a second MatMul -> y)."""
    rng = np.random.default_rng(1)
    inits = {"w1": rng.normal(size=(8, 8)).astype(np.float32),
             "w2": rng.normal(size=(8, 4)).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    model = build_model(nodes, [float_input("x", [1, 8])], ["y", "r"], inits)
    path = tmp_path / "two_heads.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("preset", ["pytorch", "tensorflow"])
def test_auto_keeps_the_extremes_of_tensors_the_outputs_read(tmp_path: Path, preset: str) -> None:
    model_path = _two_heads(tmp_path)
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(model_path), "--synthetic", "64", "--method", "auto", "--preset",
        preset, "-o", str(tmp_path / "q.onnx"), "--report", str(tmp_path / "r.json"), "-q",
        "--no-fallback"])  # ranges are what is checked, not a random network's accuracy
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    report = json.loads((tmp_path / "r.json").read_text())
    chose = {t["name"]: t["range"]["chose"] for t in report["tensors"] if t["method"] == "auto"}
    assert chose["x"] == "mse"  # behind the first MatMul
    assert chose["r"] == "minmax"  # read by the output r itself
    entry = next(t for t in report["tensors"] if t["name"] == "r")
    assert entry["range"]["max"] == entry["range"]["histogram"]["max"]
