"""Entropy range selection: the |x| threshold minimizing the KL divergence (TensorRT-style).

The divergences of all candidate thresholds are computed at once from prefix sums of the
re-binned |x| histogram (:func:`entropy_divergences`), in chunks that bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._distribution import abs_distribution
from qcal.numerics.histogram._result import RangeSelection, _check_bins, _clip_to, _selection
from qcal.numerics.histogram._snapshot import Histogram

__all__ = ["KL_SMOOTHING", "entropy_divergences", "entropy_range"]

# Counts put on each empty bin of P and Q before the KL divergence (onnxruntime's epsilon).
KL_SMOOTHING = 1e-4
# Candidate chunk for the KL search: bounds its (candidates x quantized_bins) work arrays.
_KL_CHUNK_ELEMENTS = 1 << 20


def entropy_range(
    histogram: Histogram,
    *,
    bins: int = 2048,
    quantized_bins: int = 128,
    smoothing: float = KL_SMOOTHING,
) -> RangeSelection:
    """TensorRT-style entropy calibration: the |x| threshold minimizing KL(P || Q).

    The |x| distribution is re-binned into ``bins`` equal bins over ``[0, max|x|]``; for every
    candidate ``i`` in ``quantized_bins..bins`` (see :func:`entropy_divergences`) the divergence
    between the clipped reference P and its ``quantized_bins``-level quantization Q is computed;
    the threshold is the upper edge of bin ``i - 1`` of the best candidate, ``t = i * max|x| /
    bins``. Exact zeros are left out of P (they quantize exactly whatever the threshold, and a
    ReLU's spike at zero would otherwise dominate the search). The range is the observed one
    clipped to ``[-t, t]``. ``smoothing`` is the count
    put on empty bins (onnxruntime's 1e-4); it is what lets isolated outliers be clipped.

    Raises:
        ConfigError: bin counts with ``2 <= quantized_bins <= bins`` violated.
    """
    _check_bins(bins, quantized_bins)
    lows, highs, clipped, thresholds, divergences = [], [], [], [], []
    for channel in range(histogram.channels):
        low, high = float(histogram.min[channel]), float(histogram.max[channel])
        top = max(-low, high)
        if top == 0.0:
            t, kl, outside = 0.0, 0.0, 0.0
        else:
            distribution = abs_distribution(histogram, channel)
            counts = distribution.histogram(0.0, top, bins)
            # Exact zeros (the spike after a ReLU) are exact under every scheme, so they carry no
            # quantization error; left in, they dominate P and the search clips real values.
            zeros = float(distribution.mass[distribution.hi == 0.0].sum())
            counts[0] = max(float(counts[0]) - zeros, 0.0)
            kl_all = entropy_divergences(counts, quantized_bins, smoothing=smoothing)
            # Ties go to the largest candidate (least clipping), as pytorch-quantization does.
            best = kl_all.size - 1 - int(np.argmin(kl_all[::-1]))
            edge = quantized_bins + best
            t = top if edge == bins else top * edge / bins
            kl = float(kl_all[best])
            total = float(counts.sum()) + zeros
            outside = float(counts[edge:].sum()) / total if total > 0 else 0.0
        lo, hi = _clip_to(low, high, -t, t)
        lows.append(lo)
        highs.append(hi)
        thresholds.append(t)
        divergences.append(kl)
        clipped.append(outside)
    details = {
        "bins": bins,
        "quantized_bins": quantized_bins,
        "smoothing": smoothing,
        "threshold": thresholds,
        "kl_divergence": divergences,
    }
    return _selection("entropy", histogram, lows, highs, clipped, details)


def entropy_divergences(
    counts: np.ndarray,
    quantized_bins: int = 128,
    *,
    smoothing: float = KL_SMOOTHING,
    table: bool = True,
) -> np.ndarray:
    """KL(P_i || Q_i) for every candidate ``i = quantized_bins .. len(counts)``.

    With ``b`` the bin counts (|x|, bin 0 at zero), ``T = sum(b)`` and candidate ``i``:

    * reference ``P_i = b[:i]`` with the outliers ``sum(b[i:])`` added to ``P_i[i-1]``;
    * bin ``j < i`` belongs to quantized bin ``g = floor(j * quantized_bins / i)`` (the
      proportional mapping of NVIDIA's pytorch-quantization, TensorRT's calibrator);
      ``Q_i[j] = S_g / N_g`` for ``b[j] > 0`` and 0 otherwise, where ``S_g`` sums ``b`` over the
      group (outliers excluded) and ``N_g`` counts its non-empty bins;
    * smoothing as onnxruntime's (MXNet's) ``smooth_distribution``: every empty bin of P and of
      Q gets ``smoothing`` counts (1e-4). onnxruntime takes the same total back from the
      non-empty bins, equally; that can turn the fractional counts of a re-binned histogram
      negative, and normalisation makes it unnecessary, so here it is left out;
    * ``KL = sum_j p_j log(p_j / q_j)`` with p, q the normalised smoothed P, Q; +inf when
      ``b[:i]`` is empty (onnxruntime's "all entries are 0" case). With ``smoothing=0``,
      +inf also where ``p_j > 0 = q_j`` (outliers piled on an empty last bin).

    Vectorized: all candidates at once from prefix sums of ``b``, ``b log b`` and of empty
    bins (in chunks that bound memory); each group's term is computed once for all the
    candidates that share the group (see :class:`_GroupTable`).

    Args:
        counts: non-negative float bin counts, ``len(counts) >= quantized_bins``.
        quantized_bins: number of quantization levels of the candidate Q.
        smoothing: counts put on empty bins.
        table: share the group terms between candidates; False computes them per candidate
            (the same numbers, more slowly; kept for checking the table).

    Returns:
        float64 array of ``len(counts) - quantized_bins + 1`` divergences.
    """
    b = np.asarray(counts, dtype=np.float64).ravel()
    _check_bins(b.size, quantized_bins)
    if not smoothing >= 0:
        raise ConfigError(f"entropy smoothing {smoothing} must be >= 0")
    with np.errstate(divide="ignore", invalid="ignore"):
        b_log_b = np.where(b > 0, b * np.log(np.where(b > 0, b, 1.0)), 0.0)
    prefix = _Prefix(
        b=b,
        total=np.concatenate([[0.0], np.cumsum(b)]),
        b_log_b=np.concatenate([[0.0], np.cumsum(b_log_b)]),
        nonzero=np.concatenate([[0], np.cumsum(b > 0)]),
        smoothing=float(smoothing),
    )
    candidates = np.arange(quantized_bins, b.size + 1)
    groups = _GroupTable.build(prefix, quantized_bins) if table else None
    out = np.empty(candidates.size, dtype=np.float64)
    step = max(1, _KL_CHUNK_ELEMENTS // (quantized_bins + 1))
    for first in range(0, candidates.size, step):
        chunk = candidates[first : first + step]
        out[first : first + step] = _kl_chunk(prefix, chunk, quantized_bins, groups)
    return out


@dataclass(frozen=True)
class _Prefix:
    b: np.ndarray  # bin counts
    total: np.ndarray  # exclusive prefix sums of b (length B + 1)
    b_log_b: np.ndarray  # of b log b
    nonzero: np.ndarray  # of (b > 0)
    smoothing: float


@dataclass(frozen=True)
class _GroupTable:
    """Per-group terms of :func:`_kl_chunk` for every group a candidate can have.

    The group of bins ``[s, s + w)`` has the same level ``S/N`` and term ``S log(S/N)`` in every
    candidate it belongs to, and a candidate ``i`` only has groups of width ``floor(i/levels)``
    or ``ceil(i/levels)``: the (start, width) pairs number ``(B + 1) * (B // levels + 2)``,
    about 7x fewer than the groups of all candidates (``(B - levels + 1) * levels``), so each
    logarithm is taken once and the candidates look their terms up. Entry ``s * stride + w``;
    the values are those :func:`_kl_chunk` computes per candidate, operation for operation.
    """

    stride: int
    level: np.ndarray  # S/N (1.0 for a group without non-empty bins)
    log_level: np.ndarray
    term: np.ndarray  # S * log(S/N)

    @classmethod
    def build(cls, prefix: _Prefix, levels: int) -> _GroupTable | None:
        bins = prefix.b.size
        stride = bins // levels + 2  # widths 0 .. ceil(bins / levels)
        if (bins + 1) * stride * 4 > (bins - levels + 1) * levels:
            return None  # few candidates for many bins: not worth a table
        starts = np.arange(bins + 1)[:, None]
        ends = np.minimum(starts + np.arange(stride)[None, :], bins)
        group_sum = prefix.total[ends] - prefix.total[starts]
        group_nonzero = prefix.nonzero[ends] - prefix.nonzero[starts]
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(group_nonzero > 0, group_sum / group_nonzero, 1.0)
            log_level = np.log(level)
            term = group_sum * log_level
        return cls(stride, level.ravel(), log_level.ravel(), term.ravel())


def _kl_chunk(
    prefix: _Prefix, ends: np.ndarray, levels: int, groups: _GroupTable | None = None
) -> np.ndarray:
    """KL for candidates ``ends`` (each i): closed forms over prefix sums, no loop over bins.

    With `groups`, the per-group terms are looked up rather than computed (same values).
    """
    eps = prefix.smoothing
    # Group g of candidate i covers bins [ceil(g*i/levels), ceil((g+1)*i/levels)).
    if groups is not None:
        # Integer arithmetic in int32 where it cannot overflow (exact, and half the memory
        # traffic of int64): the starts, then each group's entry s * stride + width.
        limit = max(levels * int(ends[-1]) + levels, (int(ends[-1]) + 1) * groups.stride)
        int_type = np.int32 if limit < 2**31 else np.int64
        starts = (
            np.arange(levels + 1, dtype=int_type)[None, :] * ends.astype(int_type)[:, None]
            + int_type(levels - 1)
        ) // int_type(levels)
        keys = starts[:, :-1] * int_type(groups.stride - 1) + starts[:, 1:]
        terms = groups.term[keys].sum(axis=1)
        last_level = groups.level[keys[:, -1]]
        last_log_level = groups.log_level[keys[:, -1]]
    else:
        starts = (np.arange(levels + 1)[None, :] * ends[:, None] + levels - 1) // levels
        group_sum = prefix.total[starts[:, 1:]] - prefix.total[starts[:, :-1]]
        group_nonzero = prefix.nonzero[starts[:, 1:]] - prefix.nonzero[starts[:, :-1]]
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(group_nonzero > 0, group_sum / group_nonzero, 1.0)  # Q per group
            terms = (group_sum * np.log(level)).sum(axis=1)
            last_level = level[:, -1]
            last_log_level = np.log(last_level)
    total = prefix.total[-1]
    kept = prefix.total[ends]  # sum of Q_i before smoothing: b[:i]
    head = ends - 1  # bins j <= i-2 are "head" bins, j = i-1 is the last bin
    last_b = prefix.b[head]
    head_empty = head - prefix.nonzero[head]  # empty bins among j <= i-2: P = Q = 0 there
    with np.errstate(divide="ignore", invalid="ignore"):
        last_p = last_b + (total - kept)
        last_q = np.where(last_b > 0, last_level, 0.0)
        # Normalisers of the smoothed P and Q: empty bins carry eps each.
        norm_p = total + eps * (head_empty + (last_p == 0))
        norm_q = kept + eps * (head_empty + (last_q == 0))
        # Non-empty head bins: sum_j b_j [log b_j - log norm_p - log(S_g/N_g) + log norm_q].
        group_term = terms - last_b * last_log_level
        head_mass = prefix.total[head]
        log_norm_p, log_norm_q = np.log(norm_p), np.log(norm_q)
        full = (
            prefix.b_log_b[head] - head_mass * (log_norm_p - log_norm_q) - group_term
        ) / norm_p
        # Empty head bins: p = eps/norm_p, q = eps/norm_q.
        empty = head_empty * eps / norm_p * (log_norm_q - log_norm_p)
        p = np.where(last_p > 0, last_p, eps) / norm_p
        q = np.where(last_q > 0, last_q, eps) / norm_q
        last = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
        last = np.where((p > 0) & (q == 0), np.inf, last)
        kl = full + empty + last
    return np.where(kept > 0, kl, np.inf)
