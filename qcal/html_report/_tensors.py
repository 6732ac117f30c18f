"""What the page says of each tensor, read from the report: the quantization grid's range, a
quality figure, and the order "worst first" the histograms follow."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TensorView", "tensor_views"]

_TYPE_LIMITS = {
    "int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535),
    "int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3),
    "int32": (-(2**31), 2**31 - 1),
}


@dataclass(frozen=True)
class TensorView:
    entry: Mapping[str, Any]          # the report's tensors[] entry
    grid: tuple[float, float] | None  # what the per-tensor grid represents, None per channel
    sqnr_db: float | None             # measured alone (sensitivity) or estimated, see below
    sqnr_measured: bool
    rank: int                         # 0 is the worst

    @property
    def name(self) -> str:
        return str(self.entry["name"])


def _grid(entry: Mapping[str, Any]) -> tuple[float, float] | None:
    onnx = entry["onnx"]
    if len(onnx["scale"]) != 1:
        return None
    qparams = entry.get("qparams")
    if qparams is not None:
        qmin, qmax = qparams["quant_min"], qparams["quant_max"]
    else:
        qmin, qmax = _TYPE_LIMITS.get(onnx["type"], (0, 0))
    scale, zero = float(onnx["scale"][0]), float(onnx["zero_point"][0])
    return (qmin - zero) * scale, (qmax - zero) * scale


def estimated_sqnr_db(histogram: Mapping[str, Any], grid: tuple[float, float],
                      scale: float) -> float | None:
    """Signal over quantization noise of the tensor, from its stored histogram: each bin's
    values taken at its centre; inside the grid the rounding noise of a uniform step
    (scale^2 / 12), outside it the distance to the grid's end. An estimate: the stored
    histogram is coarse (see the README)."""
    counts = np.asarray(histogram["counts"], dtype=np.float64)
    low, high = float(histogram["low"]), float(histogram["high"])
    edges = np.linspace(low, high, counts.size + 1)
    centres = (edges[:-1] + edges[1:]) / 2 if high > low else np.array([low])
    signal = float(np.sum(counts * centres**2))
    clipped = np.clip(centres, grid[0], grid[1])
    inside = centres == clipped
    noise = float(np.sum(counts[inside]) * scale**2 / 12 + np.sum(counts * (centres - clipped)**2))
    if signal <= 0.0 or noise <= 0.0:
        return None
    return 10.0 * math.log10(signal / noise)


def tensor_views(report: Mapping[str, Any]) -> list[TensorView]:
    """Every tensor of the report, worst first: in the order of the sensitivity measurement
    when there is one, then by their SQNR (lowest first), then by name."""
    sensitivity = report.get("sensitivity") or {}
    measured = {row["tensor"]: (i, row) for i, row in enumerate(sensitivity.get("tensors", []))}
    rows = []
    for entry in report["tensors"]:
        grid = _grid(entry)
        sqnr, is_measured = None, False
        if entry["name"] in measured and measured[entry["name"]][1]["local_sqnr_db"] is not None:
            sqnr, is_measured = float(measured[entry["name"]][1]["local_sqnr_db"]), True
        elif entry.get("histogram") is not None and grid is not None:
            sqnr = estimated_sqnr_db(entry["histogram"], grid, float(entry["onnx"]["scale"][0]))
        position = measured[entry["name"]][0] if entry["name"] in measured else len(measured)
        key = (position, math.inf if sqnr is None else sqnr, entry["name"])
        rows.append((key, entry, grid, sqnr, is_measured))
    rows.sort(key=lambda row: row[0])
    return [TensorView(entry, grid, sqnr, is_measured, rank)
            for rank, (_, entry, grid, sqnr, is_measured) in enumerate(rows)]
