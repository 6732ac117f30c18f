"""`--equalize` with per-channel weights: the channel ranges of a depthwise Conv's input evened
out from the data. The float outputs stay the same on the calibration data, a Clip bound is
never crossed, and a model whose depthwise input channels differ widely in range (a folded
BatchNormalization's doing) quantizes far better."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import helper
from test_equalize import _calibrate

from qcal.calibration.channel_stats import collect_channel_extremes
from qcal.graph.passes.equalize_depthwise import (
    apply_depthwise_scales,
    depthwise_scales,
    find_depthwise_inputs,
)
from qcal.report import report_schema

CHANNELS = 8
BOUND = 6.0


def _model(seed: int, *, activation: str = "Clip", low: float = 0.0) -> onnx.ModelProto:
    """x -> Conv 3x3 -> activation -> depthwise Conv 3x3 -> pointwise Conv -> y. The first
    Conv's output channels span three orders of magnitude and the depthwise filters take the
    inverse (channel 0, the widest, reaches the Clip's bound of 6 on the data)."""
    rng = np.random.default_rng(seed)
    spread = np.geomspace(2.0, 0.002, CHANNELS)
    along = spread[:, None, None, None]
    inits = {
        "w0": (rng.normal(size=(CHANNELS, 3, 3, 3)) * along).astype(np.float32),
        "b0": (np.abs(rng.normal(size=CHANNELS)) * spread).astype(np.float32),
        "dw": (rng.normal(size=(CHANNELS, 1, 3, 3)) / along).astype(np.float32),
        "dwb": rng.normal(size=CHANNELS).astype(np.float32),
        "pw": rng.normal(size=(4, CHANNELS, 1, 1)).astype(np.float32),
        "lo": np.array(low, np.float32),
        "hi": np.array(BOUND, np.float32),
    }
    inputs = ["c0", "lo", "hi"] if activation == "Clip" else ["c0"]
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node(activation, inputs, ["a0"], name="act0"),
        helper.make_node("Conv", ["a0", "dw", "dwb"], ["c1"], name="depthwise",
                         pads=[1, 1, 1, 1], group=CHANNELS),
        helper.make_node("Conv", ["c1", "pw"], ["y"], name="pointwise"),
    ]
    return build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], inits)


def _images(seed: int, count: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, 3, 8, 8)).astype(np.float32)


