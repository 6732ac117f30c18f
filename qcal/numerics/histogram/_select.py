"""Range selection from a histogram: percentile, entropy (KL divergence) and mse.

Each method is a pure function of a :class:`~qcal.numerics.histogram.Histogram` that returns a
:class:`RangeSelection`; its ``stats`` is a :class:`~qcal.numerics.observers.MinMaxStats` that goes through
the preset's ``compute_qparams`` like a min-max range, so every preset works with every method.
Work is vectorized over candidates and bins; only channels are looped over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._distribution import (
    Distribution,
    abs_distribution,
    signed_distribution,
)
from qcal.numerics.histogram._observer import Histogram
from qcal.numerics.observers import MinMaxStats

__all__ = [
    "KL_SMOOTHING",
    "RANGE_METHODS",
    "QuantRecipe",
    "RangeSelection",
    "entropy_divergences",
    "entropy_range",
    "mse_range",
    "percentile_range",
    "select_range",
]

RANGE_METHODS = ("percentile", "entropy", "mse")

# mse search, in log2 of the fraction of the observed extent kept on a side: (half width of the
# grid around the previous best or None for the whole span, step). 1-D: 49 + 33 candidates;
# 2-D: 13 x 13 + 3 x 9 x 9. The last stage's step, 1/64 octave, is ~1.1 % of the range.
_STAGES_1D = ((None, 0.25), (0.25, 1.0 / 64))
_STAGES_2D = ((None, 1.0), (1.0, 0.25), (0.25, 1.0 / 16), (1.0 / 16, 1.0 / 64))
# Counts put on each empty bin of P and Q before the KL divergence (onnxruntime's epsilon).
KL_SMOOTHING = 1e-4
# Candidate chunk for the KL search: bounds its (candidates x quantized_bins) work arrays.
_KL_CHUNK_ELEMENTS = 1 << 20


class QuantRecipe(Protocol):
    """What mse needs from a preset's tensor recipe (``qcal.numerics.presets.TensorRecipe`` has it)."""

    def qparams(self, stats: MinMaxStats) -> Any:
        """Quantization parameters for a range (per channel for (C,) statistics)."""
        ...

    def fake_quantize(self, x: np.ndarray, qparams: Any) -> np.ndarray:
        """Float32 fake-quantized x, bit-exact to the API."""
        ...


@dataclass(frozen=True, eq=False)
class RangeSelection:
    """A range chosen from a histogram, with what the report shows about it.

    Attributes:
        method: "percentile", "entropy" or "mse".
        stats: the chosen range, to give to ``compute_qparams`` (shape () or (C,)).
        observed: the exact extremes of the data.
        clipped_fraction: float64 (C,), fraction of the values outside the chosen range.
        details: JSON-ready method specifics (parameters, thresholds, divergences, errors).
        histogram_bins: int64 (C,), occupied fixed-resolution bins per channel.
        values: int64 (C,), values observed per channel.
        relative_resolution: the histogram's relative bin width.
    """

    method: str
    stats: MinMaxStats
    observed: MinMaxStats
    clipped_fraction: np.ndarray
    details: Mapping[str, Any]
    histogram_bins: np.ndarray
    values: np.ndarray
    relative_resolution: float

    @property
    def summary(self) -> dict[str, Any]:
        """JSON-ready summary for the report (lists have one entry per channel)."""
        return {
            "method": self.method,
            "histogram": {
                "min": _floats(self.observed.min),
                "max": _floats(self.observed.max),
                "values": [int(v) for v in self.values],
                "bins": [int(v) for v in self.histogram_bins],
                "relative_resolution": self.relative_resolution,
            },
            "clipped_fraction": _floats(self.clipped_fraction),
            **self.details,
        }


# ---------------------------------------------------------------------------------------------
# percentile


def percentile_range(
    histogram: Histogram, percentile: float = 99.99, *, symmetric: bool = True
) -> RangeSelection:
    """Range holding ``percentile`` % of the values.

    * symmetric: ``t`` = the percentile of |x|; the range is the observed one clipped to
      ``[-t, t]``.
    * two-sided: ``[q((100 - p) / 2), q((100 + p) / 2)]`` of x: (100 - p) / 2 % is clipped on
      each side.

    Quantiles are read from the piecewise-linear model of the histogram (see
    ``qcal.numerics.histogram._distribution``): the result lies inside the fixed bin of the order
    statistic of rank ``ceil(p * n / 100)``, within 2**-mantissa_bits of it relatively.

    Raises:
        ConfigError: percentile outside (0, 100].
    """
    p = float(percentile)
    if not 0.0 < p <= 100.0:
        raise ConfigError(f"percentile: {percentile} is not in (0, 100]")
    lows, highs, clipped, thresholds = [], [], [], []
    for channel in range(histogram.channels):
        low, high = float(histogram.min[channel]), float(histogram.max[channel])
        if symmetric:
            dist = abs_distribution(histogram, channel)
            t = float(dist.quantile(p / 100.0 * dist.total))
            thresholds.append(t)
            lo, hi = _clip_to(low, high, -t, t)
        else:
            dist = signed_distribution(histogram, channel)
            total = dist.total
            lo = float(dist.quantile((100.0 - p) / 200.0 * total))
            hi = float(dist.quantile((100.0 + p) / 200.0 * total))
        lows.append(lo)
        highs.append(hi)
        clipped.append(_outside(signed_distribution(histogram, channel), lo, hi))
    details: dict[str, Any] = {"percentile": p, "symmetric": symmetric}
    if symmetric:
        details["threshold"] = thresholds
    return _selection("percentile", histogram, lows, highs, clipped, details)


