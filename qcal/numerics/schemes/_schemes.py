"""The scheme dataclasses: one frozen description of each API's integer grid and options.

Construction (``from_api`` or ``__post_init__``) checks the API's arguments, so the parameter
rules only ever see valid schemes. A scheme never sees statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qcal.numerics.errors import ConfigError
from qcal.numerics.schemes._qparams import TORCH_EPS, Rounding

__all__ = [
    "HorizonScheme",
    "LearnedScaleScheme",
    "MindSporeScheme",
    "OneFlowScheme",
    "Scheme",
    "TFScheme",
    "TorchScheme",
]


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
