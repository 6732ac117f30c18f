"""Activation ranges in the formats of other tools, written and read back.

- ``tensorrt``: a TensorRT calibration cache. A first line ``TRT-<version>-EntropyCalibration2``,
  then ``<tensor>: <hex>`` per tensor, where hex is the big-endian bit pattern of the float32
  scale TensorRT uses for a symmetric int8 tensor, ``max(|min|, |max|) / 127``. Read back as the
  range ``[-127 * scale, 127 * scale]``.
- ``onnxruntime-overrides``: JSON for ``quantize_static(extra_options={"TensorQuantOverrides":
  ...})``, ``{"<tensor>": [{"rmin": min, "rmax": max}]}``: onnxruntime then computes scale and
  zero point from these ranges with its own formulas.
- ``onnxruntime-cache``: the JSON calibration cache of ``quantize_static(...,
  calibration_cache_path=...)`` (``onnxruntime.quantization.calibrate.save_tensors_data``):
  ``TensorsData`` of ``TensorData`` with ``lowest``/``highest`` float32 arrays.

- ``onnxruntime-table``: a folder holding what
  ``onnxruntime.quantization.quant_utils.write_calibration_table`` writes (it writes them):
  ``calibration.json`` (a map of ``TensorData``), ``calibration.flatbuffers`` and
  ``calibration.cache`` (``<tensor> <value>`` lines, value ``max(highest, lowest)``), the
  tables onnxruntime's TensorRT execution provider reads.

Reading accepts each of these files (``calibration.cache`` read as ``[-value, value]``, as
TensorRT takes a dynamic range), but not the flatbuffers table.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qcal.numerics.errors import OutputError, StatisticsError

__all__ = [
    "FORMATS", "TENSORRT_HEADER", "Ranges", "format_ranges", "parse_ranges", "ranges_of_tensors",
    "read_ranges", "write_ranges",
]

Ranges = dict[str, tuple[float, float]]
FORMATS = ("tensorrt", "onnxruntime-overrides", "onnxruntime-cache", "onnxruntime-table")
# TensorRT 8.6.1's spelling; TensorRT checks the line, so a cache for another version needs its
# own (`tensorrt:<version>`).
TENSORRT_HEADER = "TRT-8601-EntropyCalibration2"
_F32 = np.float32


def format_ranges(kind: str, ranges: Mapping[str, tuple[float, float]]) -> bytes:
    """The bytes of `ranges` (float32 min, max per tensor) in format `kind` (``tensorrt:VERSION``
    gives TensorRT's header its version)."""
    names = sorted(ranges)
    if kind == "tensorrt" or kind.startswith("tensorrt:"):
        version = kind.partition(":")[2]
        lines = [f"TRT-{version}-EntropyCalibration2" if version else TENSORRT_HEADER]
        for name in names:
            lo, hi = ranges[name]
            scale = _F32(max(abs(_F32(lo)), abs(_F32(hi)))) / _F32(127.0)
            lines.append(f"{name}: {struct.unpack('>I', struct.pack('>f', scale))[0]:08x}")
        return ("\n".join(lines) + "\n").encode()
    if kind == "onnxruntime-overrides":
        data: Any = {name: [{"rmin": _float(ranges[name][0]), "rmax": _float(ranges[name][1])}]
                     for name in names}
    elif kind == "onnxruntime-cache":
        data = {
            "CLS": "TensorsData",
            "calibration_method": {"CLS": "CalibrationMethod", "value": "CalibrationMethod.MinMax"},
            "data": {name: {"lowest": _array(ranges[name][0]), "highest": _array(ranges[name][1]),
                            "CLS": "TensorData"} for name in names},
            "smooth_quant": False,
        }
    else:
        raise StatisticsError(f"unknown ranges format {kind!r}; choose one of {', '.join(FORMATS)}")
    return (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def write_ranges(kind: str, path: Path, ranges: Mapping[str, tuple[float, float]]) -> None:
    """Write `ranges` to `path` in format `kind`, atomically (a folder's files one by one)."""
    from qcal.graph.files.atomic import write_atomic

    if kind != "onnxruntime-table":
        write_atomic(path, format_ranges(kind, ranges))
        return
    from onnxruntime.quantization.calibrate import TensorData
    from onnxruntime.quantization.quant_utils import write_calibration_table

    table = {name: TensorData(lowest=np.array(lo, dtype=_F32), highest=np.array(hi, dtype=_F32))
             for name, (lo, hi) in ranges.items()}
    try:
        path.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".qcal-table-", dir=path) as staged:
            write_calibration_table(table, dir=staged)
            for name in sorted(os.listdir(staged)):
                os.replace(os.path.join(staged, name), path / name)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None


def ranges_of_tensors(tensors: list[dict[str, Any]]) -> Ranges:
    """The per-tensor activation ranges of a report's ``tensors`` (the range each was given)."""
    found: Ranges = {}
    for entry in tensors:
        chosen = entry.get("range")
        if entry.get("role") != "activation" or not chosen or len(chosen["min"]) != 1:
            continue
        found[entry["name"]] = (float(chosen["min"][0]), float(chosen["max"][0]))
    return found


def _float(value: float) -> float:
    return float(_F32(value))


def _array(value: float) -> dict[str, Any]:
    return {"CLS": "numpy.array", "data": _float(value), "dtype": "float32"}


def parse_ranges(data: bytes, origin: str) -> tuple[str, Ranges]:
    """(format, ranges) of a ranges file's bytes, the format found from its content.

    Raises:
        StatisticsError: not one of the formats, or a malformed or non-finite entry.
    """
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise StatisticsError(f"{origin}: not a ranges file (not text)") from None
    stripped = text.strip()
    if stripped.startswith("TRT-"):
        return "tensorrt", _checked(_tensorrt(stripped, origin), origin)
    if stripped.startswith("{"):
        try:
            parsed = json.loads(stripped)
        except ValueError as err:
            raise StatisticsError(f"{origin}: invalid JSON ({err})") from None
        return _json_ranges(parsed, origin)
    return "onnxruntime-text", _checked(_text_table(stripped, origin), origin)


def _tensorrt(text: str, origin: str) -> Ranges:
    ranges: Ranges = {}
    for number, line in enumerate(text.splitlines()[1:], start=2):
        name, sep, value = line.rpartition(":")
        try:
            bits = int(value.strip(), 16)
            scale = struct.unpack(">f", struct.pack(">I", bits))[0]
        except (ValueError, struct.error, OverflowError):
            raise StatisticsError(f"{origin}: line {number}: expected '<tensor>: <hex scale>'") from None
        if not sep or not name.strip():
            raise StatisticsError(f"{origin}: line {number}: expected '<tensor>: <hex scale>'")
        amax = float(_F32(scale) * _F32(127.0))
        ranges[name.strip()] = (-amax, amax)
    return ranges


def _text_table(text: str, origin: str) -> Ranges:
    ranges: Ranges = {}
    for number, line in enumerate(text.splitlines(), start=1):
        name, _, value = line.strip().rpartition(" ")
        try:
            amax = abs(float(value))
        except ValueError:
            raise StatisticsError(f"{origin}: line {number}: not a ranges file line "
                                  "('<tensor> <value>', TensorRT's 'TRT-...' header, or JSON)") from None
        if not name:
            raise StatisticsError(f"{origin}: line {number}: expected '<tensor> <value>'")
        ranges[name] = (-amax, amax)
    return ranges


def _json_ranges(parsed: Any, origin: str) -> tuple[str, Ranges]:
    if not isinstance(parsed, dict):
        raise StatisticsError(f"{origin}: expected a JSON object of tensors")
    if parsed.get("CLS") == "TensorsData":
        entries, kind = parsed.get("data"), "onnxruntime-cache"
    else:
        entries, kind = parsed, "onnxruntime-overrides"
    if not isinstance(entries, dict):
        raise StatisticsError(f"{origin}: expected a JSON object of tensors")
    ranges: Ranges = {}
    for name, entry in entries.items():
        try:
            if isinstance(entry, list):  # TensorQuantOverrides: one dict per tensor (or channel)
                if len(entry) != 1:
                    raise StatisticsError(f"{origin}: tensor {name!r}: per-channel overrides are "
                                          "not activation ranges")
                lo, hi = float(entry[0]["rmin"]), float(entry[0]["rmax"])
            else:  # TensorData, in a TensorsData cache or write_calibration_table's JSON
                kind = "onnxruntime-cache"
                lo, hi = _value(entry["lowest"]), _value(entry["highest"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise StatisticsError(
                f"{origin}: tensor {name!r}: expected rmin/rmax (TensorQuantOverrides) or "
                "lowest/highest (an onnxruntime calibration cache); scale/zero_point overrides "
                "are not ranges") from None
        ranges[str(name)] = (lo, hi)
    return kind, _checked(ranges, origin)


def _value(item: Any) -> float:
    if isinstance(item, dict):
        item = item["data"]
    values = np.asarray(item, dtype=np.float64).reshape(-1)
    if values.size != 1:
        raise ValueError("not one value")
    return float(values[0])


def _checked(ranges: Ranges, origin: str) -> Ranges:
    if not ranges:
        raise StatisticsError(f"{origin}: holds no tensor ranges")
    for name, (lo, hi) in ranges.items():
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise StatisticsError(f"{origin}: tensor {name!r}: range [{lo}, {hi}] is not a "
                                  "finite range")
    with np.errstate(over="ignore"):
        found = {name: (float(_F32(lo)), float(_F32(hi))) for name, (lo, hi) in ranges.items()}
    for name, (lo, hi) in found.items():
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise StatisticsError(f"{origin}: tensor {name!r}: range beyond float32")
    return found


def read_ranges(path: Path) -> tuple[str, Ranges]:
    """(format, ranges) of the ranges file at `path`."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise StatisticsError(f"{path}: cannot read ranges file ({err.strerror or err})") from None
    return parse_ranges(data, str(path))
