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

# Values of the weight converted to float64 at a time (32 MB per temporary).
_BLOCK_VALUES = 1 << 22


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
    weights = np.moveaxis(np.asarray(array), row_axis, 0)
    rows = weights.shape[0]
    groups = input_means.shape[0]
    per_group = rows // groups
    # (groups, rows per group, inputs): views, where the layout allows, of the caller's arrays
    weights = weights.reshape(groups, per_group, -1)
    codes = np.moveaxis(np.asarray(codes), row_axis, 0).reshape(groups, per_group, -1)
    scale64 = np.broadcast_to(np.asarray(scale, dtype=np.float64).reshape(-1), (rows,))
    zero64 = np.broadcast_to(np.asarray(zero_point, dtype=np.float64).reshape(-1), (rows,))
    along = (groups, per_group, 1)
    scale64, zero64 = scale64.reshape(along), zero64.reshape(along)
    means = np.asarray(input_means, dtype=np.float64)
    real = np.asarray(real_means, dtype=np.float64)
    shift = np.empty((groups, per_group), np.float64)
    # float64 copies of a block of rows at a time, not of the whole weight (a VGG classifier's
    # 25088 x 4096 weight took 0.8 GB per copy, three at once). The blocks follow from the
    # shapes alone; a weight of at most _BLOCK_VALUES values is one block.
    inputs = max(weights.shape[2], 1)
    row_step = max(1, min(per_group, _BLOCK_VALUES // inputs))
    group_step = max(1, _BLOCK_VALUES // (inputs * per_group)) if row_step == per_group else 1
    for g in range(0, groups, group_step):
        gs = slice(g, g + group_step)
        for r in range(0, per_group, row_step):
            rs = slice(r, r + row_step)
            restored = (codes[gs, rs].astype(np.float64) - zero64[gs, rs]) * scale64[gs, rs]
            quantized = np.einsum("gri,gi->gr", restored, means[gs])
            exact = np.einsum("gri,gi->gr", weights[gs, rs].astype(np.float64), real[gs])
            shift[gs, rs] = quantized - exact
    flat: np.ndarray = shift.reshape(rows)
    return flat
