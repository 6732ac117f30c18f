"""Cross-layer equalization (`--equalize`): the float model keeps its outputs, each pair's channel
ranges meet, pairs that cannot be equalized exactly are left alone, and per-tensor weights
quantize better on a model whose depthwise channels differ widely in range."""

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

from qcal.cli import main
from qcal.graph.passes.equalize import EqualizeLayers
from qcal.report import report_schema

CHANNELS = 8


def _dwsep_model(seed: int, *, activation: str = "Relu", tail: bool = True) -> onnx.ModelProto:
    """x -> Conv 3x3 -> act -> depthwise Conv 3x3 -> act -> pointwise Conv 1x1 [-> act -> Conv]:
    the depthwise filters' ranges span three orders of magnitude, the pointwise weights take the
    inverse, as a trained network with an unlucky BatchNormalization fold would have."""
    rng = np.random.default_rng(seed)
    spread = np.geomspace(0.02, 20.0, CHANNELS)[rng.permutation(CHANNELS)]
    inits = {
        "w0": rng.normal(size=(CHANNELS, 3, 3, 3)).astype(np.float32),
        "b0": rng.normal(size=CHANNELS).astype(np.float32),
        "dw": (rng.normal(size=(CHANNELS, 1, 3, 3)) * spread[:, None, None, None]).astype(np.float32),
        "dwb": (rng.normal(size=CHANNELS) * spread).astype(np.float32),
        "pw": (rng.normal(size=(CHANNELS, CHANNELS, 1, 1)) / spread[None, :, None, None]).astype(np.float32),
        "pwb": rng.normal(size=CHANNELS).astype(np.float32),
        "w3": rng.normal(size=(4, CHANNELS, 3, 3)).astype(np.float32),
    }
    extra = {}
    if activation == "PRelu":
        extra = {"slope": np.array([0.1], np.float32)}

    def act(name: str, source: str) -> onnx.NodeProto:
        inputs = [source, "slope"] if activation == "PRelu" else [source]
        attrs = {"alpha": 0.1} if activation == "LeakyRelu" else {}
        if activation == "Clip":
            extra.update({"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)})
            inputs = [source, "lo", "hi"]
        return helper.make_node(activation, inputs, [f"{name}_out"], name=name, **attrs)

    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        act("act0", "c0"),
        helper.make_node("Conv", ["act0_out", "dw", "dwb"], ["c1"], name="depthwise",
                         pads=[1, 1, 1, 1], group=CHANNELS),
        act("act1", "c1"),
        helper.make_node("Conv", ["act1_out", "pw", "pwb"], ["y" if not tail else "c2"],
                         name="pointwise"),
    ]
    if tail:
        nodes += [act("act2", "c2"),
                  helper.make_node("Conv", ["act2_out", "w3"], ["y"], name="conv3")]
    return build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["y"], {**inits, **extra})


