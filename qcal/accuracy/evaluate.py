"""Float model against quantized model: how far apart their outputs are, streamed over data.

Per output, with x the float output and y the quantized one, accumulated over all samples:
SQNR = 10·log10(Σx² / Σ(x−y)²) dB (None when the outputs are identical; for an output that
concatenates parts of different kinds or sizes, the worst part's: `qcal.accuracy.output_parts`),
cosine = Σxy / √(Σx²·Σy²), max abs error = max|x−y|; for an output of one row per sample
([N], [N, k]), its SQNR against its rows' variation, 10·log10(Σ(x−x̄)² / Σ(x−y)²) with x̄ the
mean row (`OutputAccumulator.variation_energy`); and, for outputs that hold decisions (`qcal.accuracy.decisions`: a
classifier's scores, a softmax per position, a sigmoid's yes/no), top-1 agreement = share of the
decisions that are the same; for probabilities (a sigmoid's map, a concatenated output's
probability parts) also the F1 of their yes decisions at 0.5, 2·|both yes| / (|float yes| +
|quantized yes|), once the float model calls at least MIN_YES_DECISIONS of them yes; for a
per-position output of rank 3, the share of samples whose sequence reads the same
(`qcal.accuracy.decision_counts.sequences_read_alike`). The outputs of a set of detections (the
boxes a NonMaxSuppression kept, with their scores and labels) are compared as a set instead,
by the F1 of their detections matched by IoU (`qcal.accuracy.detection_sets`). A token model's
outputs of one row per position are compared on its real tokens only, not where its attention
mask says padding (`qcal.accuracy.padding`). With labels
(one per sample), top-1 accuracy of both models on the per-sample classifier outputs. Only
running sums are kept, never the outputs.

Non-finite values (NaN, ±inf) are counted per output and model, and the sums run over the
elements both models computed finite. A quantized model that produces a non-finite value where
the float model does not is broken on that output whatever the other figures say: its worst SQNR
is -inf, so every gate and fallback target fails on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from qcal.accuracy._ahead import runs_ahead
from qcal.accuracy.decisions import decision_rules
from qcal.accuracy.detection_sets import DetectionCounts, as_detections
from qcal.accuracy.output_metrics import (
    MIN_YES_DECISIONS,
    OutputMetrics,
    floor_sqnr_applies,
    floor_sqnr_value,
)
from qcal.accuracy.output_parts import output_parts
from qcal.accuracy.output_sums import OutputAccumulator
from qcal.accuracy.padding import (
    PaddingCount,
    compared_positions,
    has_positions,
    label_among_real,
    measured_mask,
    real_pieces,
)
from qcal.accuracy.reference import FloatReference
from qcal.calibration.runtime import Feed, create_session
from qcal.graph.attention_masks import attention_mask
from qcal.graph.detections import detection_sets
from qcal.numerics.errors import DataError, ModelError, one_line

__all__ = [
    "MIN_YES_DECISIONS", "Comparison", "OutputMetrics", "compare_models", "floor_sqnr_applies",
    "floor_sqnr_value",
    "numeric_outputs",
]


# Every comparison of float and quantized models (this module, the localisation, sensitivity
# and the runnable check whose session the first evaluation reuses) runs onnxruntime on this
# many threads, whatever --threads says: its float kernels may sum in another order with more
# (a float Conv reading dequantized values did, in a detector head's quantized model), and
# neither the figures (reports, `qcal compare`) nor the fallback's choices may depend on it.
COMPARE_THREADS = 1


@dataclass(frozen=True)
class Comparison:
    samples: int
    outputs: tuple[OutputMetrics, ...]
    padding: PaddingCount | None = None  # positions an attention mask left out, if any

    def to_json(self) -> dict[str, object]:
        return {"samples": self.samples, "outputs": [o.to_json() for o in self.outputs],
                **({} if self.padding is None else {"padding": self.padding.to_json()})}

    @property
    def worst_sqnr_db(self) -> float | None:
        """The lowest output SQNR; -inf when an output is broken (see `OutputMetrics.broken`)."""
        return -math.inf if self.broken_outputs else self.worst_finite_sqnr_db()

    def worst_finite_sqnr_db(self, *, floor: bool = False) -> float | None:
        """The lowest SQNR over the elements both models computed finite (None: identical
        outputs); with `floor`, the floor's: over the outputs it applies to
        (`OutputMetrics.floor_sqnr`), each at the figure it holds (`floor_sqnr_db`)."""
        values = [o.floor_sqnr_db if floor else o.sqnr_db for o in self.outputs
                  if not floor or o.floor_sqnr]
        found = [v for v in values if v is not None]
        return min(found) if found else None

    @property
    def broken_outputs(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs if o.broken)


def numeric_outputs(model: onnx.ModelProto) -> list[str]:
    """The main graph's outputs compare_models compares (numbers, not strings or sequences), in
    the model's order."""
    return [o.name for o in model.graph.output if o.type.HasField("tensor_type")
            and o.type.tensor_type.elem_type != onnx.TensorProto.STRING]


