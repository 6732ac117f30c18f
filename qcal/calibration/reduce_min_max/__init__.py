"""Pass: compute the min and max of observed tensors inside the calibration model, so that only
a few numbers per tensor and batch leave onnxruntime.

Only the calibration model is rewritten this way (it is never written out). For each value the
pass adds, right after the node producing it (so onnxruntime reduces it while it is in cache and
frees it as in plain inference):

* ``ReduceMin``, ``ReduceMax`` and ``ReduceSumSquare``: over all axes per tensor, over all axes
  but the channel axis per channel (``axes`` an attribute before opset 18, an input from 18).
  onnxruntime's ReduceMin/ReduceMax drop a NaN unless it comes first, but a sum of squares is NaN
  exactly when a value is NaN (infinities give +inf, never NaN), so the three together give what
  numpy's ``min``/``max`` give, NaN included.
* Per tensor, the three results (``keepdims=1``) of up to 16 values of one rank are joined by
  a ``Concat`` into one output, ``[min_0, max_0, sumsq_0, min_1, ...]``: a few small arrays
  cross into Python. Per channel, each result is an output of its own (shape (C,)).

An empty tensor reduces to min = +inf > max = -inf (ONNX from opset 18, and onnxruntime before),
which no non-empty tensor gives: :func:`read_min_max` reports it as empty.

A value computed from another reduced value by a chain of Relu, Clip (constant bounds), and Add,
Sub, Mul or Div with a finite scalar constant (nonzero for the last two, the divisor for Div) is
not reduced at all: each of these float32 operations is correctly rounded (or exact) and
monotone, so its extremes are the chain applied to the source's extremes (swapped where it
decreases), bit for bit, with NaN exactly where the source has NaN (onnxruntime's Relu and Clip
keep NaN). On PP-OCR models that covers well over half of the observed values (hard-swish's
clip and division by 6, the scalar scale-and-shift after each activation).

Layout: `_rewrite` builds the graph (reductions, stacks, derivations found); `_layout` keeps the
bookkeeping and reads a run's outputs back.
"""

from __future__ import annotations

from qcal.calibration.reduce_min_max._layout import (
    MinMaxLayout,
    PerTensorExtremes,
    read_min_max,
    read_per_channel,
    read_per_tensor,
)
from qcal.calibration.reduce_min_max._rewrite import add_min_max_outputs

__all__ = [
    "MinMaxLayout",
    "PerTensorExtremes",
    "add_min_max_outputs",
    "read_min_max",
    "read_per_channel",
    "read_per_tensor",
]
