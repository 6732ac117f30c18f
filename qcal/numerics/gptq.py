"""Weight codes chosen by layer-wise error minimisation (GPTQ) instead of rounding to nearest.

A layer computes ``W @ x`` for the inputs ``x`` it sees. Rounding every weight to its nearest
code minimises the error of each weight alone; GPTQ (Frantar et al., 2022, after Optimal Brain
Quantization) minimises the error of the layer's output, ``tr(dW H dW^T)`` with
``H = sum x x^T`` over the calibration inputs: it quantizes one input column at a time and
spreads that column's error over the columns not yet quantized, in proportion to how the
inputs correlate. The scale and zero point stay the preset's own (from the weight's range);
only which code each weight gets changes, and every code is still the preset's quantization of
some value, so the grid and its limits are those of the API.

Deterministic: plain float64 linear algebra on the same inputs, columns in a fixed order
(largest input energy first, ties by index).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["GptqResult", "gptq_codes", "gptq_weight", "inverse_factors", "output_error"]

# Damping added to the Hessian's diagonal, as a fraction of its mean (GPTQ's default): it keeps
# the inverse well conditioned where inputs are nearly collinear.
DAMPING = 0.01
# Columns quantized between two updates of the rest (GPTQ's lazy batch): the updates become
# matrix products.
_BLOCK = 128

Quantizer = Callable[[np.ndarray], np.ndarray]
"""``quantize``: codes of one column of weights (shape ``(rows,)``) in the preset's own
arithmetic; ``dequantize``: values of codes shaped ``(rows,)`` or ``(rows, columns)``."""


@dataclass(frozen=True)
class GptqResult:
    """Codes for a weight matrix and what they changed.

    Attributes:
        codes: integer codes, `(groups * rows, inputs)`.
        error_nearest: ``tr(dW H dW^T) / tr(W H W^T)`` with codes rounded to nearest: the
            layer's squared output error relative to its output energy on the calibration
            inputs.
        error_gptq: the same with the GPTQ codes.
    """

    codes: np.ndarray
    error_nearest: float
    error_gptq: float


def output_error(delta: np.ndarray, weights: np.ndarray, hessian: np.ndarray) -> float:
    """Squared output error of a weight error ``delta`` relative to the output energy, summed
    over groups (arrays ``(groups, rows, inputs)`` and a Hessian ``(groups, inputs, inputs)``)."""
    energy = float(np.sum((weights @ hessian) * weights))
    error = float(np.sum((delta @ hessian) * delta))
    return error / energy if energy > 0 else 0.0


def inverse_factors(hessian: np.ndarray) -> np.ndarray | None:
    """Per group, the upper triangular U with U^T U = inverse of the damped Hessian; None if a
    group's Hessian is not positive definite even with ten and a hundred times the damping.

    With the order of rows and columns reversed, H = L L^T becomes H = R R^T with R upper
    triangular, so H^-1 = (R^-1)^T R^-1: U = R^-1, one factorisation and one inverse.
    """
    size = hessian.shape[-1]
    mean = np.mean(np.diagonal(hessian, axis1=1, axis2=2), axis=1)[:, None, None]
    for factor in (1.0, 10.0, 100.0):
        damped = hessian + np.eye(size) * (DAMPING * factor * mean)
        try:
            lower = np.linalg.cholesky(damped[:, ::-1, ::-1])
        except np.linalg.LinAlgError:
            continue
        upper = lower[:, ::-1, ::-1]
        inverse: np.ndarray = np.triu(np.linalg.inv(upper))
        return inverse
    return None


def gptq_codes(
    weights: np.ndarray, hessian: np.ndarray, quantize: Quantizer, dequantize: Quantizer,
    nearest: np.ndarray | None = None,
) -> GptqResult:
    """GPTQ codes for ``weights`` ``(groups, rows, inputs)`` given each group's inputs' Hessian
    ``(groups, inputs, inputs)`` (any positive scale: only its shape matters).

    ``quantize`` maps one input column of every row (``groups * rows`` values, rows in order)
    to codes and ``dequantize`` codes back to floats, both with the rows' own parameters.
    Inputs that never vary (a zero diagonal) carry no error: their weights round to nearest.
    Where a Hessian cannot be factored, or GPTQ would not lower the output error measured on
    the same Hessian, every weight rounds to nearest (both errors are then equal).
    `nearest`, when given, holds the codes rounded to nearest, ``(groups * rows, inputs)``.
    """
    w = np.asarray(weights, dtype=np.float64)
    groups, rows, columns = w.shape
    flat = w.reshape(groups * rows, columns)

    def column_codes(values: np.ndarray) -> np.ndarray:
        return quantize(values.reshape(groups * rows))

    h = np.array(hessian, dtype=np.float64)
    if nearest is None:
        nearest = np.stack([column_codes(flat[:, j]) for j in range(columns)], axis=1)
    error_nearest = output_error(dequantize(nearest).reshape(w.shape) - w, w, h)
    diagonal = np.diagonal(h, axis1=1, axis2=2).copy()
    dead = diagonal <= 0
    if dead.all():
        return GptqResult(nearest, error_nearest, error_nearest)
    g_index, i_index = np.nonzero(dead)
    h[g_index, i_index, i_index] = 1.0
    # Largest input energy first (GPTQ's "act order"): the columns that matter most are
    # quantized while the most columns remain to absorb their error. One order for all groups.
    energy = diagonal.sum(axis=0)
    order = np.lexsort((np.arange(columns), -energy))
    h = h[:, order][:, :, order]
    factors = inverse_factors(h)
    if factors is None:
        return GptqResult(nearest, error_nearest, error_nearest)
    codes = np.empty(nearest.shape, dtype=nearest.dtype)

    def quantize_column(j: int, column: np.ndarray) -> np.ndarray:
        codes[:, j] = column_codes(column)
        restored: np.ndarray = dequantize(codes[:, j]).reshape(groups, rows)
        return restored

    spread_errors(w[:, :, order].copy(), factors, quantize_column)
    result = np.empty_like(codes)
    result[:, order] = codes
    error_gptq = output_error(dequantize(result).reshape(w.shape) - w, w,
                              np.asarray(hessian, dtype=np.float64))
    if error_gptq >= error_nearest:  # never worse than rounding to nearest on its own data
        return GptqResult(nearest, error_nearest, error_nearest)
    return GptqResult(result, error_nearest, error_gptq)


def spread_errors(
    work: np.ndarray, factors: np.ndarray,
    quantize_column: Callable[[int, np.ndarray], np.ndarray],
) -> None:
    """GPTQ's column loop over `work` ``(groups, rows, inputs)``, inputs already in the order
    they are quantized, with `factors` from `inverse_factors`: `quantize_column(j, column)`
    quantizes input j of every row (keeping its codes) and returns the restored values; each
    input's rounding error is spread over the inputs after it, lazily in blocks of _BLOCK."""
    columns = work.shape[2]
    for start in range(0, columns, _BLOCK):
        stop = min(start + _BLOCK, columns)
        errors = np.zeros((*work.shape[:2], stop - start))
        for j in range(start, stop):
            column = work[:, :, j]
            restored = quantize_column(j, column)
            error = (column - restored) / factors[:, j, j][:, None]
            work[:, :, j + 1 : stop] -= error[:, :, None] * factors[:, None, j, j + 1 : stop]
            errors[:, :, j - start] = error
        work[:, :, stop:] -= errors @ factors[:, start:stop, stop:]


