"""The preset types: :class:`TensorRecipe`, :class:`Preset`, :class:`Knob`, :class:`PresetSpec`.

A recipe is where a preset meets the rest of numerics: it picks an observer and calls the scheme
rules, the reference fake-quant and the ONNX mapping. The knob checks live here too, so the
framework builders and the registry share one set of validators.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcal.numerics import fakequant
from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import Granularity, MinMaxStats, Observer, PerChannel
from qcal.numerics.onnx_mapping import DEFAULT_OPSET, OnnxQParams, to_onnx_qparams
from qcal.numerics.schemes import QParams, Scheme, compute_qparams

__all__ = ["METHODS", "Knob", "ObserverFactory", "Preset", "PresetSpec", "TensorRecipe"]

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
