"""An affine map of constants (a Mul by one scale, then an Add) that only a Conv reads folds into
that Conv (fold-input-affine): the prepared model computes the same values with fewer nodes; a
per-channel scale, a lone Mul, an Add another node reads or one that would widen its input
stay."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import prepare_model
from qcal.pipeline import calibrate

_RNG = np.random.default_rng(0)


def _model(*, pads: int = 0, group: int = 1, scale: np.ndarray | None = None,
           shift: np.ndarray | None = None, extra_reader: bool = False,
           in_channels: int = 8) -> onnx.ModelProto:
    """x [N, 4, 9, 9] -> Conv 1x1 (to `in_channels`) -> HardSwish -> [Mul scale] -> [Add shift]
    -> Conv 3x3 (6 filters, `group`, `pads`) -> y (and Relu of the Add -> z)."""
    inits: dict[str, np.ndarray] = {
        "w1": _RNG.standard_normal((in_channels, 4, 1, 1)).astype(np.float32),
        "w2": _RNG.standard_normal((6, 8 // group, 3, 3)).astype(np.float32),
        "b2": _RNG.standard_normal(6).astype(np.float32),
    }
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
             helper.make_node("HardSwish", ["c1"], ["h"], name="hardswish")]
    value = "h"
    if scale is not None:
        inits["s"] = scale.astype(np.float32)
        nodes.append(helper.make_node("Mul", ["s", value], ["scaled"], name="mul"))
        value = "scaled"
    if shift is not None:
        inits["b"] = shift.astype(np.float32)
        nodes.append(helper.make_node("Add", [value, "b"], ["shifted"], name="add"))
        value = "shifted"
    nodes.append(helper.make_node("Conv", [value, "w2", "b2"], ["y"], name="conv2",
                                  pads=[pads] * 4, group=group))
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Relu", [value], ["z"], name="relu"))
        outputs.append("z")
    return build_model(nodes, [float_input("x", ["N", 4, 9, 9])], outputs, inits, opset=14)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _same_outputs(model: onnx.ModelProto, prepared: onnx.ModelProto) -> None:
    onnx.checker.check_model(prepared)
    feed = {"x": np.random.default_rng(1).standard_normal((2, 4, 9, 9)).astype(np.float32)}
    for want, got in zip(run(model, feed), run(prepared, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


SCALAR, PER_CHANNEL = np.array([0.7]), np.linspace(-1.0, 1.0, 8).reshape(1, 8, 1, 1)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("shift", [SCALAR, PER_CHANNEL], ids=["one shift", "shift per channel"])
@pytest.mark.parametrize("pads", [0, 1], ids=["unpadded", "padded"])
def test_a_scale_and_shift_fold_into_the_conv_after_them(pads: int, shift: np.ndarray,
                                                         group: int) -> None:
    """Unpadded: both go (the shift into the bias). Padded: the scale goes into the weight and
    the Add stays, of shift / scale (the Conv pads the scaled value with zeros)."""
    model = _model(pads=pads, group=group, scale=np.array(-1.7), shift=shift)
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["Mul"] == 0
    assert _ops(prepared)["Add"] == pads
    assert any(s.name == "fold-input-affine" for s in steps)
    _same_outputs(model, prepared)
    if pads:
        (add,) = [n for n in prepared.graph.node if n.op_type == "Add"]
        (constant,) = [t for t in prepared.graph.initializer if t.name in add.input]
        np.testing.assert_allclose(onnx.numpy_helper.to_array(constant),
                                   (shift / -1.7).astype(np.float32), rtol=1e-6)


def test_a_shift_alone_folds_into_an_unpadded_conv() -> None:
    model = _model(shift=PER_CHANNEL)
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["Add"] == 0
    _same_outputs(model, prepared)


@pytest.mark.parametrize(("case", "kept"), [
    # a scale per channel would make the weight's input channels unequal: the Mul stays (the
    # shift after it still goes into the unpadded Conv's bias)
    ({"scale": PER_CHANNEL, "shift": SCALAR}, {"Mul": 1, "Add": 0}),
    ({"scale": PER_CHANNEL, "shift": SCALAR, "pads": 1}, {"Mul": 1, "Add": 1}),
    # a Mul alone (the 0.5 that ends a GELU written out) stays
    ({"scale": SCALAR}, {"Mul": 1}),
    # a shift before a padded Conv, with no scale to move it past
    ({"shift": SCALAR, "pads": 1}, {"Add": 1}),
    # another node reads the shifted value
    ({"scale": SCALAR, "shift": SCALAR, "extra_reader": True}, {"Mul": 1, "Add": 1}),
    # one channel widened to 8 by the shift per channel: the Conv alone would read one
    ({"shift": PER_CHANNEL, "in_channels": 1}, {"Add": 1}),
], ids=["scale per channel", "scale per channel, padded", "Mul alone", "shift, padded",
        "second reader", "widening shift"])
def test_what_does_not_fold_stays(case: dict[str, object], kept: dict[str, int]) -> None:
    model = _model(**case)  # type: ignore[arg-type]
    prepared, _ = prepare_model(model)
    for op_type, count in kept.items():
        assert _ops(prepared)[op_type] == count, _ops(prepared)
    _same_outputs(model, prepared)


def test_the_quantized_model_has_no_integer_affine_between_the_convs(tmp_path: Path) -> None:
    """Calibrated: the HardSwish output feeds the integer Conv directly, no Mul or Add of its
    own grid between them, and the model stays close to the float one."""
    model = _model(scale=np.array(0.5), shift=SCALAR)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    data = {"x": np.random.default_rng(2).standard_normal((16, 4, 9, 9)).astype(np.float32)}
    np.savez(tmp_path / "d.npz", **data)
    result = calibrate(path, CalibrationConfig(data=tmp_path / "d.npz", fallback=False,
                                               allow_slower=True), enforce_gates=False)
    quantized = result.model
    onnx.checker.check_model(quantized)
    assert _ops(quantized)["Mul"] == _ops(quantized)["Add"] == 0
    want, got = run(model, {"x": data["x"][:4]})[0], run(quantized, {"x": data["x"][:4]})[0]
    sqnr = 10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum())
    assert sqnr > 25, sqnr
    steps = [s["step"] for s in result.report["input_model"]["preparation"]]
    assert "fold-input-affine" in steps
