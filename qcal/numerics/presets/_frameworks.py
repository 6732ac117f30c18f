"""One builder per framework: resolved knobs in, activation and weight recipes out.

Each section follows one API (SEMANTICS.md §1-§5): its observer classes, what it does with empty
batches, NaN and infinities, its knobs with their defaults, and the checks on knob combinations
that the API itself refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import (
    DataPolicy,
    FixedRangeObserver,
    MindSporeObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    OneFlowMovingAverageObserver,
)
from qcal.numerics.presets._types import (
    Knob,
    ObserverFactory,
    TensorRecipe,
    _boolean,
    _choice,
    _integer,
    _number,
)
from qcal.numerics.schemes import (
    TORCH_EPS,
    HorizonScheme,
    LearnedScaleScheme,
    MindSporeScheme,
    OneFlowScheme,
    Rounding,
    Scheme,
    TFScheme,
    TorchScheme,
)

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
