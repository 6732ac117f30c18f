"""Quantization schemes, and the one function that turns statistics into scale and zero point.

A scheme is a frozen description of one API's integer grid and parameter rule; it never sees a
batch. :func:`compute_qparams` is pure and is the only place scale and zero point are computed
(calibration and the reference fake-quant both call it). Every step is float32, in the order
SEMANTICS.md gives, because float64 differs near rounding boundaries (§0).

Schemes (one per API convention, each citing its SEMANTICS.md section):

* :class:`TorchScheme` (§1.1, §1.3), :class:`HorizonScheme` (§5.1, §5.3),
* :class:`TFScheme` (§2.1, §2.3), :class:`OneFlowScheme` (§3.1, §3.3),
* :class:`MindSporeScheme` (§4.1, §4.3), :class:`LearnedScaleScheme` (§4.5).

``QParams.scale`` is always the step between adjacent codes (the ONNX meaning). Where an API
reports something else, it is in ``extras`` (OneFlow cambricon's shift exponent, TF's multiplier).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.observers import MinMaxStats

__all__ = [
    "TORCH_EPS",
    "HorizonScheme",
    "LearnedScaleScheme",
    "MindSporeScheme",
    "OneFlowScheme",
    "QParams",
    "Rounding",
    "Scheme",
    "TFScheme",
    "TorchScheme",
    "compute_qparams",
    "round_float32",
]

_F32 = np.float32
TORCH_EPS = float(np.finfo(np.float32).eps)  # 2**-23, PyTorch's and Horizon's default eps
_FLT_MAX = _F32(np.finfo(np.float32).max)


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


# ---------------------------------------------------------------------------------------------
# schemes


_TORCH_RANGES: Mapping[str, tuple[tuple[int, int], tuple[int, int]]] = {
    # dtype: (default range, reduce_range range)            SEMANTICS.md §1.1
    "quint8": ((0, 255), (0, 127)),
    "qint8": ((-128, 127), (-64, 63)),
    "qint32": ((-(2**31), 2**31 - 1), (-(2**31), 2**31 - 1)),
    "quint4x2": ((0, 15), (0, 15)),
}
_TORCH_QSCHEMES = (
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
)


@dataclass(frozen=True)
class TorchScheme:
    """PyTorch observers' ``calculate_qparams`` (SEMANTICS.md §1.1, §1.3). Rounds half to even.

    Build it with :meth:`from_api`, which resolves the range exactly as PyTorch does.
    """

    dtype: str
    symmetric: bool
    quant_min: int
    quant_max: int
    has_custom_range: bool
    eps: float = TORCH_EPS
    rounding: Rounding = field(default=Rounding.HALF_TO_EVEN, init=False)

    @classmethod
    def from_api(
        cls,
        *,
        dtype: str = "quint8",
        qscheme: str = "per_tensor_affine",
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = TORCH_EPS,
    ) -> TorchScheme:
        """Resolve PyTorch's observer arguments into a scheme.

        Raises:
            ConfigError: what PyTorch refuses (range without 0, qmin >= qmax, more than 256 codes
                for qint8, quint8 + symmetric + reduce_range), plus half-given custom ranges,
                which PyTorch silently ignores.
        """
        if dtype not in _TORCH_RANGES:
            raise ConfigError(f"dtype={dtype!r}: expected one of {', '.join(_TORCH_RANGES)}")
        if qscheme not in _TORCH_QSCHEMES:
            raise ConfigError(f"qscheme={qscheme!r}: expected one of {', '.join(_TORCH_QSCHEMES)}")
        symmetric = qscheme.endswith("symmetric")
        if symmetric and reduce_range and dtype == "quint8":
            raise ConfigError(
                "reduce_range is not supported with symmetric quint8 (PyTorch refuses it)"
            )
        if not eps > 0:
            raise ConfigError(f"eps={eps}: expected a positive number")
        if (quant_min is None) != (quant_max is None):
            raise ConfigError("quant_min and quant_max must be given together")
        if quant_min is not None and quant_max is not None:
            lo, hi = _torch_custom_range(dtype, quant_min, quant_max)
            if reduce_range:
                lo, hi = lo // 2, hi // 2
            return cls(dtype, symmetric, lo, hi, True, float(eps))
        default, reduced = _TORCH_RANGES[dtype]
        lo, hi = reduced if reduce_range else default
        return cls(dtype, symmetric, lo, hi, False, float(eps))

    @property
    def symmetric_zero_point(self) -> int:
        """Zero point of the symmetric scheme: 128 / midpoint for quint8, else 0 (§1.3)."""
        if self.dtype != "quint8":
            return 0
        return (self.quant_min + self.quant_max) // 2 if self.has_custom_range else 128

    def describe(self) -> str:
        """One line for reports."""
        kind = "symmetric" if self.symmetric else "affine"
        return (
            f"PyTorch {self.dtype} {kind} [{self.quant_min}, {self.quant_max}], round half to even"
        )


def _torch_custom_range(dtype: str, quant_min: int, quant_max: int) -> tuple[int, int]:
    if not quant_min <= 0 <= quant_max:
        raise ConfigError(f"quant_min={quant_min}, quant_max={quant_max}: the range must include 0")
    if quant_min >= quant_max:
        raise ConfigError(f"quant_min={quant_min} must be below quant_max={quant_max}")
    codes = quant_max - quant_min + 1
    if dtype == "qint8" and codes > 256:
        raise ConfigError(
            f"quant_min={quant_min}, quant_max={quant_max}: qint8 allows at most 256 codes"
        )
    if dtype == "qint32" and codes > 2**32:
        raise ConfigError(
            f"quant_min={quant_min}, quant_max={quant_max}: qint32 allows at most 2**32 codes"
        )
    return quant_min, quant_max


_HORIZON_RANGES: Mapping[str, tuple[int, int]] = {
    "qint4": (-8, 7),
    "quint4": (0, 15),
    "qint8": (-128, 127),
    "qint16": (-32768, 32767),
}


@dataclass(frozen=True)
class HorizonScheme:
    """Horizon ``FakeQuantize`` (SEMANTICS.md §5): always symmetric, zero point 0.

    ``scale = max(f32(max(max(-min, max), 0) / f32((qmax - qmin) / 2)), eps)``.
    """

    dtype: str
    quant_min: int
    quant_max: int
    rounding: Rounding
    eps: float = TORCH_EPS

    @classmethod
    def from_api(
        cls,
        *,
        dtype: str = "qint8",
        quant_min: int | None = None,
        quant_max: int | None = None,
        rounding: Rounding = Rounding.HALF_UP,
        eps: float = TORCH_EPS,
    ) -> HorizonScheme:
        """Resolve Horizon's arguments; a custom range must contain 0 and fit the dtype."""
        if dtype not in _HORIZON_RANGES:
            raise ConfigError(f"dtype={dtype!r}: expected one of {', '.join(_HORIZON_RANGES)}")
        lo, hi = _HORIZON_RANGES[dtype]
        qmin = lo if quant_min is None else quant_min
        qmax = hi if quant_max is None else quant_max
        if not (lo <= qmin <= 0 <= qmax <= hi and qmin < qmax):
            raise ConfigError(
                f"quant_min={qmin}, quant_max={qmax}: "
                f"must contain 0 and lie inside {dtype} [{lo}, {hi}]"
            )
        if not eps > 0:
            raise ConfigError(f"eps={eps}: expected a positive number")
        return cls(dtype, qmin, qmax, rounding, float(eps))

    def describe(self) -> str:
        """One line for reports."""
        grid = f"[{self.quant_min}, {self.quant_max}]"
        return f"Horizon {self.dtype} symmetric {grid}, {self.rounding.value}"


