"""Bias correction: the mean shift a weight's codes cause in its layer's output, for the bias
to take back.

A layer computes ``y = W x + b``. With quantized weights it computes ``W_q x + b``, whose mean
over the data differs by ``(W_q - W) E[x]`` per output channel: a systematic error that every
later layer sees, largest where a channel has few weights (depthwise convolutions). Subtracting
that shift from the bias (before the bias is stored as int32) removes it on the calibration
data; the rounding noise around the mean stays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["output_mean_shift"]


def output_mean_shift(
    array: np.ndarray, codes: np.ndarray, *, row_axis: int, scale: np.ndarray,
    zero_point: np.ndarray, input_means: np.ndarray,
) -> np.ndarray:
    """``(W_q - W) E[x]`` per output channel (float64).

    `array` is the float weight and `codes` its codes, in the weight's own layout, the output
    channels along `row_axis`; `scale`/`zero_point` dequantize the codes (one per output channel
    or one for all); `input_means` is ``(groups, inputs per group)``: the mean of each input the
    layer multiplies, per group of output channels (a grouped Conv's groups), in the order the
    weight's other axes hold them.
    """
    weights = np.moveaxis(np.asarray(array, dtype=np.float64), row_axis, 0)
    rows = weights.shape[0]
    flat_codes = np.moveaxis(np.asarray(codes), row_axis, 0).reshape(rows, -1)
    along = (-1, 1)
    scale64 = np.broadcast_to(np.asarray(scale, dtype=np.float64).reshape(-1), (rows,))
    zero64 = np.broadcast_to(np.asarray(zero_point, dtype=np.float64).reshape(-1), (rows,))
    restored = (flat_codes.astype(np.float64) - zero64.reshape(along)) * scale64.reshape(along)
    delta = restored - weights.reshape(rows, -1)
    groups = input_means.shape[0]
    per_group = delta.reshape(groups, rows // groups, -1)
    shift: np.ndarray = np.einsum("gri,gi->gr", per_group, input_means).reshape(rows)
    return shift
