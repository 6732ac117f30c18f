"""The preset registry :data:`PRESETS` and :func:`build_preset`, which resolves a preset's knobs.

The table names every preset with its API, description, knobs and builder; the builders come from
the framework module, so this module sits on top of both it and the types.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from qcal.numerics.errors import ConfigError
from qcal.numerics.presets._frameworks import (
    _build_horizon,
    _build_mindspore,
    _build_tensorflow,
    _build_torch,
    _horizon_knobs,
    _oneflow_builder,
    _oneflow_knobs,
    _torch_knobs,
)
from qcal.numerics.presets._types import (
    Knob,
    Preset,
    PresetSpec,
    TensorRecipe,
    _boolean,
    _choice,
    _integer,
    _number,
    _numbers,
)

__all__ = ["PRESETS", "build_preset"]

# ---------------------------------------------------------------------------------------------
# registry


_TF_KNOBS: Mapping[str, Knob] = {
    "num_bits": Knob(8, _integer(1, 62)),
    "signed_input": Knob(True, _boolean),
    "narrow_range": Knob(False, _boolean),
    "round_mode": Knob("HALF_TO_EVEN", _choice("HALF_TO_EVEN", "HALF_UP")),
    "axis": Knob(None, _integer()),
    "range_given": Knob(False, _boolean),
    "input_min": Knob(None, _numbers),
    "input_max": Knob(None, _numbers),
}

_MINDSPORE_KNOBS: Mapping[str, Knob] = {
    "quant_dtype": Knob("INT8", _choice("INT8", "INT4")),
    "symmetric": Knob(False, _boolean),
    "narrow_range": Knob(False, _boolean),
    "ema": Knob(False, _boolean),
    "ema_decay": Knob(0.999, _number(0.0, 1.0)),
    "per_channel": Knob(False, _boolean),
    "channel_axis": Knob(1, _integer()),
    "num_channels": Knob(1, _integer(1)),
    "min_init": Knob(-6.0, _numbers),
    "max_init": Knob(6.0, _numbers),
    "quant_delay": Knob(0, _integer(0)),
    "mode": Knob("DEFAULT", _choice("DEFAULT", "LEARNED_SCALE")),
    "neg_trunc": Knob(False, _boolean),
}


def _spec(
    name: str,
    api: str,
    description: str,
    knobs: Mapping[str, Knob],
    build: Callable[[Mapping[str, Any]], tuple[TensorRecipe, TensorRecipe, str]],
    weight_summary: str,
) -> PresetSpec:
    return PresetSpec(name, api, description, MappingProxyType(dict(knobs)), build, weight_summary)


PRESETS: Mapping[str, PresetSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _spec(
                "pytorch",
                "torch.ao.quantization MovingAverageMinMaxObserver + fake_quantize_per_*_affine",
                "PyTorch: EMA min/max (c=0.01), quint8 per-tensor affine [0,255], half to even",
                _torch_knobs("quint8", "per_tensor_affine"),
                _build_torch,
                "qint8 per_channel_symmetric on ch_axis (default 0), PerChannelMinMaxObserver, "
                "7-bit [-64,63] unless weight_reduce_range=false",
            ),
            _spec(
                "pytorch-symmetric",
                "torch.ao.quantization MovingAverageMinMaxObserver + fake_quantize_per_*_affine",
                "PyTorch: EMA min/max (c=0.01), qint8 per-tensor symmetric (step max|x|/127.5)",
                _torch_knobs("qint8", "per_tensor_symmetric"),
                _build_torch,
                "qint8 per_channel_symmetric on ch_axis (default 0), PerChannelMinMaxObserver, "
                "7-bit [-64,63] unless weight_reduce_range=false",
            ),
            _spec(
                "oneflow-google",
                "oneflow.nn.MinMaxObserver + oneflow.nn.FakeQuantization (google)",
                "OneFlow google: min/max, symmetric (step max|x|/127) or affine, unclamped zp",
                _oneflow_knobs(cambricon=False),
                _oneflow_builder("google"),
                "same scheme, per channel on axis 0 only",
            ),
            _spec(
                "oneflow-cambricon",
                "oneflow.nn.MinMaxObserver + oneflow.nn.FakeQuantization (cambricon)",
                "OneFlow cambricon: signed, power-of-two step 2^(floor(log2 max|x|)-(b-2))",
                _oneflow_knobs(cambricon=True),
                _oneflow_builder("cambricon"),
                "same scheme, per tensor only",
            ),
            _spec(
                "mindspore",
                "mindspore.nn.FakeQuantWithMinMaxObserver",
                "MindSpore: range with 0 forced, INT8 asymmetric nudged zero point, half up",
                _MINDSPORE_KNOBS,
                _build_mindspore,
                "symmetric narrow_range per channel (channel_axis 0)",
            ),
            _spec(
                "tensorflow",
                "tf.quantization.quantize_and_dequantize_v2",
                "TensorFlow: min/max widened so 0 is exact, signed 8-bit, zp 0, half to even",
                _TF_KNOBS,
                _build_tensorflow,
                "signed, per axis along the channel dimension",
            ),
            _spec(
                "horizon",
                "horizon_plugin_pytorch.quantization.FakeQuantize",
                "Horizon: EMA min/max (c=0.01), qint8 symmetric (step max|x|/127.5), bpu_round",
                _horizon_knobs("bpu_round"),
                _build_horizon,
                "qint8 symmetric per channel (ch_axis 0), MovingAveragePerChannelMinMaxObserver",
            ),
            _spec(
                "horizon-rne",
                "horizon_plugin_pytorch.quantization.FakeQuantize",
                "Horizon: EMA min/max (c=0.01), qint8 symmetric (step max|x|/127.5), half to even",
                _horizon_knobs("half_to_even"),
                _build_horizon,
                "qint8 symmetric per channel (ch_axis 0), MovingAveragePerChannelMinMaxObserver",
            ),
        )
    }
)


def build_preset(name: str, knobs: Mapping[str, object] | None = None) -> Preset:
    """Build preset ``name`` with API knobs; a knob given as None keeps its default.

    Raises:
        ConfigError: unknown preset or knob, a bad knob value, or an invalid combination.
    """
    spec = PRESETS.get(name)
    if spec is None:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    given = dict(knobs or {})
    unknown = sorted(set(given) - set(spec.options))
    if unknown:
        raise ConfigError(
            f"preset {name}: unknown option {unknown[0]!r} (known: {', '.join(spec.options)})"
        )
    resolved: dict[str, object] = {}
    for knob_name, knob in spec.options.items():
        value = given.get(knob_name)
        resolved[knob_name] = knob.default if value is None else knob.check(knob_name, value)
    try:
        activation, weight, native = spec.build(resolved)
    except ConfigError as err:
        raise ConfigError(f"preset {name}: {err}") from None
    return Preset(name, resolved, activation, weight, native, spec.description)
