"""Schemes and compute_qparams: rounding, refusals, and parameter validity over random ranges."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.observers import MinMaxStats
from qcal.numerics.presets import PRESETS, build_preset
from qcal.numerics.schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    QParams,
    Rounding,
    Scheme,
    TFScheme,
    TorchScheme,
    compute_qparams,
    round_float32,
)

f32 = np.float32


def test_rounding_examples_from_the_contract() -> None:
    r = round_float32
    assert r(f32(0.49999997), Rounding.HALF_UP) == 1  # the +0.5 rounds to 1.0 in float32
    assert r(f32(-2.5), Rounding.HALF_UP) == -2
    assert r(f32(2.5), Rounding.HALF_TO_EVEN) == 2 and r(f32(-2.5), Rounding.HALF_TO_EVEN) == -2
    assert r(f32(3.5), Rounding.HALF_TO_EVEN) == 4
    assert r(f32(-2.5), Rounding.HALF_AWAY) == -3 and r(f32(2.5), Rounding.HALF_AWAY) == 3
    assert r(f32(0.49999997), Rounding.HALF_AWAY) == 0


@settings(max_examples=200, deadline=None)
@given(t=st.floats(-1e7, 1e7, width=32) | st.integers(-1000, 1000).map(lambda k: k + 0.5))
def test_exact_roundings_match_rational_arithmetic(t: float) -> None:
    """Half-to-even and half-away-from-zero are exact roundings of the float32 value; half-up
    is floor of the float32-rounded t + 0.5 (so odd integers above 2**23 move up by one)."""
    exact = Fraction(float(f32(t)))
    assert round_float32(f32(t), Rounding.HALF_TO_EVEN) == round(exact)
    away = math.floor(abs(exact) + Fraction(1, 2)) * (1 if exact >= 0 else -1)
    assert round_float32(f32(t), Rounding.HALF_AWAY) == away
    sum_f32 = f32(float(exact + Fraction(1, 2)))  # exact in double, then one float32 rounding
    assert round_float32(f32(t), Rounding.HALF_UP) == math.floor(sum_f32)


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    "build, fragment",
    [
        (
            lambda: TorchScheme.from_api(
                dtype="quint8", qscheme="per_tensor_symmetric", reduce_range=True
            ),
            "reduce_range",
        ),
        (
            lambda: TorchScheme.from_api(
                dtype="quint8", qscheme="per_channel_symmetric", reduce_range=True
            ),
            "reduce_range",
        ),
        (lambda: TorchScheme.from_api(quant_min=1, quant_max=10), "include 0"),
        (lambda: TorchScheme.from_api(dtype="qint8", quant_min=-200, quant_max=100), "256"),
        (lambda: TorchScheme.from_api(quant_min=0), "together"),
        (lambda: TorchScheme.from_api(dtype="float16"), "dtype"),
        (lambda: HorizonScheme.from_api(dtype="qint4", quant_min=-16, quant_max=7), "inside"),
        (lambda: TFScheme(num_bits=62, signed_input=True), "num_bits"),
        (lambda: TFScheme(rounding=Rounding.HALF_AWAY), "round_mode"),
        (lambda: OneFlowScheme("google", 9), "quantization_bit"),
        (lambda: OneFlowScheme("cambricon", 8, symmetric=False), "cambricon"),
        (lambda: MindSporeScheme(num_bits=5), "4, 7 or 8"),
        (lambda: LearnedScaleScheme(neg_trunc=True, narrow_range=True), "narrow_range"),
    ],
)
def test_invalid_combinations_are_refused(build: Callable[[], Scheme], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build()


def test_torch_ranges_resolve_like_pytorch() -> None:
    assert (TorchScheme.from_api(dtype="qint8", reduce_range=True).quant_min, 63) == (-64, 63)
    custom = TorchScheme.from_api(dtype="qint8", quant_min=-8, quant_max=7, reduce_range=True)
    assert (custom.quant_min, custom.quant_max) == (-4, 3)  # floor division of both limits
    midpoint = TorchScheme.from_api(
        dtype="quint8", qscheme="per_tensor_symmetric", quant_min=0, quant_max=101
    )
    assert midpoint.symmetric_zero_point == 50
    assert (
        TorchScheme.from_api(dtype="quint8", qscheme="per_tensor_symmetric").symmetric_zero_point
        == 128
    )
    qint32 = TorchScheme.from_api(dtype="qint32", reduce_range=True)
    assert (qint32.quant_min, qint32.quant_max) == (-(2**31), 2**31 - 1)


def test_min_above_max_is_rejected() -> None:
    with pytest.raises(DataError, match="min > max"):
        compute_qparams(MinMaxStats(f32(2), f32(1)), TorchScheme.from_api())


def test_compute_qparams_is_pure() -> None:
    stats = MinMaxStats(
        np.array([-1.5, 0.25], dtype=np.float32), np.array([2.0, 0.5], dtype=np.float32), 0
    )
    before = (stats.min.copy(), stats.max.copy())
    for scheme in (
        TorchScheme.from_api(),
        MindSporeScheme(),
        TFScheme(),
        OneFlowScheme(symmetric=False),
    ):
        a, b = compute_qparams(stats, scheme), compute_qparams(stats, scheme)
        np.testing.assert_array_equal(a.scale, b.scale)
        np.testing.assert_array_equal(a.zero_point, b.zero_point)
        assert a.axis == 0
    np.testing.assert_array_equal(stats.min, before[0])
    np.testing.assert_array_equal(stats.max, before[1])


def test_power_of_two_scale() -> None:
    qparams = compute_qparams(MinMaxStats(f32(-3.0), f32(5.0)), OneFlowScheme("cambricon", 8))
    assert qparams.extras["shift"] == math.floor(math.log2(5.0)) - 6
    assert qparams.scale == 2.0 ** (math.floor(math.log2(5.0)) - 6)


def test_tf_range_adjustment_keeps_zero_exact() -> None:
    qparams = compute_qparams(MinMaxStats(f32(-1.0), f32(2.5)), TFScheme())
    step, low, high = qparams.scale, qparams.extras["adjusted_min"], qparams.extras["adjusted_max"]
    assert high == 2.5 and step == f32(
        f32(2.5) / f32(127)
    )  # the max side needs the smaller multiplier
    assert low == f32(-128) * step and qparams.zero_point == 0


# ---------------------------------------------------------------------------------------------
# validity of parameters over random ranges, for every preset


_KNOB_VARIANTS: dict[str, list[dict[str, object]]] = {
    "pytorch": [{}, {"reduce_range": True}, {"dtype": "qint8", "quant_min": -8, "quant_max": 7}],
    "pytorch-symmetric": [{}, {"dtype": "quint8"}, {"quant_min": -127, "quant_max": 127}],
    "oneflow-google": [{}, {"quantization_scheme": "affine"}, {"quantization_bit": 2}],
    "oneflow-cambricon": [{}, {"quantization_bit": 4}],
    "mindspore": [{}, {"symmetric": True, "narrow_range": True}, {"quant_dtype": "INT4"}],
    "tensorflow": [{}, {"signed_input": False}, {"narrow_range": True, "num_bits": 4}],
    "horizon": [{}, {"dtype": "quint4"}, {"dtype": "qint16"}],
    "horizon-rne": [{}],
}
_LEARNED = [{"mode": "LEARNED_SCALE", "symmetric": True, "narrow_range": True}]
_LEARNED.append({"mode": "LEARNED_SCALE", "symmetric": True, "neg_trunc": True})
_CASES = [(name, knobs) for name, variants in _KNOB_VARIANTS.items() for knobs in variants]
_CASES += [("mindspore", knobs) for knobs in _LEARNED]


def test_every_preset_has_validity_cases() -> None:
    assert set(_KNOB_VARIANTS) == set(PRESETS)


def _documented_degenerate(scheme: Scheme, lo: float, hi: float) -> bool:
    """Ranges for which the API itself produces a zero, negative or non-finite step (§6, §7)."""
    if isinstance(scheme, (TorchScheme, HorizonScheme)):
        return False  # eps keeps the scale positive
    if isinstance(scheme, TFScheme):
        return hi <= 0 if not scheme.signed_input else lo == hi == 0
    if isinstance(scheme, OneFlowScheme):
        return lo == hi if not scheme.symmetric else lo == hi == 0
    if isinstance(scheme, LearnedScaleScheme):
        return False  # alpha below 1e-6 becomes 1e-6 before the export (§4.5)
    return lo == hi == 0  # MindSpore: the range [0, 0]


def _zero_point_inside(scheme: Scheme, qparams: QParams, lo: float, hi: float) -> bool:
    zp = qparams.zero_point
    if isinstance(scheme, OneFlowScheme) and not scheme.symmetric and not lo <= 0 <= hi:
        return True  # OneFlow keeps the unclamped zero point (§3.1); ONNX export clamps it
    return bool(np.all((qparams.quant_min <= zp) & (zp <= qparams.quant_max)))


_magnitudes = st.one_of(st.just(0.0), st.floats(1e-30, 1e30), st.floats(1e-3, 1e3))
_values = st.builds(lambda m, negative: -m if negative else m, _magnitudes, st.booleans())


@settings(max_examples=100, deadline=None)
@given(
    case=st.sampled_from(_CASES),
    a=_values,
    b=_values,
    role=st.sampled_from(["activation", "weight"]),
)
def test_qparams_are_valid_or_documented(
    case: tuple[str, dict[str, object]], a: float, b: float, role: str
) -> None:
    """Scale finite and > 0 with the zero point inside the grid, except the documented cases,
    which the ONNX export then replaces."""
    name, knobs = case
    lo, hi = sorted((float(f32(a)), float(f32(b))))
    recipe = getattr(build_preset(name, knobs), role)
    qparams = recipe.qparams(MinMaxStats(f32(lo), f32(hi)))
    scale = float(qparams.scale)
    if _documented_degenerate(recipe.scheme, lo, hi):
        assert not (math.isfinite(scale) and scale > 0) or not np.isfinite(qparams.zero_point)
    else:
        assert math.isfinite(scale) and scale > 0, f"{name} {knobs} [{lo}, {hi}] -> scale {scale}"
        assert np.isfinite(qparams.zero_point)
        assert _zero_point_inside(recipe.scheme, qparams, lo, hi)
    if getattr(recipe.scheme, "dtype", None) != "qint32":
        onnx = recipe.to_onnx(qparams, opset=21)
        assert np.all(np.isfinite(onnx.scale) & (onnx.scale > 0))
        assert (onnx.replacement is not None) == _documented_degenerate(recipe.scheme, lo, hi)


def test_learned_scale_exports_alpha_after_the_ascend_floor() -> None:
    """SEMANTICS §4.5: |alpha| < 1e-6 becomes 1e-6 before the export, so a learned maxq of 1e-8
    exports scale = f32(1e-6 / 127), the scale the kernel computes with."""
    from qcal.numerics.schemes import LearnedScaleScheme

    scheme = LearnedScaleScheme(num_bits=8, neg_trunc=False, narrow_range=True)
    tiny = np.float32(1e-8)
    qparams = compute_qparams(MinMaxStats(-tiny, tiny), scheme)
    assert qparams.scale == np.float32(np.float32(1e-6) / np.float32(127))
    assert qparams.extras["alpha"] == np.float32(1e-6)
    normal = compute_qparams(MinMaxStats(np.float32(-0.5), np.float32(2.0)), scheme)
    assert normal.scale == np.float32(np.float32(2.0) / np.float32(127))
