"""Presets: registry, API knobs, refusals, weight recipes (SEMANTICS.md §8), observers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import (
    FixedRangeObserver,
    MindSporeObserver,
    MinMaxObserver,
    MinMaxStats,
    MovingAverageMinMaxObserver,
    OneFlowMovingAverageObserver,
    PerChannel,
    PerTensor,
)
from qcal.numerics.presets import METHODS, PRESETS, build_preset
from qcal.numerics.schemes import (
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    Rounding,
    TFScheme,
    TorchScheme,
)

_SECTION_8 = [
    "pytorch",
    "pytorch-symmetric",
    "oneflow-google",
    "oneflow-cambricon",
    "mindspore",
    "tensorflow",
    "horizon",
    "horizon-rne",
]


def test_registry_lists_the_presets_of_the_contract() -> None:
    assert list(PRESETS) == _SECTION_8
    for name, spec in PRESETS.items():
        assert spec.name == name and spec.description and spec.weight_summary and spec.api
        preset = build_preset(name)
        assert preset.native_method in METHODS
        assert json.loads(json.dumps(dict(preset.knobs))) == dict(preset.knobs)
        assert set(preset.knobs) == set(spec.knobs) == set(spec.options)
        assert json.loads(json.dumps(dict(spec.knobs))) == dict(spec.knobs)  # defaults, listable


@pytest.mark.parametrize(
    "name, knobs",
    [
        (
            "pytorch",
            [
                "dtype",
                "qscheme",
                "reduce_range",
                "quant_min",
                "quant_max",
                "averaging_constant",
                "eps",
                "ch_axis",
            ],
        ),
        (
            "tensorflow",
            [
                "num_bits",
                "signed_input",
                "narrow_range",
                "round_mode",
                "axis",
                "range_given",
                "input_min",
                "input_max",
            ],
        ),
        ("oneflow-google", ["quantization_bit", "quantization_scheme", "per_layer_quantization"]),
        (
            "mindspore",
            [
                "quant_dtype",
                "symmetric",
                "narrow_range",
                "ema",
                "ema_decay",
                "per_channel",
                "channel_axis",
                "min_init",
                "max_init",
                "mode",
                "neg_trunc",
            ],
        ),
        (
            "horizon",
            ["dtype", "averaging_constant", "ch_axis", "round_mode", "quant_min", "quant_max"],
        ),
    ],
)
def test_api_knobs_are_accepted_under_their_names(name: str, knobs: list[str]) -> None:
    assert set(knobs) <= set(PRESETS[name].options)


def test_unknown_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="'tflite'"):
        build_preset("tflite")
    with pytest.raises(ConfigError, match="'reduce_rang'"):
        build_preset("pytorch", {"reduce_rang": True})


@pytest.mark.parametrize(
    "name, knobs, fragment",
    [
        ("pytorch", {"reduce_range": "yes"}, "reduce_range"),
        (
            "pytorch",
            {"dtype": "quint8", "qscheme": "per_tensor_symmetric", "reduce_range": True},
            "reduce_range",
        ),
        ("pytorch", {"observer": "MinMaxObserver", "qscheme": "per_channel_affine"}, "observer"),
        ("pytorch", {"quant_min": 2, "quant_max": 9}, "include 0"),
        ("oneflow-google", {"quantization_bit": 9}, "quantization_bit"),
        ("oneflow-cambricon", {"per_layer_quantization": False}, "per channel"),
        ("oneflow-cambricon", {"quantization_scheme": "affine"}, "quantization_scheme"),
        ("mindspore", {"mode": "LEARNED_SCALE"}, "symmetric"),
        (
            "mindspore",
            {"mode": "LEARNED_SCALE", "symmetric": True, "neg_trunc": True, "narrow_range": True},
            "narrow_range",
        ),
        ("mindspore", {"neg_trunc": True}, "LEARNED_SCALE"),
        ("mindspore", {"quant_dtype": "INT2"}, "quant_dtype"),
        ("mindspore", {"min_init": 1.0, "max_init": 0.5}, "max_init"),
        ("mindspore", {"min_init": [-1.0, -2.0]}, "per_channel"),
        ("mindspore", {"quant_delay": 10}, "quant_delay"),
        ("tensorflow", {"range_given": True}, "input_min"),
        ("tensorflow", {"input_min": -1.0, "input_max": 1.0}, "range_given"),
        ("tensorflow", {"round_mode": "HALF_AWAY_FROM_ZERO"}, "round_mode"),
        ("tensorflow", {"num_bits": 0}, "num_bits"),
        ("horizon", {"qscheme": "per_channel_symmetric"}, "ch_axis"),
        ("horizon", {"dtype": "qint4", "quant_min": -9, "quant_max": 7}, "inside"),
    ],
)
def test_invalid_knobs_are_refused(name: str, knobs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        build_preset(name, knobs)
    assert "\n" not in str(caught.value)


def test_weight_recipes_follow_section_8() -> None:
    torch_weight = build_preset("pytorch").weight
    assert isinstance(torch_weight.scheme, TorchScheme)
    assert (torch_weight.scheme.dtype, torch_weight.scheme.symmetric) == ("qint8", True)
    assert (torch_weight.per_channel_axes, torch_weight.ch_axis) == ("any", 0)
    assert build_preset("pytorch", {"ch_axis": 1}).weight.ch_axis == 1
    assert build_preset("oneflow-google").weight.per_channel_axes == (0,)
    assert build_preset("oneflow-cambricon").weight.per_channel_axes == ()
    mindspore = build_preset("mindspore").weight
    assert mindspore.scheme == MindSporeScheme(8, symmetric=True, narrow_range=True)
    assert mindspore.ch_axis == 0
    assert build_preset("mindspore", {"per_channel": True}).activation.ch_axis == 1
    learned = build_preset(
        "mindspore", {"mode": "LEARNED_SCALE", "symmetric": True, "narrow_range": True}
    )
    assert isinstance(learned.weight.scheme, LearnedScaleScheme)
    tf = build_preset("tensorflow").weight
    assert (
        isinstance(tf.scheme, TFScheme) and tf.scheme.signed_input and tf.per_channel_axes == "any"
    )
    for name, rounding in (("horizon", Rounding.HALF_UP), ("horizon-rne", Rounding.HALF_TO_EVEN)):
        weight = build_preset(name).weight
        assert weight.scheme == HorizonScheme("qint8", -128, 127, rounding)
        assert weight.per_channel_axes == "any"


def test_activation_defaults_follow_section_8() -> None:
    assert build_preset("pytorch").activation.scheme == TorchScheme("quint8", False, 0, 255, False)
    assert build_preset("pytorch-symmetric").activation.scheme == TorchScheme(
        "qint8", True, -128, 127, False
    )
    assert build_preset("oneflow-google").activation.scheme == OneFlowScheme("google", 8, True)
    assert build_preset("oneflow-cambricon").activation.scheme == OneFlowScheme(
        "cambricon", 8, True
    )
    assert build_preset("mindspore").activation.scheme == MindSporeScheme(8, False, False)
    assert build_preset("tensorflow").activation.scheme == TFScheme()
    assert build_preset("horizon").activation.scheme.rounding is Rounding.HALF_UP
    assert build_preset("horizon-rne").activation.scheme.rounding is Rounding.HALF_TO_EVEN
    natives = {name: build_preset(name).native_method for name in PRESETS}
    assert natives["pytorch"] == natives["horizon"] == "moving-average"
    assert natives["tensorflow"] == natives["oneflow-google"] == natives["mindspore"] == "minmax"
    assert build_preset("mindspore", {"ema": True}).native_method == "moving-average"
    assert build_preset("pytorch", {"observer": "MinMaxObserver"}).native_method == "minmax"


def test_observers_follow_each_api() -> None:
    torch = build_preset("pytorch", {"averaging_constant": 0.25}).activation
    ema = torch.observer("moving-average", PerTensor())
    assert isinstance(ema, MovingAverageMinMaxObserver) and ema.averaging_constant == 0.25
    assert isinstance(torch.observer("minmax", PerTensor()), MinMaxObserver)
    oneflow = build_preset("oneflow-google", {"momentum": 0.8, "quantization_scheme": "affine"})
    moving = oneflow.activation.observer("moving-average", PerTensor())
    assert (
        isinstance(moving, OneFlowMovingAverageObserver)
        and moving.momentum == 0.8
        and not moving.symmetric
    )
    ms = build_preset("mindspore", {"ema_decay": 0.9, "min_init": -1.0, "max_init": 1.0}).activation
    ms_ema = ms.observer("moving-average", PerTensor())
    assert isinstance(ms_ema, MindSporeObserver) and ms_ema.ema and ms_ema.ema_decay == 0.9
    given = build_preset(
        "tensorflow", {"range_given": True, "input_min": -1.0, "input_max": 2.0}
    ).activation
    assert isinstance(given.observer("minmax", PerTensor()), FixedRangeObserver)


def test_observer_requests_the_api_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="method"):
        build_preset("pytorch").activation.observer("entropy", PerTensor())
    with pytest.raises(ConfigError, match="moving-average"):
        build_preset("tensorflow").activation.observer("moving-average", PerTensor())
    with pytest.raises(ConfigError, match="axis 0"):
        build_preset("oneflow-google").weight.observer("minmax", PerChannel(1))
    with pytest.raises(ConfigError, match="not at all"):
        build_preset("oneflow-cambricon").weight.observer("minmax", PerChannel(0))
    assert build_preset("oneflow-google").weight.observer("minmax", PerChannel(0)) is not None


def test_knobs_change_the_numbers() -> None:
    """A knob reaches the arithmetic: the OneFlow moving-average zero point rounds half away."""
    stats = MinMaxStats(np.float32(-2.5), np.float32(252.5))  # scale 1, min/scale = -2.5
    nearest_even = build_preset("oneflow-google", {"quantization_scheme": "affine"})
    away = build_preset(
        "oneflow-google",
        {"quantization_scheme": "affine", "observer": "MovingAverageMinMaxObserver"},
    )
    assert nearest_even.activation.qparams(stats).zero_point == 2
    assert away.activation.qparams(stats).zero_point == 3
    reduced = build_preset("pytorch", {"reduce_range": True}).activation.scheme
    assert (reduced.quant_min, reduced.quant_max) == (0, 127)


@pytest.mark.parametrize("name", _SECTION_8)
def test_minmax_is_the_running_extreme(name: str) -> None:
    """method "minmax" keeps the raw running extreme of all batches (no 0, no EMA)."""
    recipe = build_preset(name).activation
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((2, 6)) + 3).astype(np.float32) for _ in range(4)]  # positive
    observer = recipe.observer("minmax", PerTensor())
    for batch in batches:
        observer.update(batch)
    state = observer.state()
    everything = np.concatenate(batches)
    assert (state.min, state.max) == (everything.min(), everything.max())
    assert np.isfinite(recipe.qparams(state).scale) and recipe.qparams(state).scale > 0


@pytest.mark.parametrize("name", ["pytorch", "pytorch-symmetric", "mindspore", "horizon"])
def test_zero_is_forced_when_parameters_are_computed(name: str) -> None:
    recipe = build_preset(name).activation
    positive = recipe.qparams(MinMaxStats(np.float32(3.0), np.float32(5.0)))
    with_zero = recipe.qparams(MinMaxStats(np.float32(0.0), np.float32(5.0)))
    np.testing.assert_array_equal(positive.scale, with_zero.scale)
    np.testing.assert_array_equal(positive.zero_point, with_zero.zero_point)
