"""Reader of a single ``.npz`` file: one array per model input, axis 0 = sample; or of a single
``.npy`` file, the array of a model with one input.

An array of the model input's rank gives samples ``x[i:i+1]``; one of rank + 1 gives ``x[i]``.
Rows are streamed from the file (see `qcal.calibration.data._npy`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qcal.calibration.data._npy import _open_arrays, _read_headers, _RowReader
from qcal.calibration.data._source import ArrayInfo, SampleLayout, _check_names, _shape_str
from qcal.calibration.runtime import Feed
from qcal.numerics.errors import DataError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec


class NpzSource:
    """One .npz file, one array per model input, axis 0 = sample (or one .npy file, the array
    of a model with one input); read row by row."""

    kind = "npz"
    is_synthetic = False

    def __init__(
        self, path: Path, inputs: Sequence[InputSpec], *, limit: int | None = None
    ) -> None:
        """Read the member headers (not the data) and count the samples.

        Raises:
            DataError: unreadable file, object arrays, arrays of different lengths, or a .npy
                file for a model of several inputs.
        """
        self.path: Path | None = path
        self._file = path
        self._inputs = tuple(inputs)
        self._headers = _read_headers(path, [spec.name for spec in inputs])
        counts = {key: h.shape[0] for key, h in self._headers.items() if h.shape}
        if len(set(counts.values())) > 1:
            # an array that is no model input is the fault to name, whatever its length
            _check_names(str(path), self._headers, self._inputs)
            ordered = sorted(counts.items(), key=lambda kv: kv[1])
            (a, na), (b, nb) = ordered[0], ordered[-1]
            raise DataError(
                f"{path}: arrays hold different numbers of samples on axis 0: {a!r} has {na},"
                f" {b!r} has {nb}"
            )
        total = next(iter(counts.values()), 0)
        self._count = total if limit is None else min(total, limit)

    def num_samples(self) -> int:
        """Samples in the file, capped by the limit."""
        return self._count

    def _adds_batch_axis(self) -> dict[str, bool]:
        """Per input: True if samples are x[i:i+1] (same rank), False if x[i] (rank + 1)."""
        origin = str(self._file)
        _check_names(origin, self._headers, self._inputs)
        adds: dict[str, bool] = {}
        for spec in self._inputs:
            found = self._headers[spec.name].shape
            rank = len(spec.shape)
            if len(found) == rank + 1:
                adds[spec.name] = False
            elif len(found) == rank and rank >= 1:
                adds[spec.name] = True
            else:
                expected = f"{rank} or {rank + 1}" if rank >= 1 else "1"
                raise DataError(
                    f"{origin}: input {spec.name!r} has rank {len(found)} (shape {found}), expected"
                    f" rank {expected} (axis 0 = sample; model input shape {_shape_str(spec)})"
                )
        return adds

    def layouts(self) -> Iterator[SampleLayout]:
        """One layout for every sample of the file, from the .npy headers."""
        adds = self._adds_batch_axis()
        arrays = {}
        for spec in self._inputs:
            header = self._headers[spec.name]
            shape = (1, *header.shape[1:]) if adds[spec.name] else header.shape[1:]
            arrays[spec.name] = ArrayInfo(str(self._file), header.dtype, shape)
        yield SampleLayout(str(self._file), arrays)

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator reading one row per input and sample from the zip stream."""
        return self._stream(self._adds_batch_axis())

    def _stream(self, adds: dict[str, bool]) -> Iterator[Feed]:
        with _open_arrays(self._file) as zf, contextlib.ExitStack() as stack:
            readers = {}
            for spec in self._inputs:
                reader = _RowReader(zf, self._file, spec.name, self._headers[spec.name])
                stack.callback(reader.close)
                readers[spec.name] = reader
            for _ in range(self._count):
                # Built in one expression so no local keeps the previous sample alive.
                yield {
                    name: (reader.read()[np.newaxis] if adds[name] else reader.read())
                    for name, reader in readers.items()
                }
