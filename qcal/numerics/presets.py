"""Named presets: one framework's quantization semantics, configured with that API's own knobs.

A preset is data: a description, its knobs (API names, defaults and checks) and a small builder
that turns resolved knobs into two :class:`TensorRecipe` objects, one for activations and one for
weights (SEMANTICS.md §8). A recipe holds the scheme, the observers the API offers and the axes
on which it allows per-channel parameters; it computes parameters, fake-quantizes and maps to
ONNX by calling :mod:`qcal.numerics.schemes`, :mod:`qcal.numerics.fakequant` and :mod:`qcal.numerics.onnx_mapping`.

Observer methods: ``"minmax"`` is the running extreme over all calibration data (0-forcing, if the
API has it, happens when parameters are computed); ``"moving-average"`` is the API's EMA
convention fed in data order. Each preset also says which of the two its API does natively.
Besides the knobs of §8, PyTorch, Horizon and OneFlow presets accept ``observer``, the API's
observer class name, which selects the native method (and, for OneFlow, the zero-point rounding
of ``MovingAverageMinMaxObserver``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from qcal.numerics import fakequant
from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import (
    DataPolicy,
    FixedRangeObserver,
    Granularity,
    MindSporeObserver,
    MinMaxObserver,
    MinMaxStats,
    MovingAverageMinMaxObserver,
    Observer,
    OneFlowMovingAverageObserver,
    PerChannel,
)
from qcal.numerics.onnx_mapping import DEFAULT_OPSET, OnnxQParams, to_onnx_qparams
from qcal.numerics.schemes import (
    TORCH_EPS,
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
)

__all__ = [
    "METHODS",
    "PRESETS",
    "Knob",
    "Preset",
    "PresetSpec",
    "TensorRecipe",
    "build_preset",
]

METHODS = ("minmax", "moving-average")

ObserverFactory = Callable[[Granularity], Observer]


# ---------------------------------------------------------------------------------------------
# recipes and presets


@dataclass(frozen=True)
class TensorRecipe:
    """How one role (activations or weights) is observed, parameterised and fake-quantized.

    Attributes:
        scheme: the scheme of :mod:`qcal.numerics.schemes` the API uses for this role.
        per_channel_axes: "any", the axes the API allows per channel (OneFlow: (0,)), or ().
        ch_axis: the API's default channel axis for this role, or None when it is per tensor.
        observers: method name -> observer factory (not part of equality).
    """

    scheme: Scheme
    per_channel_axes: str | tuple[int, ...]
    ch_axis: int | None = None
    observers: Mapping[str, ObserverFactory] = field(
        default_factory=dict, compare=False, repr=False
    )

    def observer(self, method: str, granularity: Granularity) -> Observer:
        """A fresh observer: ``method`` is "minmax" or "moving-average".

        Raises:
            ConfigError: unknown method, a method this API lacks, or a per-channel axis the API
                does not allow.
        """
        if method not in METHODS:
            raise ConfigError(f"observer method {method!r}: expected one of {', '.join(METHODS)}")
        factory = self.observers.get(method)
        if factory is None:
            raise ConfigError(f"{self.scheme.describe()}: the API has no {method} observer")
        if isinstance(granularity, PerChannel):
            allowed = self.per_channel_axes
            if allowed != "any" and granularity.axis not in allowed:
                where = f"only on axis {', '.join(map(str, allowed))}" if allowed else "not at all"
                raise ConfigError(
                    f"per-channel axis {granularity.axis} not supported: "
                    f"this API quantizes per channel {where}"
                )
        return factory(granularity)

    def qparams(self, stats: MinMaxStats) -> QParams:
        """``compute_qparams(stats, self.scheme)``."""
        return compute_qparams(stats, self.scheme)

    def fake_quantize(self, x: np.ndarray, qparams: QParams) -> np.ndarray:
        """Float32 quantize-dequantize, bit-exact to the API."""
        return fakequant.fake_quantize(x, qparams, self.scheme)

    def to_onnx(self, qparams: QParams, *, opset: int = DEFAULT_OPSET) -> OnnxQParams:
        """QuantizeLinear parameters (4-bit and 16-bit types only from opset 21)."""
        return to_onnx_qparams(qparams, self.scheme, opset=opset)

    def quantize(
        self, x: np.ndarray, qparams: QParams, *, opset: int = DEFAULT_OPSET
    ) -> np.ndarray:
        """Integer codes for ``self.to_onnx(qparams, opset=opset)`` (pass the same opset)."""
        return fakequant.quantize(x, qparams, self.scheme, self.to_onnx(qparams, opset=opset))


@dataclass(frozen=True)
class Preset:
    """A built preset: resolved knobs and the recipes for activations and weights.

    Attributes:
        name: preset name.
        knobs: every knob with its resolved value (JSON-serialisable, for the report).
        activation: recipe for activations.
        weight: recipe for weights.
        native_method: "minmax" or "moving-average": what the API itself does for activations.
        description: one line for listings.
    """

    name: str
    knobs: Mapping[str, object]
    activation: TensorRecipe
    weight: TensorRecipe
    native_method: str
    description: str = ""


@dataclass(frozen=True)
class Knob:
    """One API argument: its default and a check that returns the validated value."""

    default: object
    check: Callable[[str, object], object]
    help: str = ""


@dataclass(frozen=True)
class PresetSpec:
    """Registry entry: what a preset follows and how it is built from its knobs.

    Attributes:
        name: preset name.
        api: the API calls it follows.
        description: one line for listings.
        options: knob name -> :class:`Knob` (default and check), in the API's names.
        build: resolved knobs -> (activation recipe, weight recipe, native method).
        weight_summary: what the weight recipe is, for listings.
    """

    name: str
    api: str
    description: str
    options: Mapping[str, Knob]
    build: Callable[[Mapping[str, Any]], tuple[TensorRecipe, TensorRecipe, str]]
    weight_summary: str

    @property
    def knobs(self) -> Mapping[str, object]:
        """Knob name -> default value."""
        return {name: knob.default for name, knob in self.options.items()}


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


# ---------------------------------------------------------------------------------------------
# knob checks


def _boolean(name: str, value: object) -> object:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name}={value!r}: expected true or false")
    return bool(value)


def _integer(lo: int | None = None, hi: int | None = None) -> Callable[[str, object], object]:
    def check(name: str, value: object) -> object:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ConfigError(f"{name}={value!r}: expected an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(
                f"{name}={value}: expected {'' if lo is None else lo}..{'' if hi is None else hi}"
            )
        return int(value)

    return check


def _number(lo: float, hi: float) -> Callable[[str, object], object]:
    def check(name: str, value: object) -> object:
        number = _as_float(name, value)
        if not lo <= number <= hi:
            raise ConfigError(f"{name}={value}: expected a number in [{lo}, {hi}]")
        return number

    return check


def _as_float(name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ConfigError(f"{name}={value!r}: expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value}: expected a finite number")
    return number


def _numbers(name: str, value: object) -> object:
    """A number or a flat list of numbers (per-channel values)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        values = [_as_float(name, v) for v in value]
        if not values:
            raise ConfigError(f"{name}: expected at least one number")
        return values
    return _as_float(name, value)


