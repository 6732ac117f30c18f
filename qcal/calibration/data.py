"""Calibration data: sources that stream model feeds, their validation, and batching.

A *sample* is one full model feed: a dict from model input name to array, with the model's batch
dimension (of size 1 when the data has none of its own). Sources read one sample at a time and
keep no reference to what they yielded, so memory does not grow with the size of the data set.
Each source is an iterable: every call of `samples()` gives a fresh iterator from the start.

Formats (`open_data`):

- ``.npz`` file, one array per model input, axis 0 = sample. An array of the model input's rank
  gives samples ``x[i:i+1]`` (the model's dim 0 is the batch); one of rank + 1 gives ``x[i]`` (a
  full feed per sample). Members are read row by row from the zip stream, stored or deflated:
  only one sample per input is in memory. Exception: a member saved in Fortran order has no
  contiguous rows and is read whole (logged as a warning).
- A folder of ``.npz`` files, one sample (full feed) each, in file-name order; shapes may differ
  between samples. Each file is read when its turn comes.
- ONNX model-zoo folders ``test_data_set_K/input_J.pb`` (J = position among the model inputs; if
  every file of a set names a model input in its ``name`` field, the names are used instead), in
  numeric order of K. Each file is read when its turn comes.
- Synthetic: N random samples from the model's input specs (see `SyntheticSource`).

`validate_data` reads only headers: the ``.npy`` headers inside the zips, and the dims/type/name
fields of the TensorProto files (tensor payloads are skipped, not read). Values are never scanned
for NaN/Inf here (too costly); `find_nonfinite` names the culprit once a problem shows up.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import onnx
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
from onnx import numpy_helper

from qcal.numerics.errors import ConfigError, DataError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec

__all__ = [
    "SYNTHETIC_FREE_DIM",
    "SYNTHETIC_INT_HIGH",
    "ArrayInfo",
    "DataSource",
    "NpzDirSource",
    "NpzSource",
    "OnnxTestDataSource",
    "SampleLayout",
    "SyntheticSource",
    "find_nonfinite",
    "iter_batches",
    "open_data",
    "validate_data",
]

logger = logging.getLogger(__name__)

Feed = dict[str, npt.NDArray[Any]]

SYNTHETIC_FREE_DIM = 1
"""Size given to a symbolic or unknown dimension in synthetic data (dim 0, the batch, is also 1)."""
SYNTHETIC_INT_HIGH = 10
"""Synthetic integer inputs are drawn uniformly from [0, SYNTHETIC_INT_HIGH)."""

_SET_RE = re.compile(r"test_data_set_(\d+)")
_INPUT_PB_RE = re.compile(r"input_(\d+)\.pb")


class DataSource(Protocol):
    """Calibration samples, streamed; `samples()` starts afresh on every call."""

    kind: str  # "npz" | "npz-dir" | "onnx-test-data" | "synthetic"
    path: Path | None
    is_synthetic: bool

    def num_samples(self) -> int | None:
        """Number of samples `samples()` yields (after the limit), or None if unknown."""
        ...

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator over the samples, one full model feed each."""
        ...


@dataclass(frozen=True)
class ArrayInfo:
    """Where one input of a sample comes from, and its dtype and shape as fed to the model."""

    origin: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SampleLayout:
    """The arrays of one sample (or of every sample of an .npz file), known from headers only."""

    origin: str
    arrays: Mapping[str, ArrayInfo]


@runtime_checkable
class _DescribedSource(Protocol):
    def layouts(self) -> Iterator[SampleLayout]: ...


# --------------------------------------------------------------------------------------------
# .npy members of zip files


@dataclass(frozen=True)
class _NpyHeader:
    member: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran_order: bool


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


@contextlib.contextmanager
def _open_zip(path: Path) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise DataError(f"{path}: not a readable .npz file ({_one_line(err)})") from None
    with zf:
        yield zf


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
        raise DataError(f"{origin}: not a valid .npy array ({_one_line(err)})") from None
    if dtype.hasobject:
        # Object arrays can only be stored pickled; loading a pickle can run arbitrary code.
        raise DataError(
            f"{origin}: holds Python objects (a pickled object array); qcal never unpickles data,"
            " save numeric arrays instead"
        )
    return dtype, tuple(int(d) for d in shape), bool(fortran_order)


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
                raise DataError(f"{origin}: cannot read ({_one_line(err)})") from None
            headers[key] = _NpyHeader(info.filename, dtype, shape, fortran)
    return headers


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    native: np.dtype[Any] = dtype.newbyteorder("=")
    return native


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
        raise DataError(f"{origin}: cannot read ({_one_line(err)})") from None
    if got != flat.size:
        raise DataError(f"{origin}: truncated (expected {flat.size} bytes, found {got})")
    return out if dtype.isnative else out.astype(_native(dtype))


