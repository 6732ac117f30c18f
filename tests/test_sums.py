"""The inner products of the error measurements (`qcal.numerics.sums`) against exact sums."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qcal.numerics.sums import inner_product


@pytest.mark.parametrize("length", [0, 1, 7, 4096, 265_000])
def test_inner_products_are_the_exact_sums_to_float64_precision(length: int) -> None:
    rng = np.random.default_rng(length)
    a, b = rng.standard_normal(length), rng.standard_normal(length) * 1e3
    exact = math.fsum(float(x) * float(y) for x, y in zip(a, b))
    scale = math.fsum(abs(float(x) * float(y)) for x, y in zip(a, b))
    got = inner_product(a, b)
    assert isinstance(got, float)
    assert abs(got - exact) <= 1e-13 * max(scale, 1e-300)
    assert inner_product(a, a) == pytest.approx(math.fsum(float(x) ** 2 for x in a), rel=1e-13)