def _images(seed: int, count: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, 3, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("activation", ["Relu", "LeakyRelu", "PRelu"])
def test_equalized_model_keeps_its_float_outputs(activation: str) -> None:
    model = _dwsep_model(0, activation=activation)
    x = _images(1)
    (expected,) = run(model, {"x": x})
    original = onnx.ModelProto()
    original.CopyFrom(model)
    rewrite = EqualizeLayers()
    result = rewrite(model)
    onnx.checker.check_model(result.model)
    assert result.modified and [(p.first, p.second) for p in rewrite.pairs] == [
        ("conv0", "depthwise"), ("depthwise", "pointwise"), ("pointwise", "conv3")]
    (got,) = run(result.model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    assert any(not np.array_equal(a, b) for a, b in _weights(original, result.model))


def test_each_pair_ends_with_matching_channel_ranges() -> None:
    """After the sweeps converge, output channel i of each pair's first weight and input channel
    i of its second have the same largest magnitude (what s_i = sqrt(r1_i r2_i) / r2_i gives
    one pair; a chain needs the repeated sweeps for every pair to hold at once)."""
    model = _dwsep_model(2)
    EqualizeLayers()(model)
    w = {t.name: np.abs(onnx.numpy_helper.to_array(t).astype(np.float64))
         for t in model.graph.initializer}
    outputs = lambda name: w[name].reshape(w[name].shape[0], -1).max(axis=1)
    pairs = [
        (outputs("w0"), w["dw"].reshape(CHANNELS, -1).max(axis=1)),  # depthwise: channel i alone
        (outputs("dw"), w["pw"].max(axis=(0, 2, 3))),
        (outputs("pw"), w["w3"].max(axis=(0, 2, 3))),
    ]
    for first, second in pairs:
        np.testing.assert_allclose(first, second, rtol=1e-3)


def test_clip_and_shared_values_are_left_alone() -> None:
    clipped = _dwsep_model(3, activation="Clip")
    original = clipped.SerializeToString()
    rewrite = EqualizeLayers()
    assert not rewrite(clipped).modified and clipped.SerializeToString() == original
    # The depthwise output read twice (also a graph output): that pair cannot change.
    model = _dwsep_model(4, tail=False)
    model.graph.output.append(helper.make_tensor_value_info("act1_out", onnx.TensorProto.FLOAT, None))
    rewrite(model)
    assert [(p.first, p.second) for p in rewrite.pairs] == [("conv0", "depthwise")]


def _weights(a: onnx.ModelProto, b: onnx.ModelProto) -> list[tuple[np.ndarray, np.ndarray]]:
    first = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer}
    return [(first[t.name], onnx.numpy_helper.to_array(t)) for t in b.graph.initializer]


# ---------------------------------------------------------------------- end to end


def _calibrate(tmp: Path, model: Path, name: str, *args: str) -> dict:
    result = CliRunner().invoke(main, [
        "calibrate", str(model), "--data", str(tmp / "calib.npz"), "-o", str(tmp / f"{name}.onnx"),
        "--report", str(tmp / f"{name}.json"), "--no-fallback", "-q", *args])
    assert result.exit_code == 0, result.output
    return json.loads((tmp / f"{name}.json").read_text())


@pytest.fixture()
def dwsep(tmp_path: Path) -> Path:
    path = tmp_path / "dwsep.onnx"
    onnx.save(_dwsep_model(5), path)
    np.savez(tmp_path / "calib.npz", x=_images(6, 48))
    return path


def test_equalize_lowers_the_error_of_per_tensor_weights(tmp_path: Path, dwsep: Path) -> None:
    plain = _calibrate(tmp_path, dwsep, "plain", "--per-tensor")
    equalized = _calibrate(tmp_path, dwsep, "equalized", "--per-tensor", "--equalize")
    onnx.checker.check_model(str(tmp_path / "equalized.onnx"))
    sqnr = lambda r: r["evaluation"]["outputs"][0]["sqnr_db"]
    assert sqnr(equalized) > sqnr(plain) + 6.0
    pairs = equalized["transforms"]["equalize"]["pairs"]
    assert len(pairs) == 3 and all(p["range_ratio_after"] <= p["range_ratio_before"] for p in pairs)
    assert equalized["config"]["equalize"] is True
    jsonschema.validate(equalized, report_schema())
    assert {"step": "equalize", "detail": "equalized 3 Conv pairs"} in \
        equalized["input_model"]["preparation"]
    # Without the option the report says nothing of it.
    assert "transforms" not in plain and "equalize" not in plain["config"]


def test_equalize_is_deterministic(tmp_path: Path, dwsep: Path) -> None:
    first = _calibrate(tmp_path, dwsep, "a", "--equalize")
    second = _calibrate(tmp_path, dwsep, "b", "--equalize")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert first["transforms"] == second["transforms"]


def test_transforms_refuse_statistics_collected_beforehand(tmp_path: Path, dwsep: Path) -> None:
    result = CliRunner().invoke(main, [
        "calibrate", str(dwsep), "--data", str(tmp_path / "calib.npz"), "--equalize",
        "--checkpoint", str(tmp_path / "stats.npz"), "-o", str(tmp_path / "q.onnx"), "-q"])
    assert result.exit_code == 3 and "--equalize" in result.output
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "stats.npz").exists()


@pytest.mark.parametrize(("granularity", "line"), [
    ("--per-tensor", "equalize: 3 Conv pairs, largest channel range ratio"),
    # per-channel weights: the activations are evened out instead, where a depthwise Conv
    # reads them (tests/test_equalize_depthwise.py); this one's are within 2x of each other
    ("--per-channel", "equalize: 0 depthwise inputs, largest channel range ratio 1 -> 1"),
])
def test_summary_has_one_line_per_transform(tmp_path: Path, dwsep: Path, granularity: str,
                                            line: str) -> None:
    result = CliRunner().invoke(main, [
        "calibrate", str(dwsep), "--data", str(tmp_path / "calib.npz"), "--equalize",
        "--smooth-quant", "auto", "-o", str(tmp_path / "q.onnx"), "--report",
        str(tmp_path / "q.json"), "--no-fallback", granularity])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert sum(shown.startswith(line) for shown in lines) == 1
    # A Conv-only model has no MatMul/Gemm input to smooth: the run says so.
    assert "smooth-quant: 0 of 0 activations smoothed, summed layer output error 0 -> 0" in lines


def test_dead_channels_keep_their_scale() -> None:
    """A depthwise channel whose filter is all but zero is not balanced: a vanishing s would
    divide its bias into a huge constant activation."""
    model = _dwsep_model(7)
    tensors = {t.name: t for t in model.graph.initializer}
    dw = onnx.numpy_helper.to_array(tensors["dw"]).copy()
    dw[2] *= 1e-30
    tensors["dw"].CopyFrom(onnx.numpy_helper.from_array(dw, "dw"))
    bias = onnx.numpy_helper.to_array(tensors["dwb"]).copy()
    x = _images(8)
    (expected,) = run(model, {"x": x})
    rewrite = EqualizeLayers()
    rewrite(model)
    after = onnx.numpy_helper.to_array(tensors["dwb"])
    assert after[2] == bias[2] and not np.array_equal(after, bias)
    assert all(p.range_ratio_before < 1e6 for p in rewrite.pairs)  # dead channels aside
    (got,) = run(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
