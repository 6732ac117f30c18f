"""Checks of calibration data against the model: names, dtypes, ranks and fixed dims of every
sample (`validate_data`, from headers where the source has them), and the inputs of a feed that
hold NaN or Inf (`find_nonfinite`, called once a problem shows up, not on every batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from qcal.calibration.data._npy import STRINGS_HOW
from qcal.calibration.data._source import (
    ArrayInfo,
    DataSource,
    SampleLayout,
    _check_names,
    _native,
    _shape_str,
)
from qcal.numerics.errors import DataError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec


@runtime_checkable
class _DescribedSource(Protocol):
    def layouts(self) -> Iterator[SampleLayout]: ...


def _check_array(spec: InputSpec, info: ArrayInfo) -> None:
    where = f"{info.origin}: input {spec.name!r}"
    expected_dtype = np.dtype(spec.dtype)
    if expected_dtype.hasobject and not np.dtype(info.dtype).hasobject:
        raise DataError(f"{where} has dtype {info.dtype}, model expects strings: {STRINGS_HOW}")
    if _native(info.dtype) != expected_dtype:
        raise DataError(f"{where} has dtype {info.dtype}, model expects {expected_dtype}")
    if len(info.shape) != len(spec.shape):
        raise DataError(
            f"{where} has rank {len(info.shape)} (shape {info.shape}), model expects rank"
            f" {len(spec.shape)} (shape {_shape_str(spec)})"
        )
    for axis, (found, want) in enumerate(zip(info.shape, spec.shape)):
        if isinstance(want, int) and found != want:
            hint = ""
            if axis == 0 and found == 1 and want > 1:  # rows of an .npz, a fixed batch
                hint = (f"; for a fixed batch of {want}, give each sample whole: an .npz array"
                        f" of rank {len(spec.shape) + 1} (samples x[i]) or a folder of .npz files")
            raise DataError(
                f"{where} has size {found} on axis {axis} (shape {info.shape}), model expects"
                f" {want} (shape {_shape_str(spec)}){hint}"
            )


def _layouts_from_samples(source: DataSource) -> Iterator[SampleLayout]:
    """Fallback for sources without headers: look at every sample (streamed, one at a time)."""
    where = source.path if source.path is not None else source.kind
    for i, sample in enumerate(source.samples()):
        origin = f"{where} (sample {i})"
        yield SampleLayout(
            origin, {k: ArrayInfo(origin, v.dtype, tuple(v.shape)) for k, v in sample.items()}
        )


def validate_data(source: DataSource, inputs: Sequence[InputSpec]) -> None:
    """Check names, dtypes (exact), ranks and fixed dims of every sample against the inputs.

    Sources of this module are checked from file headers only; any other source is iterated once.

    Raises:
        DataError: one line naming the file, the input and what the model expects.
    """
    layouts = (
        source.layouts() if isinstance(source, _DescribedSource) else _layouts_from_samples(source)
    )
    for layout in layouts:
        _check_names(layout.origin, layout.arrays, inputs)
        for spec in inputs:
            _check_array(spec, layout.arrays[spec.name])


def find_nonfinite(feed: Mapping[str, npt.NDArray[Any]]) -> list[str]:
    """Names of the inputs of `feed` holding NaN or ±Inf, in feed order (for a clear message)."""
    return [
        name
        for name, array in feed.items()
        if array.dtype.kind in "fc" and not bool(np.isfinite(array).all())
    ]