@dataclass(frozen=True)
class TFScheme:
    """TensorFlow ``quantize_and_dequantize_v2`` (SEMANTICS.md §2). Zero point always 0.

    The range is widened so that 0 is exact (§2.3); ``range_given`` makes the fake-quant clamp
    to the adjusted range (§2.4).
    """

    num_bits: int = 8
    signed_input: bool = True
    narrow_range: bool = False
    rounding: Rounding = Rounding.HALF_TO_EVEN
    range_given: bool = False

    def __post_init__(self) -> None:
        limit = 61 if self.signed_input else 62
        if not 1 <= self.num_bits <= limit:
            raise ConfigError(
                f"num_bits={self.num_bits}: "
                f"expected 1..{limit} with signed_input={self.signed_input}"
            )
        if self.rounding not in (Rounding.HALF_TO_EVEN, Rounding.HALF_UP):
            raise ConfigError(
                f"round_mode {self.rounding.value}: TensorFlow has HALF_TO_EVEN and HALF_UP"
            )

    @property
    def quant_min(self) -> int:
        """Lowest code: -2^(b-1) (+1 with narrow_range) signed, 0 unsigned (§2.1)."""
        if not self.signed_input:
            return 0
        return int(-(2 ** (self.num_bits - 1)) + (1 if self.narrow_range else 0))

    @property
    def quant_max(self) -> int:
        """Highest code: 2^(b-1)-1 signed, 2^b-1 unsigned."""
        return int(2 ** (self.num_bits - 1) - 1 if self.signed_input else 2**self.num_bits - 1)

    def describe(self) -> str:
        """One line for reports."""
        sign = "signed" if self.signed_input else "unsigned"
        grid = f"[{self.quant_min}, {self.quant_max}]"
        return f"TensorFlow {sign} {self.num_bits}-bit {grid}, {self.rounding.value}"


