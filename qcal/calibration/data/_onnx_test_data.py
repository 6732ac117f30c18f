"""Reader of ONNX model-zoo test data: folders ``test_data_set_K`` of ``input_J.pb`` TensorProto
files, one set per sample in numeric order of K.

Headers (dims, data type, name) are read by walking the protobuf wire format, skipping the
payload, so validation never loads a tensor; a file is parsed whole only when its turn comes.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import onnx
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
from onnx import numpy_helper

from qcal.calibration.data._source import ArrayInfo, SampleLayout, _check_names, _quoted, _visible
from qcal.calibration.runtime import Feed
from qcal.numerics.errors import DataError, one_line

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec

logger = logging.getLogger(__name__)

_SET_RE = re.compile(r"test_data_set_(\d+)")
_INPUT_PB_RE = re.compile(r"input_(\d+)\.pb")


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
        raise DataError(f"{path}: cannot read TensorProto ({one_line(err)})") from None
    return _TensorHeader(name, data_type, tuple(dims), is_external)


def _tensor_dtype(header: _TensorHeader, path: Path) -> np.dtype[Any]:
    if header.is_external:
        raise DataError(f"{path}: tensor data stored externally is not supported in test data")
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(header.data_type))
    except (KeyError, ValueError, TypeError):
        raise DataError(f"{path}: unknown TensorProto data_type {header.data_type}") from None
    return dtype  # strings come as object arrays: passed to the model, never observed


def _load_tensor(path: Path) -> npt.NDArray[Any]:
    _tensor_dtype(_read_tensor_header(path), path)  # refuse external/string/unknown first
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
        return numpy_helper.to_array(tensor)
    except (DecodeError, ValueError) as err:  # corrupt wire format; payload size != dims
        raise DataError(f"{path}: cannot read TensorProto ({one_line(err)})") from None


def _test_data_sets(folder: Path) -> list[Path]:
    found = [(m, p) for p in _visible(folder) if (m := _SET_RE.fullmatch(p.name)) and p.is_dir()]
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1)))]


def _input_pb_files(folder: Path) -> list[tuple[int, Path]]:
    found = [(m, p) for p in _visible(folder) if (m := _INPUT_PB_RE.fullmatch(p.name))]
    return sorted(((int(m.group(1)), p) for m, p in found), key=lambda jp: jp[0])