def compare_models(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    batches: Iterable[tuple[Feed, int]],
    *,
    labels: np.ndarray | None = None,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    on_batch: Callable[[int], None] | None = None,
    reference: FloatReference | None = None,
    quant_session: Any = None,
) -> Comparison:
    """Run both models on every batch; labels (one int per sample, in data order) are optional.
    A `reference` shared by calls on the same float model, data and settings saves rerunning it;
    `quant_session`, a session already open on `quant_model` with these providers and
    COMPARE_THREADS threads, saves building it again. Both models run on COMPARE_THREADS."""
    reference = reference if reference is not None else FloatReference(budget_bytes=0)
    if reference.session is None:
        reference.session = create_session(float_model, providers=providers,
                                           threads=COMPARE_THREADS, what="float model")
        reference.rules = decision_rules(float_model)
        reference.parts = output_parts(float_model)
        reference.detections = detection_sets(float_model)
        reference.mask = attention_mask(float_model)
    float_session = reference.session
    if quant_session is None:
        quant_session = create_session(quant_model, providers=providers,
                                       threads=COMPARE_THREADS, what="quantized model")
    _check_same_outputs(float_session.get_outputs(), quant_session.get_outputs())
    # Numbers are compared; string and other non-numeric outputs are passed over.
    names = [o.name for o in float_session.get_outputs() if _numeric(o.type)]
    rules = reference.rules or {}
    accumulators = {name: OutputAccumulator(rule=rules.get(name), measure=name not in rules,
                                       parts=reference.parts.get(name, ()))
                    for name in names}
    sets = [d for d in reference.detections if {d.boxes, *d.others} <= set(names)]
    detections = {d.boxes: DetectionCounts() for d in sets}
    mask = reference.mask
    padding: PaddingCount | None = None  # once a batch's outputs have its positions
    samples, batch, replay = 0, -1, reference.holds_data
    runs = runs_ahead(quant_session, names, reference.feeds if replay else batches)
    try:
        for batch, (feed, n, quantized) in enumerate(runs):
            if not replay:  # held batches were checked when they were read
                _check_finite(feed, samples, n)
            try:
                x_outputs = reference.run(batch, names, feed)
                y_outputs = quantized.result()
            except Exception as err:  # noqa: BLE001  onnxruntime raises untyped exceptions
                # data that fits the inputs' declared shapes may still not fit the model (a
                # dimension only its weights fix): the data's fault, by sample
                which = f"sample {samples}" if n == 1 else f"samples {samples}-{samples + n - 1}"
                raise DataError(f"onnxruntime failed on evaluation {which}: "
                                f"{one_line(err)}") from None
            batch_labels = None
            if labels is not None:
                if samples + n > labels.shape[0]:
                    raise DataError(f"labels: only {labels.shape[0]} labels for more samples")
                batch_labels = labels[samples : samples + n]
            if mask is not None and not reference.mask_measured:
                reference.mask_measured, mask = measured_mask(
                    mask, feed, float_session, dict(zip(names, x_outputs)))
                reference.mask = mask
            valid = compared_positions(feed, mask)
            masked = frozenset() if mask is None else mask.outputs
            covered = False
            for name, x, y in zip(names, map(np.asarray, x_outputs), map(np.asarray, y_outputs)):
                if name in masked and valid is not None and has_positions(x, y, valid):
                    covered = True
                pieces = real_pieces(x, y, valid) if name in masked else None
                if pieces is None:
                    accumulators[name].add(x, y, batch_labels, n)
                    continue
                assert valid is not None  # the pieces' positions
                for i, x_piece, y_piece in pieces:
                    accumulators[name].add(x_piece, y_piece, None if batch_labels is None
                                           else label_among_real(batch_labels[i], valid[i],
                                                                 x.ndim), 1)
            if covered and mask is not None and valid is not None:
                padding = padding or PaddingCount(mask.input, mask.padding)
                padding.add(valid)
            if sets:  # a set's outputs read together, by name
                x_named = dict(zip(names, map(np.asarray, x_outputs)))
                y_named = dict(zip(names, map(np.asarray, y_outputs)))
                for found in sets:
                    detections[found.boxes].add(found, x_named, y_named, n)
            if not replay:
                reference.hold(batch, feed, n)
            samples += n
            if on_batch is not None:
                on_batch(n)
    finally:
        runs.close()
    if samples == 0:
        raise DataError("evaluation data has no samples")
    if labels is not None and labels.shape[0] != samples:
        raise DataError(f"labels: {labels.shape[0]} labels for {samples} samples")
    reference.holds_data = len(reference.feeds) == batch + 1 == len(reference.outputs)
    in_sets = {name for d in sets if not detections[d.boxes].unread
               for name in (d.boxes, *d.others)}
    return Comparison(samples, tuple(
        as_detections(accumulators[n].metrics(n), detections.get(n)) if n in in_sets
        else accumulators[n].metrics(n) for n in names),
        padding if padding is not None and padding.left_out else None)