@dataclass(frozen=True)
class OneFlowScheme:
    """OneFlow ``MinMaxObserver``/``MovingAverageMinMaxObserver`` + ``FakeQuantization`` (§3).

    Attributes:
        formula: "google" or "cambricon" (power-of-two step, signed codes).
        quantization_bit: 2..8.
        symmetric: "symmetric" (signed codes) or "affine" (unsigned codes, float zero point).
        zero_point_rounding: rounding of the affine zero point: half to even for
            ``MinMaxObserver``, half away from zero for ``MovingAverageMinMaxObserver`` (§3.3).
    """

    formula: str = "google"
    quantization_bit: int = 8
    symmetric: bool = True
    zero_point_rounding: Rounding = Rounding.HALF_TO_EVEN
    rounding: Rounding = field(default=Rounding.HALF_TO_EVEN, init=False)

    def __post_init__(self) -> None:
        if self.formula not in ("google", "cambricon"):
            raise ConfigError(
                f"quantization_formula={self.formula!r}: expected 'google' or 'cambricon'"
            )
        if not 2 <= self.quantization_bit <= 8:
            raise ConfigError(f"quantization_bit={self.quantization_bit}: expected 2..8")
        if self.formula == "cambricon" and not self.symmetric:
            raise ConfigError(
                "the cambricon formula is symmetric; quantization_scheme='affine' does not apply"
            )

    @property
    def quant_min(self) -> int:
        """-2^(b-1) for symmetric and cambricon (the kernels' full range), 0 for affine."""
        return int(-(2 ** (self.quantization_bit - 1))) if self.symmetric else 0

    @property
    def quant_max(self) -> int:
        """2^(b-1)-1 for symmetric and cambricon, 2^b-1 for affine."""
        b = self.quantization_bit
        return int(2 ** (b - 1) - 1 if self.symmetric else 2**b - 1)

    def describe(self) -> str:
        """One line for reports."""
        kind = (
            "cambricon power-of-two"
            if self.formula == "cambricon"
            else ("symmetric" if self.symmetric else "affine")
        )
        grid = f"[{self.quant_min}, {self.quant_max}]"
        return f"OneFlow {kind} {self.quantization_bit}-bit {grid}, round half to even"


