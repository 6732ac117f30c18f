"""Reading ``.npy`` arrays without unpickling, as members of zip (``.npz``) files or as plain
``.npy`` files: headers alone, a whole array, or one axis-0 row at a time from the stream (so only
one row is in memory).

A plain ``.npy`` file holds one unnamed array: it is read as an archive of one member named after
the model's only input (`_open_arrays`, `_read_headers`), so the two readers (one file of many
samples, a folder of one-sample files) take both kinds alike.
"""

from __future__ import annotations

import contextlib
import logging
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from qcal.calibration.data._source import _native
from qcal.numerics.errors import DataError, one_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _NpyHeader:
    member: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran_order: bool


_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)
# .npy and .npz hold strings only as pickled object arrays: the format that carries them safely
STRINGS_HOW = "give them as test_data_set_K/input_J.pb files (onnx TensorProto)"
NPY_SUFFIX = ".npy"
# The files of arrays qcal reads: archives of named arrays, and plain arrays.
ARRAY_SUFFIXES = (".npz", NPY_SUFFIX)


def plain_npy(path: Path) -> bool:
    """Whether `path` names a plain .npy file (one unnamed array), not an .npz archive."""
    return path.suffix.lower() == NPY_SUFFIX


class _Arrays(Protocol):
    """Where a file's arrays are read from: an open zip file, or a plain .npy file."""

    def open(self, member: str) -> IO[bytes]: ...


class _NpyFile:
    """A plain .npy file as an archive of one member (whatever the member's name)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, member: str) -> IO[bytes]:
        return open(self.path, "rb")  # closed by the caller, as a zip member is


def _single_input_key(path: Path, names: Sequence[str]) -> str:
    """The key of a plain .npy file's one array: the model's only input."""
    if len(names) != 1:
        raise DataError(
            f"{path}: a .npy file holds one array but the model has {len(names)} inputs"
            f" ({', '.join(repr(n) for n in names)}); save an .npz file with one array per input"
            " name"
        )
    return names[0]


@contextlib.contextmanager
def _open_zip(path: Path) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise DataError(f"{path}: not a readable .npz file ({one_line(err)})") from None
    with zf:
        yield zf


@contextlib.contextmanager
def _open_arrays(path: Path) -> Iterator[_Arrays]:
    """The arrays of an .npz file, or of a plain .npy file."""
    if not plain_npy(path):
        with _open_zip(path) as zf:
            yield zf
        return
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    yield _NpyFile(path)


def _members(arrays: _Arrays, names: Sequence[str]) -> dict[str, str]:
    """The member of each array, by key: those of a zip; a plain .npy file's one array."""
    if isinstance(arrays, _NpyFile):
        return {_single_input_key(arrays.path, names): arrays.path.name}
    assert isinstance(arrays, zipfile.ZipFile)
    return {n[: -len(NPY_SUFFIX)]: n for n in arrays.namelist() if n.endswith(NPY_SUFFIX)}