# ---------------------------------------------------------------------------------------------
# entropy


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


# ---------------------------------------------------------------------------------------------
# mse


def mse_range(
    histogram: Histogram,
    recipe: QuantRecipe,
    *,
    points: int = 1024,
    tail_points: int = 128,
    span_octaves: float = 12.0,
    symmetric: bool | None = None,
) -> RangeSelection:
    """The range minimizing the expected squared fake-quantization error of the actual scheme.

    For a candidate range ``[lo, hi]`` the error is ``sum_k m_k (x_k - fq(x_k))**2`` where
    ``fq`` is ``recipe.fake_quantize`` with ``recipe.qparams(MinMaxStats(lo, hi))`` and the
    ``x_k`` are the centres of ``points`` equal bins over ``[lo, hi]`` plus ``tail_points`` over
    each clipped tail (``[min, lo]``, ``[hi, max]``), ``m_k`` their masses. Bins are laid per
    candidate, so the in-range grid is ~4 bins per step of an 8-bit scheme however far the
    range shrinks (finer schemes, e.g. 16-bit, see a coarser grid).

    Candidates keep a fraction ``2**u`` (``-span_octaves <= u <= 0``) of the observed extent on
    each side of 0 (or of the end nearer 0 when 0 is outside the data):

    * schemes whose parameters depend only on ``max|x|`` (checked on the observed range unless
      ``symmetric`` is given): one threshold ``t``, range = observed clipped to ``[-t, t]``;
      a 1/4-octave grid, then a 1/64-octave grid around the best;
    * otherwise both sides independently: 13 x 13 one-octave grid, then three 9 x 9 grids at
      1/4, 1/16, 1/64 octave around the best.

    All candidates of a stage go to ``recipe`` as one per-channel batch (candidates on axis 0).
    Ties go to the widest range.

    Raises:
        ConfigError: points or tail_points < 1, or span_octaves <= 0.
    """
    if points < 1 or tail_points < 1 or not span_octaves > 0:
        raise ConfigError(
            f"mse: points={points}, tail_points={tail_points} must be >= 1 and "
            f"span_octaves={span_octaves} > 0"
        )
    grid = _MseGrid(points, tail_points)
    lows, highs, clipped, errors, minmax_errors, modes = [], [], [], [], [], []
    grid_lows, grid_highs = [], []
    for channel in range(histogram.channels):
        low, high = float(histogram.min[channel]), float(histogram.max[channel])
        dist = signed_distribution(histogram, channel)
        if low == high:
            choice, mode = _MseChoice(low, high, 0.0, 0.0, low, high), "constant"
        else:
            amax_only = _depends_on_amax_only(recipe, low, high) if symmetric is None else symmetric
            choice = _mse_search(dist, low, high, recipe, grid, span_octaves, amax_only)
            mode = "symmetric" if amax_only else "asymmetric"
        lows.append(choice.lo)
        highs.append(choice.hi)
        grid_lows.append(choice.grid_lo)
        grid_highs.append(choice.grid_hi)
        clipped.append(_outside(dist, choice.grid_lo, choice.grid_hi))
        errors.append(choice.error / dist.total)
        minmax_errors.append(choice.error_minmax / dist.total)
        modes.append(mode)
    details = {
        "points": points,
        "tail_points": tail_points,
        "search": modes,
        "representable_min": grid_lows,
        "representable_max": grid_highs,
        "mse": errors,
        "mse_minmax": minmax_errors,
    }
    return _selection("mse", histogram, lows, highs, clipped, details)


