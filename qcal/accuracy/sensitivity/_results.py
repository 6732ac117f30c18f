"""What sensitivity measures: one tensor's figures, the whole result, and the per-output sums
they are computed from while batches stream by."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qcal.accuracy.decision_counts import DecisionRule
from qcal.accuracy.padding import real_pieces
from qcal.numerics.sums import inner_product

__all__ = ["SensitivityResult", "TensorSensitivity", "noise_ratio_db"]


@dataclass(frozen=True)
class TensorSensitivity:
    """The effect of quantizing one tensor alone.

    Attributes:
        tensor: the tensor's name.
        role: "activation" or "weight".
        output_sqnr_db: worst model-output SQNR with only this tensor quantized (None: outputs
            unchanged).
        noise_ratio: worst output noise energy over signal energy (0.0: unchanged).
        top1_agreement: worst top-1 agreement of classifier-like outputs, None without any.
        local_sqnr_db: SQNR of the tensor against its fake-quant (None: quantized exactly).
        samples: samples the output figures were measured on (fewer than the result's when
            screening found the tensor harmless; None: not recorded).
        logit_noise_ratio: worst noise ratio over the logits of softmax outputs (None: no
            output is a softmax).
    """

    tensor: str
    role: str
    output_sqnr_db: float | None
    noise_ratio: float
    top1_agreement: float | None
    local_sqnr_db: float | None
    samples: int | None = None
    logit_noise_ratio: float | None = None

    @property
    def harm(self) -> float:
        """What screening and the fallback rank by: the logits' noise ratio, else the outputs'."""
        return self.noise_ratio if self.logit_noise_ratio is None else self.logit_noise_ratio

    def to_json(self) -> dict[str, object]:
        return {
            "tensor": self.tensor,
            "role": self.role,
            "output_sqnr_db": _round(self.output_sqnr_db),
            "noise_ratio": _round(self.noise_ratio),
            "top1_agreement": _round(self.top1_agreement),
            "local_sqnr_db": _round(self.local_sqnr_db),
            "samples": self.samples,
            "logit_noise_ratio": _round(self.logit_noise_ratio),
        }


@dataclass(frozen=True)
class SensitivityResult:
    """Sensitivity of every planned tensor, most harmful first. `method`: "alone" (each tensor
    quantized alone) or "error-jump" (`qcal.accuracy.localise`: the jump of the error where the
    tensor is read, in `noise_ratio`)."""

    samples: int
    tensors: tuple[TensorSensitivity, ...]
    method: str = "alone"

    def by_tensor(self) -> dict[str, TensorSensitivity]:
        return {t.tensor: t for t in self.tensors}

    def to_json(self) -> dict[str, object]:
        return {"samples": self.samples, "method": self.method,
                "tensors": [t.to_json() for t in self.tensors]}


# ---------------------------------------------------------------------------- accumulation


@dataclass
class _OutputNoise:
    signal: list[float]
    noise: list[float]
    agree: list[int]
    rows: list[int]
    rules: list[DecisionRule | None] = field(default_factory=list)
    real: int = 0  # the first `real` are model outputs, the rest softmax logits
    # per output, whether it is compared on the positions an attention mask keeps
    positions: tuple[bool, ...] = ()

    @classmethod
    def empty(cls, outputs: int, rules: list[DecisionRule | None],
              positions: tuple[bool, ...] = ()) -> _OutputNoise:
        """`rules`: per model output, how it is read (`qcal.accuracy.decisions`); the logits
        after them are read as scores. `positions`: per output, whether it is compared on
        the positions an attention mask does not leave out (`qcal.accuracy.padding`)."""
        real = len(rules)
        return cls([0.0] * outputs, [0.0] * outputs, [0] * outputs, [0] * outputs,
                   list(rules) + [DecisionRule()] * (outputs - real), real, positions)

    def add(self, reference: list[np.ndarray], quantized: list[np.ndarray],
            valid: np.ndarray | None = None) -> None:
        """One batch's outputs; `valid`: its positions to compare (None: all of them)."""
        for i, (x, y) in enumerate(zip(reference, quantized)):
            x, y = np.asarray(x), np.asarray(y)
            # logits [N, classes] have no positions, whatever their width
            masked = i < len(self.positions) and self.positions[i] \
                and (i < self.real or x.ndim >= 3)
            pieces = real_pieces(x, y, valid) if masked else None
            for x_piece, y_piece in [(x, y)] if pieces is None else [p[1:] for p in pieces]:
                self._add_one(i, x_piece, y_piece)

    def _add_one(self, i: int, x: np.ndarray, y: np.ndarray) -> None:
        x64 = np.asarray(x, dtype=np.float64).ravel()
        y64 = np.asarray(y, dtype=np.float64).ravel()
        rule = self.rules[i]
        if np.shape(x) != np.shape(y):
            # Another count (NonZero, a detector's boxes): nothing of the reference is
            # left, as the evaluation counts such a batch as decisions that all differ.
            x64 = x64[np.isfinite(x64)]
            lost = inner_product(x64, x64)
            self.signal[i] += lost
            self.noise[i] += lost
            if rule is not None and rule.applies(np.shape(x)):
                self.rows[i] += rule.count(np.asarray(x), np.asarray(x))[1]
            return
        both = np.isfinite(x64) & np.isfinite(y64)
        if not both.all():  # as in the evaluation: sums over what both compute finite,
            if np.any(np.isfinite(x64) & ~np.isfinite(y64)):  # and a value made non-finite
                self.noise[i] = math.inf                     # is unbounded harm
            x64, y64 = x64[both], y64[both]
        d = x64 - y64
        self.signal[i] += inner_product(x64, x64)
        self.noise[i] += inner_product(d, d)
        if rule is not None and not rule.applies(np.shape(x)):
            rule = self.rules[i] = None
        if rule is not None:
            agree, decisions, _ = rule.count(np.asarray(x), np.asarray(y))
            self.agree[i] += agree
            self.rows[i] += decisions

    def worst_ratio(self, logits: bool = False) -> float:
        chosen = slice(self.real, None) if logits else slice(0, self.real)
        ratios = [n / s if s > 0 else (0.0 if n == 0 else math.inf)
                  for s, n in zip(self.signal[chosen], self.noise[chosen])]
        return max(ratios, default=0.0)

    def harm(self) -> float:
        return self.worst_ratio(logits=len(self.signal) > self.real)

    def result(self, tensor: str, role: str, local_signal: float,
               local_noise: float, samples: int | None = None) -> TensorSensitivity:
        worst = self.worst_ratio()
        agreements = [a / r for a, r, c in zip(self.agree[:self.real], self.rows[:self.real],
                                                 self.rules[:self.real]) if c is not None and r]
        return TensorSensitivity(
            tensor=tensor,
            role=role,
            output_sqnr_db=noise_ratio_db(worst),
            noise_ratio=worst,
            top1_agreement=min(agreements) if agreements else None,
            local_sqnr_db=noise_ratio_db(local_noise / local_signal if local_signal > 0 else
                                         (0.0 if local_noise == 0 else math.inf)),
            samples=samples,
            logit_noise_ratio=self.worst_ratio(logits=True) if len(self.signal) > self.real
            else None,
        )


def noise_ratio_db(noise_ratio: float) -> float | None:
    """A noise/signal ratio as SQNR in dB: None for no noise, -inf for unbounded noise."""
    if noise_ratio == 0.0:
        return None
    if math.isinf(noise_ratio):
        return -math.inf
    return -10.0 * math.log10(noise_ratio)


def _round(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None if value is None or math.isnan(value) else (-1e9 if value < 0 else 1e9)
    return float(f"{value:.6g}")
