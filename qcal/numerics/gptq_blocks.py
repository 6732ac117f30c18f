"""GPTQ for weights quantized in blocks along their inputs (`qcal.numerics.blockwise`).

As in `qcal.numerics.gptq`, the inputs are quantized one at a time and each one's error is
spread over the inputs not yet quantized, weighted by the inputs' correlations (H). With a
scale per block of inputs, the block's scale and zero point are set from the block's weights as
they stand when its first input is reached, after the updates of every earlier block (the
grouping of the GPTQ paper): the parameters follow the weights GPTQ has already moved.
Inputs go in their natural order, so every block is quantized whole, one after the other.

Deterministic: float64 linear algebra on the same inputs, in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qcal.numerics.blockwise import (
    BlockQuant,
    block_qparams,
    quantize_blocks,
    quantize_rtn,
)
from qcal.numerics.gptq import inverse_factors, output_error

__all__ = ["BlockGptqResult", "gptq_blocks", "relative_output_error"]

# Inputs quantized between two updates of the rest (GPTQ's lazy batch), in whole blocks.
_LAZY_INPUTS = 128


@dataclass(frozen=True)
class BlockGptqResult:
    """Codes of a weight and the layer's relative output error ``tr(dW H dW^T) / tr(W H W^T)``
    rounded to nearest and with the chosen codes (equal when GPTQ did not help)."""

    quant: BlockQuant
    error_nearest: float
    error_gptq: float


def relative_output_error(weights: np.ndarray, quant: BlockQuant, hessian: np.ndarray) -> float:
    """The layer's squared output error relative to its output energy, `weights` ``(N, K)``."""
    w = np.asarray(weights, dtype=np.float64)
    delta = quant.dequantized().astype(np.float64) - w
    return output_error(delta[None], w[None], np.asarray(hessian, dtype=np.float64)[None])


def gptq_blocks(weights: np.ndarray, hessian: np.ndarray, block_size: int) -> BlockGptqResult:
    """GPTQ codes of `weights` ``(N, K)`` in blocks of `block_size` inputs, given the inputs'
    second moments `hessian` ``(K, K)`` (any positive scale).

    Inputs that never vary (a zero diagonal) carry no error to spread. Where H cannot be
    factored, or GPTQ would not lower the output error measured on the same H, the weight
    rounds to nearest.
    """
    w = np.asarray(weights, dtype=np.float64)
    rows, inputs = w.shape
    nearest = quantize_rtn(w, block_size)
    h = np.array(hessian, dtype=np.float64)
    error_nearest = relative_output_error(w, nearest, h)
    diagonal = np.diagonal(h).copy()
    dead = np.nonzero(diagonal <= 0)[0]
    if dead.size == inputs:
        return BlockGptqResult(nearest, error_nearest, error_nearest)
    h[dead, dead] = 1.0
    factors = inverse_factors(h[None])
    if factors is None:
        return BlockGptqResult(nearest, error_nearest, error_nearest)
    upper = factors[0]
    work = w.copy()
    codes = np.repeat(nearest.zero_points[:, :, None], block_size, axis=2)  # padding: zero point
    scales = np.empty_like(nearest.scales)
    zero_points = np.empty_like(nearest.zero_points)
    lazy = block_size * max(1, _LAZY_INPUTS // block_size)
    for start in range(0, inputs, lazy):
        stop = min(start + lazy, inputs)
        errors = np.zeros((rows, stop - start))
        for j in range(start, stop):
            block, offset = divmod(j, block_size)
            if offset == 0:  # the block's parameters from its weights as they stand now
                scale, zero = block_qparams(work[:, j : min(j + block_size, inputs)])
                scales[:, block], zero_points[:, block] = scale, zero
            column = quantize_blocks(work[:, j, None], scales[:, block], zero_points[:, block])
            codes[:, block, offset] = column[:, 0]
            restored = ((column[:, 0].astype(np.float32) - zero_points[:, block])
                        * scales[:, block]).astype(np.float64)
            error = (work[:, j] - restored) / upper[j, j]
            work[:, j + 1 : stop] -= error[:, None] * upper[None, j, j + 1 : stop]
            errors[:, j - start] = error
        work[:, stop:] -= errors @ upper[start:stop, stop:]
    chosen = BlockQuant(codes.astype(np.uint8), scales, zero_points, inputs)
    error_gptq = relative_output_error(w, chosen, hessian)
    if error_gptq >= error_nearest:  # never worse than rounding to nearest on its own data
        return BlockGptqResult(nearest, error_nearest, error_nearest)
    return BlockGptqResult(chosen, error_nearest, error_gptq)
