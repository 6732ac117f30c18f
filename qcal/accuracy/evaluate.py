"""Float model against quantized model: how far apart their outputs are, streamed over data.

Per output, with x the float output and y the quantized one, accumulated over all samples:
SQNR = 10·log10(Σx² / Σ(x−y)²) dB (None when the outputs are identical), cosine = Σxy / √(Σx²·Σy²),
max abs error = max|x−y|, and, for classifier-like outputs (rank 2, at least 2 classes), top-1
agreement = share of samples whose argmax over the last axis is the same. With labels, top-1
accuracy of both models against them. Only running sums are kept, never the outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from qcal.calibration.runtime import create_session
from qcal.numerics.errors import DataError

__all__ = ["Comparison", "OutputMetrics", "compare_models", "is_classifier_like"]

Feed = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class OutputMetrics:
    name: str
    sqnr_db: float | None
    cosine: float
    max_abs_error: float
    top1_agreement: float | None
    float_accuracy: float | None = None
    quantized_accuracy: float | None = None

    def to_json(self) -> dict[str, float | str | None]:
        return {
            "name": self.name,
            "sqnr_db": _round(self.sqnr_db),
            "cosine": _round(self.cosine),
            "max_abs_error": _round(self.max_abs_error),
            "top1_agreement": _round(self.top1_agreement),
            "float_accuracy": _round(self.float_accuracy),
            "quantized_accuracy": _round(self.quantized_accuracy),
        }


@dataclass(frozen=True)
class Comparison:
    samples: int
    outputs: tuple[OutputMetrics, ...]

    def to_json(self) -> dict[str, object]:
        return {"samples": self.samples, "outputs": [o.to_json() for o in self.outputs]}

    @property
    def worst_sqnr_db(self) -> float | None:
        values = [o.sqnr_db for o in self.outputs if o.sqnr_db is not None]
        return min(values) if values else None


def _round(value: float | None) -> float | None:
    # Reports are compared byte for byte across runs; 9 significant digits hide summation noise
    # that does not exist anyway (sums are sequential) while keeping float32-level detail.
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.9g}")


def is_classifier_like(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[1] >= 2


@dataclass
class _Accumulator:
    signal: float = 0.0
    noise: float = 0.0
    dot: float = 0.0
    quant_energy: float = 0.0
    max_abs: float = 0.0
    agree: int = 0
    rows: int = 0
    classifier: bool = True
    correct_float: int = 0
    correct_quant: int = 0
    labelled: int = 0
    shapes: set[tuple[int, ...]] = field(default_factory=set)

    def add(self, x: np.ndarray, y: np.ndarray, labels: np.ndarray | None) -> None:
        x64 = x.astype(np.float64, copy=False).ravel()
        y64 = y.astype(np.float64, copy=False).ravel()
        diff = x64 - y64
        self.signal += float(x64 @ x64)
        self.noise += float(diff @ diff)
        self.dot += float(x64 @ y64)
        self.quant_energy += float(y64 @ y64)
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(diff))))
        self.classifier = self.classifier and is_classifier_like(x.shape)
        if self.classifier:
            fx, fy = np.argmax(x, axis=-1), np.argmax(y, axis=-1)
            self.agree += int(np.sum(fx == fy))
            self.rows += int(fx.size)
            if labels is not None:
                if labels.shape[0] != fx.shape[0]:
                    raise DataError(
                        f"labels: {labels.shape[0]} labels for a batch of {fx.shape[0]} outputs"
                    )
                self.correct_float += int(np.sum(fx == labels))
                self.correct_quant += int(np.sum(fy == labels))
                self.labelled += int(labels.shape[0])

    def metrics(self, name: str) -> OutputMetrics:
        sqnr = None if self.noise == 0.0 else 10.0 * math.log10(max(self.signal, 1e-300) / self.noise)
        denom = math.sqrt(self.signal * self.quant_energy)
        cosine = 1.0 if denom == 0.0 and self.noise == 0.0 else (self.dot / denom if denom else 0.0)
        agreement = self.agree / self.rows if self.classifier and self.rows else None
        has_labels = self.classifier and self.labelled > 0
        return OutputMetrics(
            name=name,
            sqnr_db=sqnr,
            cosine=cosine,
            max_abs_error=self.max_abs,
            top1_agreement=agreement,
            float_accuracy=self.correct_float / self.labelled if has_labels else None,
            quantized_accuracy=self.correct_quant / self.labelled if has_labels else None,
        )


def compare_models(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    batches: Iterable[tuple[Feed, int]],
    *,
    labels: np.ndarray | None = None,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> Comparison:
    """Run both models on every batch; labels (one int per sample, in data order) are optional."""
    float_session = create_session(float_model, providers=providers, threads=threads,
                                   what="float model")
    quant_session = create_session(quant_model, providers=providers, threads=threads,
                                   what="quantized model")
    names = [o.name for o in float_session.get_outputs()]
    accumulators = {name: _Accumulator() for name in names}
    samples = 0
    for feed, n in batches:
        x_outputs = float_session.run(names, dict(feed))
        y_outputs = quant_session.run(names, dict(feed))
        batch_labels = None
        if labels is not None:
            if samples + n > labels.shape[0]:
                raise DataError(f"labels: only {labels.shape[0]} labels for more samples")
            batch_labels = labels[samples : samples + n]
        for name, x, y in zip(names, x_outputs, y_outputs):
            accumulators[name].add(np.asarray(x), np.asarray(y), batch_labels)
        samples += n
        if on_batch is not None:
            on_batch(n)
    if samples == 0:
        raise DataError("evaluation data has no samples")
    if labels is not None and labels.shape[0] != samples:
        raise DataError(f"labels: {labels.shape[0]} labels for {samples} samples")
    return Comparison(samples, tuple(accumulators[n].metrics(n) for n in names))