@dataclass(frozen=True)
class MindSporeScheme:
    """MindSpore ``FakeQuantWithMinMaxObserver`` DEFAULT mode (SEMANTICS.md §4.1, §4.3, §4.4).

    Codes are unsigned internally (``[narrow, 2^b-1]``); :class:`QParams` reports the documented
    signed range and zero point (unsigned minus 2^(b-1)), with the unsigned zero point and the
    nudged range in ``extras``. Rounds half up.
    """

    num_bits: int = 8
    symmetric: bool = False
    narrow_range: bool = False
    rounding: Rounding = field(default=Rounding.HALF_UP, init=False)

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 7, 8):
            raise ConfigError(f"MindSpore quantizes to 4, 7 or 8 bits, not {self.num_bits}")

    @property
    def unsigned_min(self) -> int:
        """Lowest internal (unsigned) code: 1 with narrow_range, else 0."""
        return 1 if self.narrow_range else 0

    @property
    def unsigned_max(self) -> int:
        """Highest internal code: 2^b - 1."""
        return int(2**self.num_bits - 1)

    @property
    def offset(self) -> int:
        """Unsigned code minus signed code: 2^(b-1)."""
        return int(2 ** (self.num_bits - 1))

    @property
    def quant_min(self) -> int:
        """Lowest signed code (-128, or -127 with narrow_range, for 8 bits)."""
        return self.unsigned_min - self.offset

    @property
    def quant_max(self) -> int:
        """Highest signed code."""
        return self.unsigned_max - self.offset

    def describe(self) -> str:
        """One line for reports."""
        kind = "symmetric" if self.symmetric else "asymmetric"
        grid = f"[{self.quant_min}, {self.quant_max}]"
        return f"MindSpore {kind} {self.num_bits}-bit {grid}, nudged zero point, round half up"


@dataclass(frozen=True)
class LearnedScaleScheme:
    """MindSpore LEARNED_SCALE mode (SEMANTICS.md §4.5): ``scale = maxq / Qmax``, zero point 0.

    ``maxq`` is taken from the statistics: ``max(-min, max)``, or ``max(max, 0)`` with
    ``neg_trunc``. ``neg_trunc=False`` needs ``narrow_range=True`` (Qmax = 2^(b-1)-1);
    ``neg_trunc=True`` needs ``narrow_range=False`` (Qmax = 2^b-1).
    """

    num_bits: int = 8
    neg_trunc: bool = False
    narrow_range: bool = True
    rounding: Rounding = field(default=Rounding.HALF_UP, init=False)

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 7, 8):
            raise ConfigError(f"MindSpore quantizes to 4, 7 or 8 bits, not {self.num_bits}")
        if self.neg_trunc == self.narrow_range:
            raise ConfigError(
                "LEARNED_SCALE needs narrow_range=True without neg_trunc "
                "and narrow_range=False with it"
            )

    @property
    def qmax_divisor(self) -> int:
        """Qmax: 2^b - 1 with neg_trunc, else 2^(b-1) - 1."""
        return int(2**self.num_bits - 1 if self.neg_trunc else 2 ** (self.num_bits - 1) - 1)

    @property
    def quant_min(self) -> int:
        """0 with neg_trunc, else -Qmax."""
        return 0 if self.neg_trunc else -self.qmax_divisor

    @property
    def quant_max(self) -> int:
        """Qmax."""
        return self.qmax_divisor

    def describe(self) -> str:
        """One line for reports."""
        grid = f"[{self.quant_min}, {self.quant_max}]"
        return f"MindSpore LEARNED_SCALE {self.num_bits}-bit {grid}, round half up"


Scheme = (
    TorchScheme | HorizonScheme | TFScheme | OneFlowScheme | MindSporeScheme | LearnedScaleScheme
)


# ---------------------------------------------------------------------------------------------
# parameter rules (one per scheme type)


def _require_ordered(stats: MinMaxStats) -> None:
    if np.any(stats.min > stats.max):  # NaN compares false and passes through
        raise DataError("statistics have min > max")


def _int64(values: np.ndarray) -> np.ndarray:
    """Integral float32 values as int64; non-finite entries (undefined in the API) become 0."""
    finite = np.isfinite(values)
    return np.where(finite, values, _F32(0.0)).astype(np.int64)


