"""Damaged statistics and ranges files: whatever the damage, reading them gives a
StatisticsError naming the file (exit 8), never another exception."""

from __future__ import annotations

import functools
import io
import json
import os
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcal._collection import collect_statistics
from qcal.calibration.statistics import Statistics
from qcal.calibration.statistics._exchange import parse_ranges
from qcal.config import CalibrationConfig
from qcal.numerics.errors import StatisticsError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "sample_models" / "digits_cnn.onnx"
EXAMPLES = int(os.environ.get("QCAL_FUZZ_EXAMPLES", "150"))


@functools.cache
def good() -> bytes:
    """A small statistics file (a global, not a fixture: examples print their arguments)."""
    return collect_statistics(DIGITS, CalibrationConfig(limit=8)).to_bytes()


def _with_header(data: bytes, header: object) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, json.dumps(header) if name == "header.json" else src.read(name))
    return out.getvalue()


def _mutate(value: object, path: list[int], replacement: object) -> object:
    """`value` with the node reached by walking `path` (indices modulo the children) replaced."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return replacement
    keys = sorted(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[key] = _mutate(value[key], path[1:], replacement)  # type: ignore[index]
    return copy


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6,
)


def _read(data: bytes) -> None:
    try:
        Statistics.from_bytes(data, "damaged.stats")
    except StatisticsError as err:
        assert "damaged.stats" in str(err)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(path=st.lists(st.integers(0, 50), max_size=8), replacement=json_values)
def test_any_damaged_header_is_a_statistics_error(path: list[int], replacement: object) -> None:
    with zipfile.ZipFile(io.BytesIO(good())) as archive:
        header = json.loads(archive.read("header.json"))
    _read(_with_header(good(), _mutate(header, path, replacement)))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(where=st.integers(0, 10**9), byte=st.integers(0, 255), cut=st.booleans())
def test_any_damaged_byte_is_a_statistics_error(where: int, byte: int, cut: bool) -> None:
    data = good()
    position = where % len(data)
    data = data[:position] if cut else data[:position] + bytes([byte]) + data[position + 1:]
    _read(data)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_any_ranges_text_is_read_or_refused(text: str) -> None:
    for prefix in ("", "TRT-8601-EntropyCalibration2\n", "{"):
        try:
            parse_ranges((prefix + text).encode(), "r.cache")
        except StatisticsError as err:
            assert "r.cache" in str(err)


def test_observers_under_the_wrong_key_are_refused() -> None:
    with zipfile.ZipFile(io.BytesIO(good())) as archive:
        header = json.loads(archive.read("header.json"))
    entry = header["tensors"][0]["observers"]
    swapped = {"histogram": entry["minmax"], "minmax": entry["histogram"]}
    header["tensors"][0]["observers"] = swapped
    with pytest.raises(StatisticsError, match="observer is a"):
        Statistics.from_bytes(_with_header(good(), header), "swapped.stats")
    header["tensors"][0]["observers"] = {"kl": entry["minmax"]}
    with pytest.raises(StatisticsError, match="unknown observer key"):
        Statistics.from_bytes(_with_header(good(), header), "swapped.stats")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(path=st.lists(st.integers(0, 50), min_size=3, max_size=8), replacement=json_values,
       method=st.sampled_from(["minmax", "percentile", "entropy", "mse"]))
def test_damaged_states_that_load_give_ranges_or_qcal_errors(
    path: list[int], replacement: object, method: str
) -> None:
    """A state damaged so that it still loads: choosing a range from it raises a QcalError
    (a documented exit code) or gives a range, never another exception."""
    from qcal.numerics.errors import QcalError
    from qcal.numerics.presets import build_preset
    from qcal.numerics.ranges import HistogramSettings, choose_range

    with zipfile.ZipFile(io.BytesIO(good())) as archive:
        header = json.loads(archive.read("header.json"))
    header["tensors"] = _mutate(header["tensors"], path, replacement)
    try:
        stats = Statistics.from_bytes(_with_header(good(), header), "damaged.stats")
    except StatisticsError:
        return
    recipe = build_preset("pytorch", {}).activation
    key = "minmax" if method == "minmax" else "histogram"
    for observers in stats.observers.values():
        if key not in observers:
            continue
        try:
            choose_range(observers[key], recipe, method, HistogramSettings(99.99, 2048, 128))
        except QcalError:
            pass