def _choice(*options: str) -> Callable[[str, object], object]:
    def check(name: str, value: object) -> object:
        if value not in options:
            raise ConfigError(f"{name}={value!r}: expected one of {', '.join(options)}")
        return value

    return check


# ---------------------------------------------------------------------------------------------
# observer factories


def _minmax(policy: DataPolicy) -> ObserverFactory:
    return lambda granularity: MinMaxObserver(granularity, policy=policy)


def _torch_ema(averaging_constant: float, policy: DataPolicy) -> ObserverFactory:
    return lambda granularity: MovingAverageMinMaxObserver(
        granularity, averaging_constant=averaging_constant, policy=policy
    )


# What each API does with empty batches, NaN and infinities (SEMANTICS.md §6).
_TORCH_DATA = DataPolicy(empty="ignore", nan="reject", inf="propagate")
_TF_DATA = DataPolicy(empty="ignore", nan="reject", inf="propagate")
_ONEFLOW_DATA = DataPolicy(empty="reject", nan="propagate", inf="propagate")
_MINDSPORE_DATA = DataPolicy(empty="reject", nan="reject", inf="reject")
_HORIZON_DATA = DataPolicy(empty="ignore", nan="propagate", inf="propagate")


# ---------------------------------------------------------------------------------------------
# PyTorch


