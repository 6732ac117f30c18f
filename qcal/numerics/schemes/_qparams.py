"""Rounding modes and :class:`QParams`, the values every scheme and parameter rule share.

Kept apart from the schemes so the float32 constants, the three rounding rules (SEMANTICS.md §0)
and the parameter record have one home that the scheme types and the rules both import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from qcal.numerics.errors import ConfigError

__all__ = ["TORCH_EPS", "QParams", "Rounding", "round_float32"]

_F32 = np.float32
TORCH_EPS = float(np.finfo(np.float32).eps)  # 2**-23, PyTorch's and Horizon's default eps


class Rounding(enum.Enum):
    """How a float32 value is rounded to an integer (SEMANTICS.md §0)."""

    HALF_TO_EVEN = "half_to_even"  # rne: numpy.rint, C nearbyint
    HALF_UP = "half_up"  # rhu: floor(f32(t + 0.5)), the +0.5 rounded to float32 first
    HALF_AWAY = "half_away"  # rha: C round()


def _half_away(t: np.ndarray) -> np.ndarray:
    whole = np.trunc(t)
    # t - trunc(t) is exact in binary floating point, so the .5 test below is exact too.
    step = np.where(np.abs(t - whole) >= _F32(0.5), np.sign(t), _F32(0.0))
    return np.asarray(whole + step, dtype=_F32)


_ROUNDERS: Mapping[Rounding, Callable[[np.ndarray], np.ndarray]] = {
    Rounding.HALF_TO_EVEN: np.rint,
    Rounding.HALF_UP: lambda t: np.floor(t + _F32(0.5)),
    Rounding.HALF_AWAY: _half_away,
}


def round_float32(t: np.ndarray, rounding: Rounding) -> np.ndarray:
    """Round a float32 array to integral float32 values with ``rounding`` (SEMANTICS.md §0)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(_ROUNDERS[rounding](np.asarray(t, dtype=_F32)), dtype=_F32)


@dataclass(frozen=True, eq=False)
class QParams:
    """Quantization parameters as one API computes them.

    Attributes:
        scale: float32 step between codes (ONNX meaning), shape () or (C,).
        zero_point: same shape; int64, or float32 where the API keeps a float (OneFlow).
        quant_min: lowest integer code of the API's grid.
        quant_max: highest integer code.
        axis: channel axis for per-channel parameters, None per tensor.
        extras: API-specific arrays (``multiplier``, ``adjusted_min``/``adjusted_max`` for TF;
            ``shift`` for OneFlow cambricon; ``nudged_min``/``nudged_max``/
            ``zero_point_unsigned`` for MindSpore; ``alpha`` for LEARNED_SCALE).
    """

    scale: np.ndarray
    zero_point: np.ndarray
    quant_min: int
    quant_max: int
    axis: int | None
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scale = np.asarray(self.scale, dtype=_F32)
        zero_point = np.asarray(self.zero_point)
        if zero_point.dtype.kind not in "iuf":
            raise ConfigError(f"zero point must be numeric, got dtype {zero_point.dtype}")
        if zero_point.shape != scale.shape or scale.ndim > 1:
            raise ConfigError(
                f"scale {scale.shape} and zero point {zero_point.shape} must share shape () or (C,)"
            )
        if self.quant_min >= self.quant_max:
            raise ConfigError(
                f"quant_min={self.quant_min} must be below quant_max={self.quant_max}"
            )
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zero_point)

    @property
    def is_per_channel(self) -> bool:
        """True when there is one scale per channel."""
        return self.scale.ndim == 1
