"""SmoothQuant's numbers: the per-channel scales, and the layer error that `auto` chooses alpha by.

For input channel j of a layer ``Y = X W`` (W of shape (K, N), every layer reading X combined),

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(1 where either maximum is 0: that channel has nothing to move). The layer error of a choice is
the relative squared error of the layers' outputs on a sample of X's rows (`RowSample`) with X/s
quantized per tensor by the activation recipe, over the range X/s takes on the whole calibration
data (from the per-channel minima and maxima), and s W by the weight recipe (per output column,
or per tensor), against the float ``X W``::

    error = sum_layers ||Q(X / s) Q(s W) - X W||^2 / sum_layers ||X W||^2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import MinMaxStats
from qcal.numerics.presets import TensorRecipe

__all__ = ["ALPHA_GRID", "LayerProblem", "layer_error", "smoothing_alpha", "smoothing_scales"]

# The alphas `auto` tries; SmoothQuant's paper finds 0.5 to 0.85 best on the models it studied.
ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_F32 = np.float32


def smoothing_alpha(value: object) -> float | str:
    """The `--smooth-quant` value checked: "auto", or an alpha in [0, 1] (a number or its text).

    Raises:
        ConfigError: anything else.
    """
    if value == "auto":
        return "auto"
    try:
        alpha = float(value) if isinstance(value, (str, int, float)) and value is not True \
            and value is not False else None
    except ValueError:
        alpha = None
    if alpha is None or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"smooth-quant: {value!r} is neither an alpha in [0, 1] nor 'auto'")
    return alpha


@dataclass(frozen=True)
class LayerProblem:
    """What the error of one target is measured on.

    Attributes:
        rows: (R, K) float32 rows of X (a sample, `qcal.calibration.channel_stats`).
        x_min, x_max: (K,) per-channel extremes of X over all the calibration data.
        weights: each layer's weight as (K, N) float64.
    """

    rows: np.ndarray
    x_min: np.ndarray
    x_max: np.ndarray
    weights: Sequence[np.ndarray]

    @property
    def x_absmax(self) -> np.ndarray:
        absmax: np.ndarray = np.maximum(np.abs(self.x_min), np.abs(self.x_max))
        return absmax.astype(np.float64)

    @property
    def w_absmax(self) -> np.ndarray:
        absmax: np.ndarray = np.max(np.stack([np.max(np.abs(w), axis=1) for w in self.weights]),
                                    axis=0)
        return absmax


def smoothing_scales(x_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), float64; 1 where either is 0 or not finite."""
    x = np.asarray(x_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    scale = np.ones_like(x)
    live = (x > 0) & (w > 0) & np.isfinite(x) & np.isfinite(w)
    scale[live] = x[live] ** alpha / w[live] ** (1.0 - alpha)
    scale[~np.isfinite(scale) | (scale <= 0)] = 1.0
    return scale


def layer_error(
    problem: LayerProblem, scale: np.ndarray, *, activation: TensorRecipe, weight: TensorRecipe,
    per_channel: bool,
) -> float:
    """The relative squared output error of the target's layers with X/s and s W quantized."""
    rows = problem.rows.astype(np.float64)
    if rows.shape[0] == 0:
        return 0.0
    smoothed = (rows / scale).astype(_F32)
    lo, hi = problem.x_min / scale, problem.x_max / scale
    stats = MinMaxStats(np.array(lo.min(), dtype=_F32), np.array(hi.max(), dtype=_F32))
    x_q = activation.fake_quantize(smoothed, activation.qparams(stats)).astype(np.float64)
    error = energy = 0.0
    for w in problem.weights:
        scaled = (w * scale[:, None]).astype(_F32)
        w_q = weight.fake_quantize(scaled, weight.qparams(_weight_stats(scaled, per_channel)))
        reference = rows @ w
        error += float(np.sum((x_q @ w_q.astype(np.float64) - reference) ** 2))
        energy += float(np.sum(reference**2))
    return error / energy if energy > 0 else 0.0


def _weight_stats(w: np.ndarray, per_channel: bool) -> MinMaxStats:
    if per_channel:
        return MinMaxStats(w.min(axis=0), w.max(axis=0), axis=1)
    return MinMaxStats(np.array(w.min(), dtype=_F32), np.array(w.max(), dtype=_F32))