def _read_member(zf: zipfile.ZipFile, path: Path, key: str, member: str) -> npt.NDArray[Any]:
    """One whole .npy member, without unpickling."""
    origin = f"{path}: array {key!r}"
    try:
        with zf.open(member) as fp:
            dtype, shape, fortran = _read_npy_header(fp, origin)
            return _read_exact(fp, shape, dtype, origin, fortran_order=fortran)
    except _READ_ERRORS as err:
        raise DataError(f"{origin}: cannot read ({_one_line(err)})") from None


class _RowReader:
    """Reads the axis-0 rows of one .npy member in order, one row at a time."""

    def __init__(self, zf: zipfile.ZipFile, path: Path, key: str, header: _NpyHeader) -> None:
        self._origin = f"{path}: array {key!r}"
        try:
            self._fp = zf.open(header.member)
        except _READ_ERRORS as err:
            raise DataError(f"{self._origin}: cannot read ({_one_line(err)})") from None
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


# --------------------------------------------------------------------------------------------
# names shared by every format


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _check_names(origin: str, keys: Iterable[str], inputs: Sequence[InputSpec]) -> None:
    """Raise DataError if the data's names are not exactly the model's input names."""
    found = set(keys)
    expected = [spec.name for spec in inputs]
    missing = [name for name in expected if name not in found]
    extra = sorted(found.difference(expected))
    if not missing and not extra:
        return
    problems = []
    if missing:
        problems.append(f"missing input{'s' if len(missing) > 1 else ''} {_quoted(missing)}")
    if extra:
        verb = "is not a model input" if len(extra) == 1 else "are not model inputs"
        problems.append(f"{_quoted(extra)} {verb}")
    raise DataError(f"{origin}: {'; '.join(problems)} (model inputs: {_quoted(expected)})")


# --------------------------------------------------------------------------------------------
# sources


class NpzSource:
    """One .npz file, one array per model input, axis 0 = sample; read row by row."""

    kind = "npz"
    is_synthetic = False

    def __init__(
        self, path: Path, inputs: Sequence[InputSpec], *, limit: int | None = None
    ) -> None:
        """Read the member headers (not the data) and count the samples.

        Raises:
            DataError: unreadable file, object arrays, or arrays of different lengths.
        """
        self.path: Path | None = path
        self._file = path
        self._inputs = tuple(inputs)
        self._headers = _read_npz_headers(path)
        counts = {key: h.shape[0] for key, h in self._headers.items() if h.shape}
        if len(set(counts.values())) > 1:
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
        with _open_zip(self._file) as zf, contextlib.ExitStack() as stack:
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