_TORCH_OBSERVERS = {
    "MinMaxObserver": ("minmax", False),
    "MovingAverageMinMaxObserver": ("moving-average", False),
    "PerChannelMinMaxObserver": ("minmax", True),
    "MovingAveragePerChannelMinMaxObserver": ("moving-average", True),
}


_TORCH_QSCHEMES = (
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
)


def _torch_knobs(dtype: str, qscheme: str) -> Mapping[str, Knob]:
    return {
        "observer": Knob(None, _choice(*_TORCH_OBSERVERS), "observer class (native method)"),
        "dtype": Knob(dtype, _choice("quint8", "qint8", "qint32", "quint4x2")),
        "qscheme": Knob(qscheme, _choice(*_TORCH_QSCHEMES)),
        "reduce_range": Knob(False, _boolean),
        "quant_min": Knob(None, _integer()),
        "quant_max": Knob(None, _integer()),
        "averaging_constant": Knob(0.01, _number(0.0, 1.0)),
        "eps": Knob(TORCH_EPS, _number(0.0, 1.0)),
        "ch_axis": Knob(0, _integer(), "weight channel axis"),
        # The weight observer's own reduce_range (PerChannelMinMaxObserver(reduce_range=...)).
        # On by default: onnxruntime's uint8 x int8 kernels on x86 CPUs without VNNI add pairs of
        # products in 16 bits and saturate with full-range int8 weights; 7-bit weights cannot.
        "weight_reduce_range": Knob(True, _boolean, "7-bit weights [-64,63] (x86 without VNNI)"),
    }


def _build_torch(k: Mapping[str, Any]) -> tuple[TensorRecipe, TensorRecipe, str]:
    per_channel = str(k["qscheme"]).startswith("per_channel")
    observer = k["observer"] or (
        "MovingAveragePerChannelMinMaxObserver" if per_channel else "MovingAverageMinMaxObserver"
    )
    native, observer_per_channel = _TORCH_OBSERVERS[observer]
    if observer_per_channel != per_channel:
        raise ConfigError(f"observer={observer} does not take qscheme={k['qscheme']}")
    if k["averaging_constant"] <= 0:
        raise ConfigError("averaging_constant must be positive")
    scheme = TorchScheme.from_api(
        dtype=k["dtype"], qscheme=k["qscheme"], reduce_range=k["reduce_range"],
        quant_min=k["quant_min"], quant_max=k["quant_max"], eps=k["eps"],
    )  # fmt: skip
    observers = {
        "minmax": _minmax(_TORCH_DATA),
        "moving-average": _torch_ema(k["averaging_constant"], _TORCH_DATA),
    }
    activation = TensorRecipe(scheme, "any" if per_channel else (), None, observers)
    weight_scheme = TorchScheme.from_api(
        dtype="qint8", qscheme="per_channel_symmetric", reduce_range=k["weight_reduce_range"],
        eps=k["eps"],
    )
    weight = TensorRecipe(weight_scheme, "any", k["ch_axis"], observers)
    return activation, weight, native


# ---------------------------------------------------------------------------------------------
# TensorFlow


def _build_tensorflow(k: Mapping[str, Any]) -> tuple[TensorRecipe, TensorRecipe, str]:
    rounding = Rounding.HALF_UP if k["round_mode"] == "HALF_UP" else Rounding.HALF_TO_EVEN
    axis = k["axis"]
    scheme = TFScheme(
        k["num_bits"], k["signed_input"], k["narrow_range"], rounding, k["range_given"]
    )
    if k["range_given"]:
        lo, hi = k["input_min"], k["input_max"]
        if lo is None or hi is None:
            raise ConfigError("range_given=True needs input_min and input_max")
        if isinstance(lo, list) != isinstance(hi, list) or isinstance(lo, list) != (
            axis is not None
        ):
            raise ConfigError(
                "input_min/input_max must be numbers, "
                "or lists with one value per slice when axis is set"
            )
        observers: dict[str, ObserverFactory] = {"minmax": lambda g: FixedRangeObserver(lo, hi, g)}
    else:
        if k["input_min"] is not None or k["input_max"] is not None:
            raise ConfigError("input_min/input_max apply only with range_given=True")
        observers = {"minmax": _minmax(_TF_DATA)}
    activation = TensorRecipe(scheme, () if axis is None else (axis,), axis, observers)
    weight_scheme = TFScheme(k["num_bits"], True, k["narrow_range"], rounding, False)
    weight = TensorRecipe(weight_scheme, "any", 0, {"minmax": _minmax(_TF_DATA)})
    return activation, weight, "minmax"