def _torch_qparams(stats: MinMaxStats, scheme: TorchScheme) -> QParams:
    """§1.3: 0 added to the range; symmetric ``max(-mn, mx) / ((qmax-qmin)/2)``, affine
    ``(mx - mn) / (qmax - qmin)`` with ``zp = clamp(qmin - rne(mn / s))``; both at least eps."""
    if stats.min.ndim == 0 and stats.min == np.inf and stats.max == -np.inf:
        # §1.3: an observer that saw nothing reports scale 1.0 and zero point 0.
        return QParams(_F32(1.0), np.int64(0), scheme.quant_min, scheme.quant_max, stats.axis)
    _require_ordered(stats)
    zero, eps = _F32(0.0), _F32(scheme.eps)
    mn, mx = np.minimum(stats.min, zero), np.maximum(stats.max, zero)
    qmin, qmax = scheme.quant_min, scheme.quant_max
    if scheme.symmetric:
        scale = np.maximum(np.maximum(-mn, mx) / _F32((qmax - qmin) / 2), eps)
        zero_point = np.full(scale.shape, scheme.symmetric_zero_point, dtype=np.int64)
    else:
        scale = np.maximum((mx - mn) / _F32(qmax - qmin), eps)
        zero_point = np.clip(qmin - _int64(np.rint(mn / scale)), qmin, qmax)
    return QParams(scale, zero_point, qmin, qmax, stats.axis)


def _horizon_qparams(stats: MinMaxStats, scheme: HorizonScheme) -> QParams:
    """§5.3: ``max(f32(max(max(-min, max), 0) / f32((qmax - qmin) / 2)), eps)``, zero point 0."""
    _require_ordered(stats)
    zero = _F32(0.0)
    half_range = _F32((scheme.quant_max - scheme.quant_min) / 2)
    magnitude = np.maximum(np.maximum(-stats.min, stats.max), zero)
    scale = np.maximum(magnitude / half_range, _F32(scheme.eps))
    zero_point = np.zeros(scale.shape, dtype=np.int64)
    return QParams(scale, zero_point, scheme.quant_min, scheme.quant_max, stats.axis)


def _tf_qparams(stats: MinMaxStats, scheme: TFScheme) -> QParams:
    """§2.3: the side needing the smaller multiplier keeps its end; the other is widened so
    that 0 is exact. Scale is the step; the kernel multiplies by ``multiplier``."""
    _require_ordered(stats)
    mn, mx = stats.min, stats.max
    qlo, qhi = _F32(scheme.quant_min), _F32(scheme.quant_max)
    m_lo = np.where(qlo * mn > 0, qlo / mn, _FLT_MAX)
    m_hi = np.where(qhi * mx > 0, qhi / mx, _FLT_MAX)
    use_lo = m_lo < m_hi  # the side needing the smaller multiplier keeps its end (§2.3)
    multiplier = np.where(use_lo, m_lo, m_hi).astype(_F32)
    step = np.where(use_lo, mn / qlo, mx / qhi).astype(_F32)
    adjusted_min = np.where(use_lo, mn, qlo * step).astype(_F32)
    adjusted_max = np.where(use_lo, qhi * step, mx).astype(_F32)
    extras = {"multiplier": multiplier, "adjusted_min": adjusted_min, "adjusted_max": adjusted_max}
    zero_point = np.zeros(step.shape, dtype=np.int64)
    return QParams(step, zero_point, scheme.quant_min, scheme.quant_max, stats.axis, extras)


def _oneflow_qparams(stats: MinMaxStats, scheme: OneFlowScheme) -> QParams:
    """§3.1/§3.3: symmetric ``max|x| / (2^(b-1)-1)``; affine ``(mx-mn) / (2^b-1)`` with the
    unclamped float ``zp = -R(mn / s)``; cambricon step ``2^(floor(log2 max|x|) - (b-2))``."""
    _require_ordered(stats)
    mn, mx = stats.min, stats.max
    b = scheme.quantization_bit
    extras: dict[str, np.ndarray] = {}
    if scheme.formula == "cambricon":
        shift = np.floor(np.log2(np.maximum(np.abs(mx), np.abs(mn)))) - _F32(b - 2)
        scale = _power_of_two(shift)
        zero_point = np.zeros(scale.shape, dtype=_F32)
        extras["shift"] = np.asarray(shift, dtype=_F32)
    elif scheme.symmetric:
        scale = np.maximum(np.abs(mx), np.abs(mn)) / _F32(2 ** (b - 1) - 1)
        zero_point = np.zeros(scale.shape, dtype=_F32)
    else:
        scale = (mx - mn) / _F32(2**b - 1)
        zero_point = -round_float32(mn / scale, scheme.zero_point_rounding)
    return QParams(
        scale,
        np.asarray(zero_point, dtype=_F32),
        scheme.quant_min,
        scheme.quant_max,
        stats.axis,
        extras,
    )


