"""Reference fake-quant: idempotence, error bound, per-channel broadcasting, codes, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.observers import MinMaxStats, PerChannel, PerTensor
from qcal.numerics.onnx_mapping import degenerate_mask
from qcal.numerics.presets import TensorRecipe, build_preset
from qcal.numerics.schemes import QParams, TFScheme, TorchScheme, compute_qparams

f32 = np.float32

_CASES: list[tuple[str, dict[str, object]]] = [
    ("pytorch", {}),
    (
        "pytorch",
        {"dtype": "qint8", "qscheme": "per_tensor_symmetric", "quant_min": -8, "quant_max": 7},
    ),
    ("pytorch-symmetric", {"dtype": "quint8"}),
    ("oneflow-google", {}),
    ("oneflow-google", {"quantization_scheme": "affine", "quantization_bit": 4}),
    ("oneflow-cambricon", {}),
    ("mindspore", {}),
    ("mindspore", {"symmetric": True, "narrow_range": True, "quant_dtype": "INT4"}),
    ("mindspore", {"mode": "LEARNED_SCALE", "symmetric": True, "narrow_range": True}),
    ("mindspore", {"mode": "LEARNED_SCALE", "symmetric": True, "neg_trunc": True}),
    ("tensorflow", {}),
    ("tensorflow", {"round_mode": "HALF_UP", "narrow_range": True}),
    (
        "tensorflow",
        {"signed_input": False, "range_given": True, "input_min": -0.5, "input_max": 3.0},
    ),
    ("horizon", {}),
    ("horizon", {"dtype": "qint16"}),
    ("horizon-rne", {"dtype": "quint4"}),
]


def _recipe(case: tuple[str, dict[str, object]], role: str = "activation") -> TensorRecipe:
    recipe = getattr(build_preset(case[0], case[1]), role)
    assert isinstance(recipe, TensorRecipe)
    return recipe


def _grid_bounds(qparams: QParams) -> tuple[np.ndarray, np.ndarray]:
    """The representable interval: the dequantized lowest and highest codes."""
    extras = qparams.extras
    if "nudged_min" in extras:
        return extras["nudged_min"], extras["nudged_max"]
    if "alpha" in extras:
        low = -extras["alpha"] if qparams.quant_min < 0 else np.zeros_like(extras["alpha"])
        return low, extras["alpha"]
    zp = qparams.zero_point.astype(np.float64)
    scale = qparams.scale.astype(np.float64)
    return (qparams.quant_min - zp) * scale, (qparams.quant_max - zp) * scale


def _calibrated(recipe: TensorRecipe, seed: int, per_channel: bool) -> tuple[np.ndarray, QParams]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 5)) * rng.choice([0.01, 1.0, 300.0]) + rng.normal()).astype(
        np.float32
    )
    granularity = PerChannel(1) if per_channel else PerTensor()
    observer = recipe.observer("minmax", granularity)
    observer.update(x)
    return x, recipe.qparams(observer.state())


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(_CASES), seed=st.integers(0, 2**32 - 1), per_channel=st.booleans())
def test_fake_quant_is_idempotent(
    case: tuple[str, dict[str, object]], seed: int, per_channel: bool
) -> None:
    recipe = _recipe(case, "weight" if per_channel else "activation")
    if per_channel and recipe.per_channel_axes not in ("any", (1,)):
        per_channel = False
    x, qparams = _calibrated(recipe, seed, per_channel)
    if degenerate_mask(qparams).any():
        return  # documented degenerate parameters give NaN or 0 outputs (§7)
    once = recipe.fake_quantize(x, qparams)
    twice = recipe.fake_quantize(once, qparams)
    np.testing.assert_array_equal(twice, once)
    assert once.dtype == np.float32 and once.shape == x.shape


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(_CASES), seed=st.integers(0, 2**32 - 1), per_channel=st.booleans())
def test_error_is_at_most_half_a_step_inside_the_grid(
    case: tuple[str, dict[str, object]], seed: int, per_channel: bool
) -> None:
    recipe = _recipe(case, "weight" if per_channel else "activation")
    if per_channel and recipe.per_channel_axes not in ("any", (1,)):
        per_channel = False
    x, qparams = _calibrated(recipe, seed, per_channel)
    if degenerate_mask(qparams).any():
        return
    low, high = _grid_bounds(qparams)
    shape = (1, -1, 1) if per_channel else ()
    low, high = np.reshape(low, shape), np.reshape(high, shape)
    scale = np.reshape(qparams.scale, shape).astype(np.float64)
    error = np.abs(recipe.fake_quantize(x, qparams).astype(np.float64) - x)
    inside = (x >= low) & (x <= high)
    slack = 2.0**-14 * np.maximum(np.abs(low), np.abs(high))  # float32 rounding of the output
    bound = np.broadcast_to(scale / 2 + slack, x.shape)
    assert np.all(error[inside] <= bound[inside])


_PER_CHANNEL_CASES = [c for c in _CASES if c[0] != "oneflow-cambricon"]  # cambricon: per tensor


@pytest.mark.parametrize("case", _PER_CHANNEL_CASES, ids=lambda c: f"{c[0]}{c[1]}")
def test_per_channel_equals_per_tensor_slice_by_slice(case: tuple[str, dict[str, object]]) -> None:
    """Per-channel parameters broadcast along their axis exactly like one per-tensor call each."""
    recipe = _recipe(case, "weight")
    assert recipe.per_channel_axes in ("any", (0,))
    x = (np.random.default_rng(5).standard_normal((3, 4, 6)) * [[[0.1]], [[2.0]], [[30.0]]]).astype(
        np.float32
    )
    observer = recipe.observer("minmax", PerChannel(0))
    observer.update(x)
    stats = observer.state()
    together = recipe.fake_quantize(x, recipe.qparams(stats))
    for c in range(3):
        single = recipe.qparams(MinMaxStats(stats.min[c], stats.max[c]))
        np.testing.assert_array_equal(together[c], recipe.fake_quantize(x[c], single))


def test_torch_non_finite_inputs() -> None:
    """§1.4: NaN lands on qmin, +inf on qmax, -inf on qmin."""
    scheme = TorchScheme.from_api()
    qparams = compute_qparams(MinMaxStats(f32(-1.0), f32(3.0)), scheme)
    recipe = build_preset("pytorch").activation
    out = recipe.fake_quantize(np.array([np.nan, np.inf, -np.inf], dtype=np.float32), qparams)
    zp, scale = int(qparams.zero_point), qparams.scale
    expected = np.array([(0 - zp) * scale, (255 - zp) * scale, (0 - zp) * scale], dtype=np.float32)
    np.testing.assert_array_equal(out, expected)


def test_horizon_propagates_nan_and_tf_keeps_empty_tensors() -> None:
    horizon = build_preset("horizon").activation
    qparams = horizon.qparams(MinMaxStats(f32(-1.0), f32(1.0)))
    assert np.isnan(horizon.fake_quantize(np.array([np.nan], dtype=np.float32), qparams)).all()
    tf = build_preset("tensorflow").activation
    params = compute_qparams(MinMaxStats(f32(-1.0), f32(1.0)), TFScheme())
    assert tf.fake_quantize(np.zeros((0, 3), dtype=np.float32), params).shape == (0, 3)


def test_per_channel_parameters_must_fit() -> None:
    recipe = build_preset("pytorch").weight
    qparams = recipe.qparams(MinMaxStats(np.zeros(3), np.ones(3), 0))
    with pytest.raises(DataError, match="channels"):
        recipe.fake_quantize(np.zeros((4, 2), dtype=np.float32), qparams)


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(_CASES), seed=st.integers(0, 2**32 - 1), opset=st.sampled_from([13, 21])
)
def test_codes_dequantize_to_the_fake_quant_output(
    case: tuple[str, dict[str, object]], seed: int, opset: int
) -> None:
    """(code - onnx_zp) * onnx_scale reproduces the fake-quant output: bit for bit where the API
    dequantizes as (q - zp) * s, within float32 rounding where it does not (MindSpore)."""
    recipe = _recipe(case)
    x, qparams = _calibrated(recipe, seed, False)
    if qparams.quant_max - qparams.quant_min > 255 and opset < 21:
        with pytest.raises(ConfigError, match="opset 21"):
            recipe.to_onnx(qparams, opset=opset)
        return
    onnx = recipe.to_onnx(qparams, opset=opset)
    codes = recipe.quantize(x, qparams, opset=opset)
    assert codes.dtype == onnx.zero_point.dtype
    dequantized = (codes.astype(np.int32) - onnx.zero_point.astype(np.int32)).astype(
        np.float32
    ) * onnx.scale
    reference = recipe.fake_quantize(x, qparams)
    if onnx.replacement is not None:
        np.testing.assert_array_equal(dequantized, 0.0)
    elif any("clamped" in d for d in onnx.deviations):
        assert not onnx.exact  # OneFlow's zero point outside the grid (data excludes 0), §7
    elif case[0] == "mindspore":  # q*s + nudged_min, or (q/Qmax)*maxq for LEARNED_SCALE
        scale = float(qparams.scale)
        assert np.all(np.abs(dequantized - reference) <= scale * 1e-3)
    else:
        np.testing.assert_array_equal(dequantized, reference)