# ---------------------------------------------------------------------------------------------
# OneFlow


def _oneflow_knobs(cambricon: bool) -> Mapping[str, Knob]:
    schemes = ("symmetric",) if cambricon else ("symmetric", "affine")
    return {
        "observer": Knob(
            "MinMaxObserver", _choice("MinMaxObserver", "MovingAverageMinMaxObserver")
        ),
        "quantization_bit": Knob(8, _integer(2, 8)),
        "quantization_scheme": Knob("symmetric", _choice(*schemes)),
        "per_layer_quantization": Knob(True, _boolean, "activations per layer (weights: axis 0)"),
        "momentum": Knob(0.95, _number(0.0, 1.0), "MovingAverageMinMaxObserver momentum"),
    }


def _oneflow_builder(
    formula: str,
) -> Callable[[Mapping[str, Any]], tuple[TensorRecipe, TensorRecipe, str]]:
    def build(k: Mapping[str, Any]) -> tuple[TensorRecipe, TensorRecipe, str]:
        moving = k["observer"] == "MovingAverageMinMaxObserver"
        symmetric = k["quantization_scheme"] == "symmetric"
        if formula == "cambricon" and not k["per_layer_quantization"]:
            raise ConfigError(
                "the cambricon formula cannot be per channel (per_layer_quantization=False)"
            )
        # MovingAverageMinMaxObserver rounds the affine zero point half away from zero (§3.3).
        zp_rounding = Rounding.HALF_AWAY if moving else Rounding.HALF_TO_EVEN
        scheme = OneFlowScheme(formula, k["quantization_bit"], symmetric, zp_rounding)
        momentum = k["momentum"]
        observers: dict[str, ObserverFactory] = {
            "minmax": _minmax(_ONEFLOW_DATA),
            "moving-average": lambda g: OneFlowMovingAverageObserver(
                g, momentum=momentum, symmetric=symmetric, policy=_ONEFLOW_DATA
            ),
        }
        axes: tuple[int, ...] = () if formula == "cambricon" else (0,)
        activation = TensorRecipe(
            scheme, () if k["per_layer_quantization"] else axes, None, observers
        )
        weight_scheme = OneFlowScheme(
            formula, k["quantization_bit"], symmetric, Rounding.HALF_TO_EVEN
        )
        weight = TensorRecipe(weight_scheme, axes, 0 if axes else None, observers)
        return activation, weight, "moving-average" if moving else "minmax"

    return build


# ---------------------------------------------------------------------------------------------
# MindSpore


def _build_mindspore(k: Mapping[str, Any]) -> tuple[TensorRecipe, TensorRecipe, str]:
    bits = 4 if k["quant_dtype"] == "INT4" else 8
    if k["quant_delay"] != 0:
        raise ConfigError("quant_delay is not supported (calibration has no training steps)")
    min_init, max_init = k["min_init"], k["max_init"]
    _check_mindspore_init(min_init, max_init, k["per_channel"], k["num_channels"])
    if k["mode"] == "LEARNED_SCALE":
        if not k["symmetric"]:
            raise ConfigError("mode LEARNED_SCALE needs symmetric=True")
        scheme: Scheme = LearnedScaleScheme(bits, k["neg_trunc"], k["narrow_range"])
        weight_scheme: Scheme = LearnedScaleScheme(bits, False, True)
    else:
        if k["neg_trunc"]:
            raise ConfigError("neg_trunc applies only to mode LEARNED_SCALE")
        scheme = MindSporeScheme(bits, k["symmetric"], k["narrow_range"])
        weight_scheme = MindSporeScheme(bits, True, True)
    decay = k["ema_decay"]

    def ema(lo: float | list[float], hi: float | list[float]) -> ObserverFactory:
        return lambda g: MindSporeObserver(
            g, ema=True, ema_decay=decay, min_init=lo, max_init=hi, policy=_MINDSPORE_DATA
        )

    observers = {"minmax": _minmax(_MINDSPORE_DATA), "moving-average": ema(min_init, max_init)}
    channel_axis = k["channel_axis"] if k["per_channel"] else None
    activation = TensorRecipe(scheme, "any" if k["per_channel"] else (), channel_axis, observers)
    scalar_init = not isinstance(min_init, list) and not isinstance(max_init, list)
    weight_observers = {
        "minmax": _minmax(_MINDSPORE_DATA),
        "moving-average": ema(min_init, max_init) if scalar_init else ema(-6.0, 6.0),
    }
    weight = TensorRecipe(weight_scheme, "any", 0, weight_observers)
    return activation, weight, "moving-average" if k["ema"] else "minmax"