def gptq_weight(
    array: np.ndarray, *, row_axis: int, groups: int, hessian: np.ndarray,
    quantize: Callable[[np.ndarray], np.ndarray], scale: np.ndarray, zero_point: np.ndarray,
    nearest: np.ndarray,
) -> GptqResult:
    """GPTQ codes for a weight tensor in its own layout.

    Rows are the output channels along `row_axis` (Conv: 0, MatMul: 1, Gemm: 0 with transB);
    the inputs are the other axes, in the order the layer multiplies them with its input
    (a Conv's channel of the group, then its kernel). `quantize` gives codes of an array
    shaped like the weight with one input position (every row, 1 elsewhere), in the preset's
    arithmetic; `scale`/`zero_point` are the ONNX parameters, one per row or one in all;
    `nearest` the codes rounded to nearest, in the weight's layout.
    Returns codes in the weight's layout and the output errors.
    """
    moved = np.moveaxis(np.asarray(array, dtype=np.float64), row_axis, 0)
    rows = moved.shape[0]
    matrix = moved.reshape(rows, -1)
    column_shape = [1] * array.ndim
    column_shape[row_axis] = rows
    scale64 = np.broadcast_to(np.asarray(scale, dtype=np.float64).reshape(-1), (rows,))
    zero64 = np.broadcast_to(np.asarray(zero_point, dtype=np.float64).reshape(-1), (rows,))

    def column_codes(values: np.ndarray) -> np.ndarray:
        codes = np.asarray(quantize(values.astype(np.float32).reshape(column_shape)))
        flat: np.ndarray = codes.reshape(rows)
        return flat

    def restore(codes: np.ndarray) -> np.ndarray:
        along = (-1,) + (1,) * (codes.ndim - 1)  # one column or a matrix of them
        restored: np.ndarray = ((codes.astype(np.float64) - zero64.reshape(along))
                                * scale64.reshape(along))
        return restored

    result = gptq_codes(matrix.reshape(groups, rows // groups, -1), hessian, column_codes, restore,
                        nearest=np.moveaxis(nearest, row_axis, 0).reshape(rows, -1))
    codes = np.moveaxis(result.codes.reshape(moved.shape), 0, row_axis)
    return GptqResult(np.ascontiguousarray(codes), result.error_nearest, result.error_gptq)