class NpzDirSource:
    """A folder of .npz files, one sample (full model feed) each, in file-name order."""

    kind = "npz-dir"
    is_synthetic = False

    def __init__(
        self, path: Path, inputs: Sequence[InputSpec], *, limit: int | None = None
    ) -> None:
        """List the .npz files (hidden files are ignored); nothing is read yet."""
        self.path: Path | None = path
        self._inputs = tuple(inputs)
        self._files = _npz_files(path)[:limit]

    def num_samples(self) -> int:
        """Number of .npz files, capped by the limit."""
        return len(self._files)

    def layouts(self) -> Iterator[SampleLayout]:
        """One layout per file, from its .npy headers."""
        for file in self._files:
            headers = _read_npz_headers(file)
            yield SampleLayout(
                str(file), {k: ArrayInfo(str(file), h.dtype, h.shape) for k, h in headers.items()}
            )

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator reading one file per sample."""
        for file in self._files:
            with _open_zip(file) as zf:
                members = {n[: -len(".npy")]: n for n in zf.namelist() if n.endswith(".npy")}
                _check_names(str(file), members, self._inputs)
                yield {
                    s.name: _read_member(zf, file, s.name, members[s.name]) for s in self._inputs
                }


@dataclass(frozen=True)
class _TensorHeader:
    name: str
    data_type: int
    dims: tuple[int, ...]
    is_external: bool


class OnnxTestDataSource:
    """ONNX model-zoo folders test_data_set_K holding input_J.pb TensorProto files."""

    kind = "onnx-test-data"
    is_synthetic = False

    def __init__(
        self,
        path: Path,
        sets: Sequence[Path],
        inputs: Sequence[InputSpec],
        *,
        limit: int | None = None,
    ) -> None:
        """Use `sets` (folders, in the given order) of the data at `path`; nothing is read yet.

        Raises:
            DataError: a set holds no input_J.pb file.
        """
        self.path: Path | None = path
        self._inputs = tuple(inputs)
        self._sets = list(sets)[:limit]
        self._files = [_input_pb_files(folder) for folder in self._sets]
        for folder, files in zip(self._sets, self._files):
            if not files:
                raise DataError(f"{folder}: no input_J.pb files in this test data set")

    def num_samples(self) -> int:
        """Number of test data sets, capped by the limit."""
        return len(self._sets)

    def _names(
        self, folder: Path, files: list[tuple[int, Path]], headers: list[_TensorHeader]
    ) -> list[str]:
        """Model input name of each file: by tensor names if all name inputs, else by position J."""
        expected = [spec.name for spec in self._inputs]
        names = [h.name for h in headers]
        if all(n in expected for n in names) and len(set(names)) == len(names):
            return names
        if any(names):
            logger.info("%s: tensor names are not all model input names; using positions", folder)
        positions = [j for j, _ in files]
        for j, file in files:
            if positions.count(j) > 1:
                raise DataError(f"{file}: another input file of {folder} has position {j} too")
            if j >= len(expected):
                raise DataError(
                    f"{file}: no model input at position {j} (the model has {len(expected)}"
                    f" input{'s' if len(expected) != 1 else ''}: {_quoted(expected)})"
                )
        return [expected[j] for j, _ in files]

    def layouts(self) -> Iterator[SampleLayout]:
        """One layout per set, from the TensorProto headers (payloads are skipped)."""
        for folder, files in zip(self._sets, self._files):
            headers = [_read_tensor_header(file) for _, file in files]
            arrays = {}
            for name, (_, file), header in zip(self._names(folder, files, headers), files, headers):
                arrays[name] = ArrayInfo(str(file), _tensor_dtype(header, file), header.dims)
            yield SampleLayout(str(folder), arrays)

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator reading one set per sample."""
        for folder, files in zip(self._sets, self._files):
            headers = [_read_tensor_header(file) for _, file in files]
            names = self._names(folder, files, headers)
            _check_names(str(folder), names, self._inputs)
            yield {name: _load_tensor(file) for name, (_, file) in zip(names, files)}


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


# --------------------------------------------------------------------------------------------
# TensorProto files


def _read_varint(fp: IO[bytes], origin: Path) -> int:
    value = shift = 0
    while True:
        byte = fp.read(1)
        if not byte:
            raise DataError(f"{origin}: truncated TensorProto")
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise DataError(f"{origin}: not a TensorProto (bad varint)")


def _as_dim(value: int, origin: Path) -> int:
    dim = value - (1 << 64) if value >= 1 << 63 else value  # int64 two's complement
    if dim < 0:
        raise DataError(f"{origin}: TensorProto has a negative dim {dim}")
    return dim


def _read_tensor_header(path: Path) -> _TensorHeader:
    """dims, data_type, name and data location of a TensorProto file, skipping its payload.

    Walks the protobuf wire format; length-delimited payload fields (raw_data, float_data, ...)
    are seeked over, so only a few bytes are read whatever the tensor size.
    """
    dims: list[int] = []
    data_type = 0
    name = ""
    is_external = False
    try:
        with path.open("rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            while fp.tell() < size:
                key = _read_varint(fp, path)
                field, wire = key >> 3, key & 7
                if wire == 0:
                    value = _read_varint(fp, path)
                    if field == 1:
                        dims.append(_as_dim(value, path))
                    elif field == 2:
                        data_type = value
                    elif field == 14:
                        is_external = value == onnx.TensorProto.EXTERNAL
                elif wire == 2:
                    length = _read_varint(fp, path)
                    if field == 1:  # packed dims
                        packed = io.BytesIO(fp.read(length))
                        while packed.tell() < length:
                            dims.append(_as_dim(_read_varint(packed, path), path))
                    elif field == 8:
                        name = fp.read(length).decode("utf-8")
                    else:
                        is_external = is_external or field == 13  # external_data entries
                        fp.seek(length, io.SEEK_CUR)
                elif wire in (1, 5):
                    fp.seek(8 if wire == 1 else 4, io.SEEK_CUR)
                else:
                    raise DataError(f"{path}: not a TensorProto (wire type {wire})")
            if fp.tell() != size:
                raise DataError(f"{path}: truncated TensorProto")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read TensorProto ({_one_line(err)})") from None
    return _TensorHeader(name, data_type, tuple(dims), is_external)


def _tensor_dtype(header: _TensorHeader, path: Path) -> np.dtype[Any]:
    if header.is_external:
        raise DataError(f"{path}: tensor data stored externally is not supported in test data")
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(header.data_type))
    except (KeyError, ValueError, TypeError):
        raise DataError(f"{path}: unknown TensorProto data_type {header.data_type}") from None
    if dtype.hasobject:
        raise DataError(f"{path}: string tensors are not supported as calibration data")
    return dtype