def _check_mindspore_init(
    min_init: object, max_init: object, per_channel: bool, channels: int
) -> None:
    lows = np.atleast_1d(np.asarray(min_init, dtype=np.float64))
    highs = np.atleast_1d(np.asarray(max_init, dtype=np.float64))
    for name, values in (("min_init", lows), ("max_init", highs)):
        if values.size > 1 and (not per_channel or values.size != channels):
            raise ConfigError(
                f"{name} has {values.size} values; "
                "lists need per_channel=True and num_channels entries"
            )
    if not np.all(highs > lows):
        raise ConfigError(f"max_init must be greater than min_init (got {min_init} and {max_init})")


# ---------------------------------------------------------------------------------------------
# Horizon


def _horizon_knobs(round_mode: str) -> Mapping[str, Knob]:
    return {
        "observer": Knob(
            None, _choice("MovingAverageMinMaxObserver", "MovingAveragePerChannelMinMaxObserver")
        ),
        "dtype": Knob("qint8", _choice("qint4", "quint4", "qint8", "qint16")),
        "qscheme": Knob(None, _choice("per_tensor_symmetric", "per_channel_symmetric")),
        "averaging_constant": Knob(0.01, _number(0.0, 1.0)),
        "ch_axis": Knob(-1, _integer(-1), "activation channel axis, -1 per tensor"),
        "round_mode": Knob(round_mode, _choice("bpu_round", "half_to_even")),
        "quant_min": Knob(None, _integer()),
        "quant_max": Knob(None, _integer()),
    }


def _build_horizon(k: Mapping[str, Any]) -> tuple[TensorRecipe, TensorRecipe, str]:
    per_channel = k["ch_axis"] >= 0
    qscheme = k["qscheme"] or ("per_channel_symmetric" if per_channel else "per_tensor_symmetric")
    if (qscheme == "per_channel_symmetric") != per_channel:
        raise ConfigError(f"qscheme={qscheme} needs ch_axis {'>= 0' if not per_channel else '-1'}")
    observer = k["observer"] or (
        "MovingAveragePerChannelMinMaxObserver" if per_channel else "MovingAverageMinMaxObserver"
    )
    if ("PerChannel" in observer) != per_channel:
        raise ConfigError(f"observer={observer} does not match ch_axis={k['ch_axis']}")
    if k["averaging_constant"] <= 0:
        raise ConfigError("averaging_constant must be positive")
    rounding = Rounding.HALF_UP if k["round_mode"] == "bpu_round" else Rounding.HALF_TO_EVEN
    scheme = HorizonScheme.from_api(
        dtype=k["dtype"], quant_min=k["quant_min"], quant_max=k["quant_max"], rounding=rounding
    )
    observers = {
        "minmax": _minmax(_HORIZON_DATA),
        "moving-average": _torch_ema(k["averaging_constant"], _HORIZON_DATA),
    }
    activation = TensorRecipe(
        scheme, "any" if per_channel else (), k["ch_axis"] if per_channel else None, observers
    )
    weight = TensorRecipe(
        HorizonScheme.from_api(dtype="qint8", rounding=rounding), "any", 0, observers
    )
    return activation, weight, "moving-average"


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