def _equalize(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The library steps `--equalize` runs for one target; its scales."""
    (target,) = find_depthwise_inputs(model)
    extremes = collect_channel_extremes(model, target.values, [({"x": x}, len(x))])
    low = np.stack([extremes[v][0] for v in target.values])
    high = np.stack([extremes[v][1] for v in target.values])
    scale = depthwise_scales(target, low, high)
    apply_depthwise_scales({t.name: t for t in model.graph.initializer}, target, scale)
    return scale


@pytest.mark.parametrize("activation", ["Clip", "Relu", "PRelu-free"])
def test_the_float_outputs_stay_the_same_on_the_data(activation: str) -> None:
    model = _model(0, activation="Relu" if activation == "PRelu-free" else activation)
    if activation == "PRelu-free":  # no activation at all: the Conv feeds the depthwise one
        model.graph.node[2].input[0] = "c0"
        del model.graph.node[1]
    x = _images(1)
    (expected,) = run(model, {"x": x})
    scale = _equalize(model, x)
    onnx.checker.check_model(model)
    assert scale.max() > 50  # the narrowest channel was stretched
    (got,) = run(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_a_clip_bound_is_never_crossed_and_a_saturated_channel_keeps_its_scale() -> None:
    model = _model(2)
    x = _images(3)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    (target,) = find_depthwise_inputs(probe)
    before = collect_channel_extremes(probe, target.values, [({"x": x}, len(x))])
    scale = _equalize(model, x)
    clip_input_max = before["c0"][1].astype(np.float64)
    saturated = clip_input_max >= BOUND
    assert saturated[0] and np.all(scale[saturated] == 1.0)
    free = ~saturated
    assert np.all(scale[free] * clip_input_max[free] <= BOUND * (1 + 1e-6))
    after = collect_channel_extremes(model, ["a0"], [({"x": x}, len(x))])["a0"][1]
    # every channel under half the widest one's range (6, the bound channel 0 reaches) now
    # spans half of it, room left for twice the data's values; the others are left as they were
    clip_output_max = before["a0"][1]
    wide = clip_output_max >= BOUND / 2
    assert wide.sum() == 3 and np.all(scale[wide] == 1.0)
    np.testing.assert_allclose(after[wide], clip_output_max[wide])
    np.testing.assert_allclose(after[~wide], BOUND / 2, rtol=1e-5)


def test_targets_need_depthwise_readers_only_and_a_bound_around_zero() -> None:
    shared = _model(4)
    shared.graph.output.append(helper.make_tensor_value_info("a0", onnx.TensorProto.FLOAT, None))
    assert find_depthwise_inputs(shared) == []  # the activation is also an output
    offset = _model(5, low=0.5)  # Clip(0.5, 6) maps small values to 0.5, not homogeneous
    assert find_depthwise_inputs(offset) == []
    pointwise = _model(6)
    kept = [a for a in pointwise.graph.node[2].attribute if a.name != "group"]
    del pointwise.graph.node[2].attribute[:]
    pointwise.graph.node[2].attribute.extend(kept)
    tensors = {t.name: t for t in pointwise.graph.initializer}
    tensors["dw"].CopyFrom(onnx.numpy_helper.from_array(
        np.ones((CHANNELS, CHANNELS, 3, 3), np.float32), "dw"))
    assert find_depthwise_inputs(pointwise) == []  # a full Conv mixes the channels


def test_the_scales_are_the_same_whatever_the_data_order_or_split() -> None:
    x = _images(7)
    whole = _model(8)
    (target,) = find_depthwise_inputs(whole)
    one = collect_channel_extremes(whole, target.values, [({"x": x}, len(x))])
    batches = [({"x": x[::-1][i:i + 5]}, len(x[i:i + 5])) for i in range(0, len(x), 5)]
    split = collect_channel_extremes(whole, target.values, batches)
    for name in target.values:
        for a, b in zip(one[name], split[name], strict=True):
            assert np.array_equal(a, b)


# ---------------------------------------------------------------------- end to end


def test_equalize_lowers_the_error_of_a_depthwise_input(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(_model(9), path)
    np.savez(tmp_path / "calib.npz", x=_images(10, 48))
    plain = _calibrate(tmp_path, path, "plain")
    equalized = _calibrate(tmp_path, path, "equalized", "--equalize")
    onnx.checker.check_model(str(tmp_path / "equalized.onnx"))
    sqnr = lambda r: r["evaluation"]["outputs"][0]["sqnr_db"]
    assert sqnr(equalized) > sqnr(plain) + 10.0
    jsonschema.validate(equalized, report_schema())
    (entry,) = equalized["transforms"]["equalize"]["depthwise_inputs"]
    assert entry["first"] == "conv0" and entry["depthwise"] == ["depthwise"]
    assert entry["range_ratio_after"] < entry["range_ratio_before"] / 100
    assert {"step": "equalize-depthwise", "detail": "evened out 1 depthwise input"} in \
        equalized["input_model"]["preparation"]
    # Per-tensor weights would lose what the scales move into them: not done there.
    per_tensor = _calibrate(tmp_path, path, "per_tensor", "--equalize", "--per-tensor")
    assert "depthwise_inputs" not in per_tensor["transforms"]["equalize"]


def test_a_channel_without_finite_values_keeps_its_scale() -> None:
    (target,) = find_depthwise_inputs(_model(11))
    target = dataclasses.replace(target, channels=4)  # four channels of extremes for this check
    high = np.array([[5.0, 0.1, np.nan, 0.0], [5.0, 0.1, np.nan, 0.0]], np.float32)
    scale = depthwise_scales(target, np.zeros_like(high), high)
    # the NaN channel and the empty one are left alone, 0.1 goes to half of 5
    np.testing.assert_allclose(scale, [1.0, 5.0 / (2 * 0.1), 1.0, 1.0], rtol=1e-6)