def _load_tensor(path: Path) -> npt.NDArray[Any]:
    _tensor_dtype(_read_tensor_header(path), path)  # refuse external/string/unknown first
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
        return numpy_helper.to_array(tensor)
    except (DecodeError, ValueError) as err:  # corrupt wire format; payload size != dims
        raise DataError(f"{path}: cannot read TensorProto ({_one_line(err)})") from None


# --------------------------------------------------------------------------------------------
# finding data


def _visible(folder: Path) -> list[Path]:
    try:
        return sorted(
            (p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.name
        )
    except OSError as err:
        raise DataError(f"{folder}: cannot list folder ({_one_line(err)})") from None


def _npz_files(folder: Path) -> list[Path]:
    return [p for p in _visible(folder) if p.suffix == ".npz" and p.is_file()]


def _test_data_sets(folder: Path) -> list[Path]:
    found = [(m, p) for p in _visible(folder) if (m := _SET_RE.fullmatch(p.name)) and p.is_dir()]
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1)))]


def _input_pb_files(folder: Path) -> list[tuple[int, Path]]:
    found = [(m, p) for p in _visible(folder) if (m := _INPUT_PB_RE.fullmatch(p.name))]
    return sorted(((int(m.group(1)), p) for m, p in found), key=lambda jp: jp[0])


def _open_path(path: Path, inputs: Sequence[InputSpec], limit: int | None) -> DataSource:
    if not path.exists():
        raise DataError(f"{path}: calibration data not found")
    if not path.is_dir():
        if path.suffix.lower() == ".npz":
            return NpzSource(path, inputs, limit=limit)
        raise DataError(
            f"{path}: unsupported data file; expected an .npz file, a folder of .npz files or"
            " test_data_set_* folder(s)"
        )
    if _input_pb_files(path):
        return OnnxTestDataSource(path, [path], inputs, limit=limit)
    sets, npzs = _test_data_sets(path), _npz_files(path)
    if sets and npzs:
        raise DataError(
            f"{path}: holds both .npz files and test_data_set_* folders; point --data at one kind"
        )
    if sets:
        return OnnxTestDataSource(path, sets, inputs, limit=limit)
    if npzs:
        return NpzDirSource(path, inputs, limit=limit)
    raise DataError(
        f"{path}: no calibration data in this folder; expected .npz files, input_J.pb files or"
        " test_data_set_* folders"
    )


def _discover(model_path: Path, inputs: Sequence[InputSpec], limit: int | None) -> DataSource:
    """Data beside the model: <stem>.calib.npz (names this model, so it wins), test_data_set_*."""
    folder = model_path.parent
    calib = folder / f"{model_path.stem}.calib.npz"
    if calib.is_file():
        logger.info("using calibration data found beside the model: %s", calib)
        return NpzSource(calib, inputs, limit=limit)
    sets = _test_data_sets(folder)
    if sets:
        logger.info(
            "using %d test_data_set folder(s) found beside the model in %s", len(sets), folder
        )
        return OnnxTestDataSource(folder, sets, inputs, limit=limit)
    raise DataError(
        f"{model_path}: no calibration data given and none found beside the model (looked for"
        f" {calib.name} and test_data_set_* folders); pass --data PATH (an .npz file, a folder of"
        " .npz files or test_data_set_* folders) or --synthetic N for random, uncalibrated data"
    )


# --------------------------------------------------------------------------------------------
# public functions


