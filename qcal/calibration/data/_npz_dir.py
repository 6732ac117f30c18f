"""Reader of a folder of ``.npz`` files, one sample (full model feed) each, in file-name order;
shapes may differ between samples, and each file is read only when its turn comes. For a model
with one input the files may also be ``.npy`` files, each that input's array.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qcal.calibration.data._npy import (
    ARRAY_SUFFIXES,
    _members,
    _open_arrays,
    _read_headers,
    _read_member,
)
from qcal.calibration.data._source import ArrayInfo, SampleLayout, _check_names, _visible
from qcal.calibration.runtime import Feed

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec


class NpzDirSource:
    """A folder of .npz (or, for a model with one input, .npy) files, one sample (full model
    feed) each, in file-name order."""

    kind = "npz-dir"
    is_synthetic = False

    def __init__(
        self, path: Path, inputs: Sequence[InputSpec], *, limit: int | None = None
    ) -> None:
        """List the .npz and .npy files (hidden files are ignored); nothing is read yet."""
        self.path: Path | None = path
        self._inputs = tuple(inputs)
        self._files = _npz_files(path)[:limit]

    def num_samples(self) -> int:
        """Number of files, capped by the limit."""
        return len(self._files)

    def layouts(self) -> Iterator[SampleLayout]:
        """One layout per file, from its .npy headers."""
        names = [spec.name for spec in self._inputs]
        for file in self._files:
            headers = _read_headers(file, names)
            yield SampleLayout(
                str(file), {k: ArrayInfo(str(file), h.dtype, h.shape) for k, h in headers.items()}
            )

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator reading one file per sample."""
        names = [spec.name for spec in self._inputs]
        for file in self._files:
            with _open_arrays(file) as zf:
                members = _members(zf, names)
                _check_names(str(file), members, self._inputs)
                yield {
                    s.name: _read_member(zf, file, s.name, members[s.name]) for s in self._inputs
                }


def _npz_files(folder: Path) -> list[Path]:
    return [p for p in _visible(folder)
            if p.suffix.lower() in ARRAY_SUFFIXES and p.is_file()]
