"""Bias correction: the mean shift a weight's codes cause in its layer's output, for the bias
to take back.

A layer computes ``y = W x + b``. Quantized, it computes ``W_q x_q + b``, whose mean over the
data differs by ``W_q E[x_q] - W E[x]`` per output channel: the weights' codes shift it by
``(W_q - W) E[x_q]``, largest where a channel has few weights (depthwise convolutions), and the
input's quantization by ``W (E[x_q] - E[x])``, which a range that clips the input's tail makes
large (rounding alone leaves it near 0). Both are systematic errors that every later layer sees.
Subtracting their sum from the bias (before the bias is stored as int32) removes them on the
calibration data, for the layer's input as the float model feeds it; the rounding noise around
the mean stays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["output_mean_shift"]


def output_mean_shift(
    array: np.ndarray, codes: np.ndarray, *, row_axis: int, scale: np.ndarray,
    zero_point: np.ndarray, input_means: np.ndarray, real_means: np.ndarray,
) -> np.ndarray:
    """``W_q E[x_q] - W E[x]`` per output channel (float64).

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
    groups = input_means.shape[0]
    quantized = np.einsum("gri,gi->gr", restored.reshape(groups, rows // groups, -1),
                          np.asarray(input_means, dtype=np.float64))
    exact = np.einsum("gri,gi->gr", weights.reshape(groups, rows // groups, -1),
                      np.asarray(real_means, dtype=np.float64))
    shift: np.ndarray = (quantized - exact).reshape(rows)
    return shift