def open_data(
    path: Path | None,
    *,
    model_path: Path,
    inputs: Sequence[InputSpec],
    synthetic: int | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> DataSource:
    """Open the calibration data at `path`, or find it beside the model, or make it up.

    Args:
        path: an .npz file, a folder of .npz files, a test_data_set_K folder or a folder of them;
            None looks beside `model_path` for ``<stem>.calib.npz``, then ``test_data_set_*``.
        model_path: the model the data is for (where discovery looks).
        inputs: the model's inputs (decide how .npz arrays are split and how .pb files map).
        synthetic: make this many random samples instead (`SyntheticSource`); excludes `path`.
        limit: use at most this many samples.
        seed: seed of the synthetic data.

    Raises:
        ConfigError: limit or synthetic below 1, or synthetic together with path.
        DataError: data missing, unreadable, or holding no samples.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be a positive number of samples, got {limit}")
    if synthetic is not None:
        if path is not None:
            raise ConfigError(f"--synthetic {synthetic} and --data {path} exclude each other")
        if synthetic < 1:
            raise ConfigError(f"--synthetic must be a positive number of samples, got {synthetic}")
        count = synthetic if limit is None else min(synthetic, limit)
        return SyntheticSource(inputs, count=count, seed=seed)
    source = (
        _open_path(path, inputs, limit)
        if path is not None
        else _discover(model_path, inputs, limit)
    )
    if source.num_samples() == 0:
        raise DataError(f"{source.path}: the calibration data holds no samples")
    return source


def _shape_str(spec: InputSpec) -> str:
    dims = ["?" if d is None else str(d) for d in spec.shape]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _check_array(spec: InputSpec, info: ArrayInfo) -> None:
    where = f"{info.origin}: input {spec.name!r}"
    expected_dtype = np.dtype(spec.dtype)
    if _native(info.dtype) != expected_dtype:
        raise DataError(f"{where} has dtype {info.dtype}, model expects {expected_dtype}")
    if len(info.shape) != len(spec.shape):
        raise DataError(
            f"{where} has rank {len(info.shape)} (shape {info.shape}), model expects rank"
            f" {len(spec.shape)} (shape {_shape_str(spec)})"
        )
    for axis, (found, want) in enumerate(zip(info.shape, spec.shape)):
        if isinstance(want, int) and found != want:
            raise DataError(
                f"{where} has size {found} on axis {axis} (shape {info.shape}), model expects"
                f" {want} (shape {_shape_str(spec)})"
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


def _can_concatenate(inputs: Sequence[InputSpec]) -> bool:
    """Every input has a dim 0 that is not fixed, so samples can be joined along it."""
    return all(spec.shape and not isinstance(spec.shape[0], int) for spec in inputs)


def _joinable(first: Feed, sample: Feed) -> bool:
    return first.keys() == sample.keys() and all(
        a.ndim >= 1 and a.dtype == sample[k].dtype and a.shape[1:] == sample[k].shape[1:]
        for k, a in first.items()
    )


def _join(pending: list[Feed]) -> Feed:
    if len(pending) == 1:
        return pending[0]
    return {k: np.concatenate([s[k] for s in pending], axis=0) for k in pending[0]}


def iter_batches(
    source: DataSource, inputs: Sequence[InputSpec], batch_size: int
) -> Iterator[tuple[Feed, int]]:
    """Yield (feed, number of samples in it), joining up to `batch_size` samples along axis 0.

    Samples are joined (concatenated on the model's dim 0) only when every model input has a
    symbolic or unknown dim 0; otherwise each sample is its own batch. Consecutive samples whose
    other dims or dtypes differ are not joined: the batch so far is yielded and a new one starts,
    so varying shapes give smaller batches, never an error. Order is the data order.

    Raises:
        ConfigError: batch_size below 1.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    return _batches(source, batch_size if _can_concatenate(inputs) else 1)


def _batches(source: DataSource, batch_size: int) -> Iterator[tuple[Feed, int]]:
    pending: list[Feed] = []
    for sample in source.samples():
        if pending and not _joinable(pending[0], sample):
            batch, n, pending = _join(pending), len(pending), []
            yield batch, n
            del batch
        pending.append(sample)
        del sample  # only `pending` may hold it, so it goes when the batch is yielded
        if len(pending) == batch_size:
            batch, n, pending = _join(pending), len(pending), []
            yield batch, n
            del batch
    if pending:
        yield _join(pending), len(pending)


def find_nonfinite(feed: Mapping[str, npt.NDArray[Any]]) -> list[str]:
    """Names of the inputs of `feed` holding NaN or ±Inf, in feed order (for a clear message)."""
    return [
        name
        for name, array in feed.items()
        if array.dtype.kind in "fc" and not bool(np.isfinite(array).all())
    ]