def _power_of_two(shift: np.ndarray) -> np.ndarray:
    """2**shift as float32 for an integral float32 shift; -inf -> 0, +inf -> inf, NaN -> NaN."""
    finite = np.isfinite(shift)
    exponent = np.clip(np.where(finite, shift, 0), -200, 200).astype(np.int64)
    power = np.ldexp(_F32(1.0), exponent).astype(_F32)
    return np.asarray(np.where(finite, power, np.exp2(shift)), dtype=_F32)


def _mindspore_qparams(stats: MinMaxStats, scheme: MindSporeScheme) -> QParams:
    """§4.3: nudged zero point on the unsigned grid, ``zp = rhu(clamp(qmin - mn/s))``."""
    _require_ordered(stats)
    zero = _F32(0.0)
    mn, mx = np.minimum(stats.min, zero), np.maximum(stats.max, zero)
    if scheme.symmetric:
        mx = np.maximum(-mn, mx)
        mn = -mx
    qmin, qmax = _F32(scheme.unsigned_min), _F32(scheme.unsigned_max)
    scale = (mx - mn) / (qmax - qmin)
    zp_from_min = qmin - mn / scale
    zero_point = round_float32(np.clip(zp_from_min, qmin, qmax), Rounding.HALF_UP)
    degenerate = scale == 0  # range [0, 0]: the CUDA guard gives zp = qmin and outputs 0 (§4.3)
    zero_point = np.where(degenerate, qmin, zero_point).astype(_F32)
    nudged_min = np.where(degenerate, zero, (qmin - zero_point) * scale).astype(_F32)
    nudged_max = np.where(degenerate, zero, (qmax - zero_point) * scale).astype(_F32)
    unsigned = _int64(zero_point)
    extras = {"zero_point_unsigned": unsigned, "nudged_min": nudged_min, "nudged_max": nudged_max}
    return QParams(
        scale, unsigned - scheme.offset, scheme.quant_min, scheme.quant_max, stats.axis, extras
    )


def _learned_scale_qparams(stats: MinMaxStats, scheme: LearnedScaleScheme) -> QParams:
    """§4.5: export ``scale = maxq / Qmax``, zero point 0; ``alpha = maxq`` for fake-quant."""
    _require_ordered(stats)
    zero = _F32(0.0)
    if scheme.neg_trunc:
        alpha = np.maximum(stats.max, zero)
    else:
        alpha = np.maximum(-stats.min, stats.max)
    scale = alpha / _F32(scheme.qmax_divisor)
    zero_point = np.zeros(scale.shape, dtype=np.int64)
    extras = {"alpha": np.asarray(alpha, dtype=_F32)}
    return QParams(scale, zero_point, scheme.quant_min, scheme.quant_max, stats.axis, extras)


_RULES: Mapping[type, Callable[[MinMaxStats, Any], QParams]] = {
    TorchScheme: _torch_qparams,
    HorizonScheme: _horizon_qparams,
    TFScheme: _tf_qparams,
    OneFlowScheme: _oneflow_qparams,
    MindSporeScheme: _mindspore_qparams,
    LearnedScaleScheme: _learned_scale_qparams,
}


def compute_qparams(stats: MinMaxStats, scheme: Scheme) -> QParams:
    """Scale and zero point of ``scheme`` for ``stats``: pure, deterministic, float32 throughout.

    Degenerate inputs give the API's IEEE result (a zero or infinite scale, a NaN or infinite
    zero point) rather than an error; the ONNX export replaces and reports them (§7).

    Raises:
        DataError: ``min > max`` in the statistics.
    """
    rule = _RULES.get(type(scheme))
    if rule is None:
        raise TypeError(f"no parameter rule for scheme {type(scheme).__name__}")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        return rule(stats, scheme)
