"""Synthetic calibration data: random samples shaped and typed by the model inputs, for running
without data (the result is not calibrated; callers say so loudly).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from qcal.calibration.data._source import ArrayInfo, SampleLayout
from qcal.calibration.runtime import Feed
from qcal.numerics.errors import DataError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec

SYNTHETIC_FREE_DIM = 1
"""Size given to a symbolic or unknown dimension in synthetic data (dim 0, the batch, is also 1)."""
SYNTHETIC_INT_HIGH = 10
# A declared shape past this makes no sample of random data (a dimension of 2^40 asked 4 TiB of
# memory and failed inside numpy).
_LARGEST_SAMPLE_BYTES = 1 << 32
"""Synthetic integer inputs are drawn uniformly from [0, SYNTHETIC_INT_HIGH)."""


class SyntheticSource:
    """N random samples shaped and typed by the model inputs (not real data: say so loudly).

    Dims: fixed ones as given; a symbolic or unknown dim is 1 at axis 0 (the batch) and
    `SYNTHETIC_FREE_DIM` elsewhere. Values: floats N(0, 1) drawn in float32 then cast to the
    input's float type; integers uniform in [0, `SYNTHETIC_INT_HIGH`); bools fair coin flips.
    Drawn from `numpy.random.default_rng(seed)`, restarted by each `samples()` call, so every
    iteration yields the same samples.
    """

    kind = "synthetic"
    is_synthetic = True

    def __init__(self, inputs: Sequence[InputSpec], *, count: int, seed: int = 0) -> None:
        """Fix the shapes; refuse inputs of a type random data cannot be made for.

        Raises:
            DataError: an input is neither float, integer nor bool.
        """
        self.path: Path | None = None
        self._inputs = tuple(inputs)
        self._count = count
        self._seed = seed
        for spec in self._inputs:
            if np.dtype(spec.dtype).kind not in "fiub":
                raise DataError(
                    f"synthetic data: cannot generate input {spec.name!r} of type"
                    f" {np.dtype(spec.dtype)}; pass --data PATH"
                )
        self._shapes = {
            spec.name: tuple(
                d if isinstance(d, int) else (1 if axis == 0 else SYNTHETIC_FREE_DIM)
                for axis, d in enumerate(spec.shape)
            )
            for spec in self._inputs
        }
        for spec in self._inputs:
            name, shape = spec.name, self._shapes[spec.name]
            size = math.prod(shape) * np.dtype(spec.dtype).itemsize
            if size > _LARGEST_SAMPLE_BYTES:
                raise DataError(
                    f"synthetic data: input {name!r} declares the shape {list(shape)}, "
                    f"{size / 2**30:.3g} GiB a sample; pass --data PATH")

    def num_samples(self) -> int:
        """The requested number of samples (capped by the limit)."""
        return self._count

    def layouts(self) -> Iterator[SampleLayout]:
        """The single layout every synthetic sample has."""
        yield SampleLayout(
            "synthetic data",
            {
                s.name: ArrayInfo("synthetic data", np.dtype(s.dtype), self._shapes[s.name])
                for s in self._inputs
            },
        )

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator; the same seed gives the same samples every time."""
        rng = np.random.default_rng(self._seed)
        for _ in range(self._count):
            yield {
                s.name: _random_array(rng, np.dtype(s.dtype), self._shapes[s.name])
                for s in self._inputs
            }


def _random_array(
    rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> npt.NDArray[Any]:
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, SYNTHETIC_INT_HIGH, size=shape).astype(dtype)
