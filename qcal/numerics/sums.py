"""Inner products of the error measurements, summed without BLAS.

`a @ b` on vectors calls BLAS, whose worker threads (OpenBLAS, as numpy ships it) split a long
vector between them and then keep spinning on a core after each call: while onnxruntime ran
two block measurements at once, such a thread took a core of the two for the whole stage
(PP-OCRv4 rec's block measurements, 4.2 s, took 2.3 s with one BLAS thread), and the split
makes the last bits of a sum depend on how many cores the machine has. numpy's einsum sums in
its own loop on the calling thread: the same figures on every machine, no core taken.
"""

from __future__ import annotations

import numpy as np

__all__ = ["inner_product"]


def inner_product(a: np.ndarray, b: np.ndarray) -> float:
    """The inner product of two vectors of the same length."""
    return float(np.einsum("i,i->", a, b))