@dataclass(frozen=True)
class _MseGrid:
    points: int
    tail_points: int

    def errors(
        self,
        dist: Distribution,
        low: float,
        high: float,
        lo: np.ndarray,
        hi: np.ndarray,
        recipe: QuantRecipe,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expected squared error (total, not per value) of each candidate [lo_k, hi_k].

        Returns:
            (errors, grid_lo, grid_hi): float64 (K,) errors and the ends of each candidate's
            representable range (its integer grid in real units).
        """
        lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
        qparams = recipe.qparams(MinMaxStats(lo32, hi32, axis=0))
        grid_lo, grid_hi = _representable(qparams)
        # Bins are laid over what the parameters represent, not over the candidate itself:
        # candidates with equal parameters then get equal errors, and ties are real ties.
        inside_lo = np.clip(grid_lo, low, high)[:, None]
        inside_hi = np.clip(grid_hi, low, high)[:, None]
        tail = np.arange(self.tail_points + 1, dtype=np.float64) / self.tail_points
        inner = np.arange(1, self.points + 1, dtype=np.float64) / self.points
        edges = np.concatenate(
            [
                low + (inside_lo - low) * tail,
                inside_lo + (inside_hi - inside_lo) * inner,
                inside_hi + (high - inside_hi) * tail[1:],
            ],
            axis=1,
        )
        mass = np.diff(dist.spread_cdf(edges), axis=1)
        centres = (edges[:, :-1] + edges[:, 1:]) * 0.5
        if dist.point_at.size:  # point masses (zero, clipped extremes) are evaluated where they are
            shape = (lo.size, dist.point_at.size)
            centres = np.concatenate([centres, np.broadcast_to(dist.point_at, shape)], axis=1)
            mass = np.concatenate([mass, np.broadcast_to(dist.point_mass, shape)], axis=1)
        x = centres.astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            # Saturate to the integer grid first, as the deployed QuantizeLinear does: some
            # APIs' own fake-quant does not clamp (TensorFlow without range_given).
            saturated = np.clip(x, grid_lo[:, None], grid_hi[:, None]).astype(np.float32)
            quantized = np.asarray(recipe.fake_quantize(saturated, qparams), dtype=np.float64)
            err = (mass * (x.astype(np.float64) - quantized) ** 2).sum(axis=1)
        return np.where(np.isfinite(err), err, np.inf), grid_lo, grid_hi


def _representable(qparams: Any) -> tuple[np.ndarray, np.ndarray]:
    """Float64 (K,) ends of the integer grid, ``(quant_min - zp) * s`` .. ``(quant_max - zp) * s``."""
    scale = np.asarray(qparams.scale, dtype=np.float64).reshape(-1)
    zero_point = np.asarray(qparams.zero_point, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = (qparams.quant_min - zero_point) * scale
        hi = (qparams.quant_max - zero_point) * scale
    usable = np.isfinite(lo) & np.isfinite(hi) & (lo <= hi)
    return np.where(usable, lo, -np.inf), np.where(usable, hi, np.inf)


class _MseChoice(NamedTuple):
    lo: float
    hi: float
    error: float  # total squared error of the chosen range
    error_minmax: float  # same for the observed range
    grid_lo: float  # representable range of the chosen parameters
    grid_hi: float


def _mse_search(
    dist: Distribution,
    low: float,
    high: float,
    recipe: QuantRecipe,
    grid: _MseGrid,
    span: float,
    amax_only: bool,
) -> _MseChoice:
    """Coarse-to-fine search over log2 fractions of the observed extent kept on each side."""
    pivot = min(max(0.0, low), high)
    top = max(-low, high)

    def ranges(u_lo: np.ndarray, u_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if amax_only:
            t = top * np.exp2(u_hi)
            return np.clip(low, -t, t), np.clip(high, -t, t)
        return pivot + np.exp2(u_lo) * (low - pivot), pivot + np.exp2(u_hi) * (high - pivot)

    # Sides that can move: one threshold for amax-only schemes, else each side away from 0.
    moving = (False, True) if amax_only else (low < pivot, high > pivot)
    stages = _STAGES_2D if all(moving) else _STAGES_1D
    best = np.zeros(2)
    choice: _MseChoice | None = None
    for half, step in stages:
        axes = [
            _log_grid(float(best[side]), half, step, span) if moving[side] else np.zeros(1)
            for side in (0, 1)
        ]
        u_lo, u_hi = (a.ravel() for a in np.meshgrid(axes[0], axes[1], indexing="ij"))
        lo, hi = ranges(u_lo, u_hi)
        err, grid_lo, grid_hi = grid.errors(dist, low, high, lo, hi, recipe)
        k = int(np.argmin(err))  # candidates run from the widest: ties keep the widest range
        best = np.array([u_lo[k], u_hi[k]])
        choice = _MseChoice(
            lo=float(np.float32(lo[k])),
            hi=float(np.float32(hi[k])),
            error=float(err[k]),
            # The first candidate of the first stage keeps the whole observed range.
            error_minmax=float(err[0]) if choice is None else choice.error_minmax,
            grid_lo=float(grid_lo[k]),
            grid_hi=float(grid_hi[k]),
        )
    assert choice is not None
    return choice


def _log_grid(centre: float, half: float | None, step: float, span: float) -> np.ndarray:
    """Descending log2-fraction grid: the whole span, or centre +- half, clipped to [-span, 0]."""
    if half is None:
        grid = -np.arange(0.0, span + step / 2, step)
    else:
        count = round(half / step)
        grid = centre + np.arange(count, -count - 1, -1) * step
    grid = np.clip(grid, -span, 0.0)
    return np.unique(grid)[::-1]


def _depends_on_amax_only(recipe: QuantRecipe, low: float, high: float) -> bool:
    """True when the scheme gives [low, high] the same parameters as [-max|x|, max|x|]."""
    top = max(-low, high)
    data = recipe.qparams(MinMaxStats(np.float32(low), np.float32(high)))
    mirrored = recipe.qparams(MinMaxStats(np.float32(-top), np.float32(top)))
    return _same_qparams(data, mirrored)


def _same_qparams(a: Any, b: Any) -> bool:
    for name in ("scale", "zero_point", "quant_min", "quant_max"):
        if not np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))):
            return False
    extras_a: Mapping[str, Any] = getattr(a, "extras", {}) or {}
    extras_b: Mapping[str, Any] = getattr(b, "extras", {}) or {}
    return extras_a.keys() == extras_b.keys() and all(
        np.array_equal(np.asarray(extras_a[k]), np.asarray(extras_b[k])) for k in extras_a
    )


# ---------------------------------------------------------------------------------------------
# dispatch and shared functions


def select_range(
    histogram: Histogram,
    method: str,
    recipe: QuantRecipe | None = None,
    *,
    percentile: float = 99.99,
    symmetric_percentile: bool = True,
    bins: int = 2048,
    quantized_bins: int = 128,
) -> RangeSelection:
    """Run one range method by name (the registry of :data:`RANGE_METHODS`).

    Args:
        histogram: an observer state.
        method: "percentile", "entropy" or "mse".
        recipe: the tensor recipe (required by mse).
        percentile: for percentile.
        symmetric_percentile: percentile of |x| (True) or two-sided (False).
        bins: |x| bins for entropy.
        quantized_bins: quantization levels for entropy.

    Raises:
        ConfigError: unknown method, bad parameters, or mse without a recipe.
    """
    methods: Mapping[str, Callable[[], RangeSelection]] = {
        "percentile": lambda: percentile_range(
            histogram, percentile, symmetric=symmetric_percentile
        ),
        "entropy": lambda: entropy_range(histogram, bins=bins, quantized_bins=quantized_bins),
        "mse": lambda: mse_range(histogram, _need_recipe(recipe)),
    }
    if method not in methods:
        raise ConfigError(
            f"method: {method!r} is not a histogram method; choose one of {', '.join(methods)}"
        )
    return methods[method]()


def _need_recipe(recipe: QuantRecipe | None) -> QuantRecipe:
    if recipe is None:
        raise ConfigError("method mse needs the tensor's recipe (its scheme) to measure errors")
    return recipe


def _check_bins(bins: int, quantized_bins: int) -> None:
    if not 2 <= quantized_bins <= bins:
        raise ConfigError(f"quantized-bins: {quantized_bins} must be between 2 and bins ({bins})")


def _clip_to(low: float, high: float, bottom: float, top: float) -> tuple[float, float]:
    """The observed range [low, high] clipped to [bottom, top] (kept non-empty)."""
    return min(max(low, bottom), top), max(min(high, top), bottom)


def _outside(dist: Distribution, lo: float, hi: float) -> float:
    total = dist.total
    below = float(dist.cdf(lo))
    above = total - float(dist.cdf(hi, inclusive=True))
    return (below + above) / total if total > 0 else 0.0


def _selection(
    method: str,
    histogram: Histogram,
    lows: list[float],
    highs: list[float],
    clipped: list[float],
    details: dict[str, Any],
) -> RangeSelection:
    lo = np.asarray(lows, dtype=np.float32)
    hi = np.asarray(highs, dtype=np.float32)
    if histogram.axis is None:
        stats = MinMaxStats(lo.reshape(()), hi.reshape(()))
    else:
        stats = MinMaxStats(lo, hi, histogram.axis)
    occupied = np.asarray(
        [histogram.channel_bins(c)[0].size for c in range(histogram.channels)], dtype=np.int64
    )
    return RangeSelection(
        method=method,
        stats=stats,
        observed=histogram.observed,
        clipped_fraction=np.asarray(clipped, dtype=np.float64),
        details={k: _jsonable(v) for k, v in details.items()},
        histogram_bins=occupied,
        values=histogram.total(),
        relative_resolution=histogram.relative_resolution,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _floats(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]