def _check_finite(feed: Feed, first: int, n: int) -> None:
    """NaN in the evaluation inputs makes every figure meaningless: refuse it, naming where.
    Infinities are data: an attention mask of -inf (PyTorch's causal mask) is how a model is
    fed, and the outputs' own non-finite values are counted where they occur."""
    arrays = {name: np.asarray(value) for name, value in feed.items()}
    bad = [name for name, a in arrays.items() if a.dtype.kind in "fc" and np.isnan(a).any()]
    if bad:
        where = f"sample {first}" if n == 1 else f"samples {first}-{first + n - 1}"
        raise DataError(f"evaluation data: input {bad[0]!r} holds NaN values in "
                        f"{where} (0-based); the comparison would mean nothing")


def _numeric(onnx_type: str) -> bool:
    return onnx_type.startswith("tensor(") and onnx_type != "tensor(string)"


def _check_same_outputs(float_outputs: Sequence[Any], other_outputs: Sequence[Any]) -> None:
    """Both models must give the same outputs (names, element types, ranks), in any order."""
    theirs = {o.name: o for o in other_outputs}
    ours = {o.name for o in float_outputs}
    if missing := [o.name for o in float_outputs if o.name not in theirs]:
        raise ModelError(f"the second model has no output {missing[0]!r} "
                         f"(its outputs: {', '.join(sorted(theirs))})")
    if extra := sorted(set(theirs) - ours):
        raise ModelError(f"the second model has an output {extra[0]!r} the float model lacks")
    for output in float_outputs:
        other = theirs[output.name]
        if other.type != output.type:
            raise ModelError(f"output {output.name!r}: {output.type} in the float model, "
                             f"{other.type} in the second model")
        if len(output.shape) != len(other.shape):
            raise ModelError(f"output {output.name!r}: rank {len(output.shape)} in the float "
                             f"model, {len(other.shape)} in the second model")