def _read_npy_header(fp: IO[bytes], origin: str) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """Read the magic and header of a .npy stream, leaving `fp` at the first data byte."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, fortran_order, dtype = fmt.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran_order, dtype = fmt.read_array_header_2_0(fp)
        else:
            raise DataError(f"{origin}: unsupported .npy format version {version[0]}.{version[1]}")
    except _READ_ERRORS as err:
        raise DataError(f"{origin}: not a valid .npy array ({one_line(err)})") from None
    if dtype.hasobject:
        # Object arrays can only be stored pickled; loading a pickle can run arbitrary code.
        raise DataError(
            f"{origin}: holds Python objects (a pickled object array); qcal never unpickles data,"
            f" save numeric arrays instead (strings: {STRINGS_HOW})"
        )
    return dtype, tuple(int(d) for d in shape), bool(fortran_order)


def _read_headers(path: Path, names: Sequence[str]) -> dict[str, _NpyHeader]:
    """The headers of an .npz file's members, or of a plain .npy file's array keyed by the
    model's only input (of `names`, the model's inputs)."""
    if not plain_npy(path):
        return _read_npz_headers(path)
    key = _single_input_key(path, names)
    try:
        with open(path, "rb") as fp:
            dtype, shape, fortran = _read_npy_header(fp, str(path))
    except OSError as err:
        raise DataError(f"{path}: cannot read ({one_line(err)})") from None
    return {key: _NpyHeader(path.name, dtype, shape, fortran)}


def _read_npz_headers(path: Path) -> dict[str, _NpyHeader]:
    """Headers of every member of an .npz file, keyed as numpy keys them (name without .npy)."""
    headers: dict[str, _NpyHeader] = {}
    with _open_zip(path) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if not info.filename.endswith(".npy"):
                raise DataError(f"{path}: member {info.filename!r} is not a .npy array")
            key = info.filename[: -len(".npy")]
            origin = f"{path}: array {key!r}"
            try:
                with zf.open(info) as fp:
                    dtype, shape, fortran = _read_npy_header(fp, origin)
            except _READ_ERRORS as err:
                raise DataError(f"{origin}: cannot read ({one_line(err)})") from None
            headers[key] = _NpyHeader(info.filename, dtype, shape, fortran)
    return headers


def _read_exact(
    fp: IO[bytes],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    origin: str,
    *,
    fortran_order: bool = False,
) -> npt.NDArray[Any]:
    """Read the next C-order (or Fortran-order) array of `shape` from `fp`, in native byte order."""
    out = np.empty(shape, dtype, order="F" if fortran_order else "C")
    # The transpose of a Fortran array is C-contiguous, so both orders fill one flat byte view.
    flat = (out.T if fortran_order else out).reshape(-1).view(np.uint8)
    try:
        got = fp.readinto(flat) if flat.size else 0  # type: ignore[attr-defined]
    except _READ_ERRORS as err:
        raise DataError(f"{origin}: cannot read ({one_line(err)})") from None
    if got != flat.size:
        raise DataError(f"{origin}: truncated (expected {flat.size} bytes, found {got})")
    return out if dtype.isnative else out.astype(_native(dtype))


def _read_member(zf: _Arrays, path: Path, key: str, member: str) -> npt.NDArray[Any]:
    """One whole .npy member (or plain .npy file), without unpickling."""
    origin = _origin(path, key)
    try:
        with zf.open(member) as fp:
            dtype, shape, fortran = _read_npy_header(fp, origin)
            return _read_exact(fp, shape, dtype, origin, fortran_order=fortran)
    except _READ_ERRORS as err:
        raise DataError(f"{origin}: cannot read ({one_line(err)})") from None


class _RowReader:
    """Reads the axis-0 rows of one .npy member (or plain .npy file) in order, one row at a
    time."""

    def __init__(self, zf: _Arrays, path: Path, key: str, header: _NpyHeader) -> None:
        self._origin = _origin(path, key)
        try:
            self._fp = zf.open(header.member)
        except _READ_ERRORS as err:
            raise DataError(f"{self._origin}: cannot read ({one_line(err)})") from None
        self._dtype, shape, fortran = _read_npy_header(self._fp, self._origin)
        self._row_shape = shape[1:]
        self._whole: npt.NDArray[Any] | None = None
        self._next = 0
        if fortran and len(shape) > 1:
            # Rows of a Fortran-order array are not contiguous in the file: read it whole.
            logger.warning(
                "%s is stored in Fortran order; it is read whole, not streamed", self._origin
            )
            self._whole = _read_exact(
                self._fp, shape, self._dtype, self._origin, fortran_order=True
            )

    def read(self) -> npt.NDArray[Any]:
        if self._whole is not None:
            row: npt.NDArray[Any] = self._whole[self._next]
            self._next += 1
            return row
        return _read_exact(self._fp, self._row_shape, self._dtype, self._origin)

    def close(self) -> None:
        self._fp.close()
        self._whole = None


def _origin(path: Path, key: str) -> str:
    """How errors name an array: a plain .npy file is its one array."""
    return str(path) if plain_npy(path) else f"{path}: array {key!r}"
