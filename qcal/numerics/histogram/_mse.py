"""MSE range selection: the range minimizing the expected fake-quantization error.

A coarse-to-fine search over log2 fractions of the observed extent; every candidate is measured
with the preset's own parameters and fake-quant (a :class:`QuantRecipe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._distribution import Distribution, signed_distribution
from qcal.numerics.histogram._result import QuantRecipe, RangeSelection, _outside, _selection
from qcal.numerics.histogram._snapshot import Histogram
from qcal.numerics.observers import MinMaxStats

__all__ = ["mse_range"]


# mse search, in log2 of the fraction of the observed extent kept on a side: (half width of the
# grid around the previous best or None for the whole span, step). 1-D: 49 + 33 candidates;
# 2-D: 13 x 13 + 3 x 9 x 9. The last stage's step, 1/64 octave, is ~1.1 % of the range.
_STAGES_1D = ((None, 0.25), (0.25, 1.0 / 64))
_STAGES_2D = ((None, 1.0), (1.0, 0.25), (0.25, 1.0 / 16), (1.0 / 16, 1.0 / 64))


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
