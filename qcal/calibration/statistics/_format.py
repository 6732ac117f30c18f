"""The statistics file: a zip (readable as an ``.npz``) holding ``header.json`` and ``.npy`` arrays.

Bytes are deterministic: members in a fixed order, a fixed timestamp, JSON with sorted keys, and
``.npy`` arrays written by numpy's own format writer (little-endian, C order, never objects).
Reading never unpickles (``allow_pickle=False``), checks the header's shape against
``statistics.schema.json`` (by hand: no dependency beyond numpy) and names the file on any fault.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qcal.numerics.errors import StatisticsError

__all__ = ["FORMAT", "VERSION", "decode", "encode", "read_file"]

FORMAT = "qcal-statistics"
VERSION = 1
HEADER = "header.json"
_ARRAYS = "arrays/"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: no clock in the bytes
# Top-level keys of the header and their JSON types (statistics.schema.json says the same).
_REQUIRED: Mapping[str, type | tuple[type, ...]] = {
    "format": str, "version": int, "complete": bool, "model": dict, "plan": dict, "data": dict,
    "providers": list, "tensors": list,
}


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """The file's bytes: ``header.json`` first, then ``arrays/<name>.npy`` in name order."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False)
        _add(archive, HEADER, text.encode())
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]),
                                      allow_pickle=False)
            _add(archive, f"{_ARRAYS}{name}.npy", member.getvalue())
    return buffer.getvalue()


def _add(archive: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    archive.writestr(info, data, compresslevel=6)


def decode(data: bytes, origin: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, arrays) of a statistics file's bytes; `origin` names it in errors.

    Raises:
        StatisticsError: not a statistics file, another format version, or a malformed part.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except _DAMAGE:
        raise StatisticsError(f"{origin}: not a qcal statistics file (not a readable zip "
                              "archive)") from None
    with archive:
        names = archive.namelist()
        if HEADER not in names:
            raise StatisticsError(f"{origin}: not a qcal statistics file (no {HEADER})")
        try:
            header = json.loads(archive.read(HEADER))
            arrays = {
                name[len(_ARRAYS):-len(".npy")]: _read_npy(archive, name)
                for name in names if name.startswith(_ARRAYS) and name.endswith(".npy")
            }
        except _DAMAGE as err:
            raise StatisticsError(f"{origin}: unreadable statistics file "
                                  f"({type(err).__name__}: {err})") from None
    check_header(header, origin)
    return header, arrays


# What damaged bytes make zipfile, zlib, json and numpy's .npy reader raise.
_DAMAGE = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, ValueError, OSError, EOFError,
           NotImplementedError, RuntimeError, struct.error, KeyError, IndexError, OverflowError)


def _read_npy(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    """One ``.npy`` member, never unpickled, its declared size checked before any allocation."""
    data = archive.read(name)
    buffer = io.BytesIO(data)
    version = np.lib.format.read_magic(buffer)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(buffer)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(buffer)
    else:
        raise ValueError(f"{name}: .npy format version {version}")
    if dtype.hasobject or math.prod(shape) * dtype.itemsize > len(data):
        raise ValueError(f"{name}: declares more data than it holds, or objects")
    buffer.seek(0)
    return np.lib.format.read_array(buffer, allow_pickle=False)


def check_header(header: Any, origin: str) -> None:
    """The checks of statistics.schema.json that reading relies on."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise StatisticsError(f"{origin}: not a qcal statistics file")
    if header.get("version") != VERSION:
        raise StatisticsError(
            f"{origin}: statistics format version {header.get('version')!r}; this qcal reads "
            f"version {VERSION}")
    for key, kind in _REQUIRED.items():
        if not isinstance(header.get(key), kind):
            raise StatisticsError(f"{origin}: malformed statistics header: {key!r} is missing "
                                  "or of the wrong type")
    value = header["data"].get("samples")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StatisticsError(f"{origin}: malformed statistics header: data.samples")
    if not isinstance(header["model"].get("sha256"), str):
        raise StatisticsError(f"{origin}: malformed statistics header: model.sha256")
    for entry in header["tensors"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("observers"), dict)):
            raise StatisticsError(f"{origin}: malformed statistics header: a tensors entry")


def read_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, arrays) of the statistics file at `path`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StatisticsError(f"{path}: statistics file not found") from None
    except OSError as err:
        raise StatisticsError(f"{path}: cannot read statistics file ({err.strerror or err})") from None
    return decode(data, str(path))
