"""The summary table of bench_calibration: every job's time as a ratio to float inference.

One row per model and calibration-set size, one column per job (qcal per method, with and
without the ``qcal[fast]`` kernels, and onnxruntime's ``quantize_static`` beside its
counterpart), each the median of the per-repeat ratios to the float run of the same repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _common import print_table

# Column order: each qcal method, its qcal[fast] run, then onnxruntime's counterpart.
_COLUMNS = (
    ("qcal", "minmax"),
    ("ort", "MinMax"),
    ("qcal", "moving-average"),
    ("ort", "MinMax-MovingAverage"),
    ("qcal", "entropy"),
    ("qcal[fast]", "entropy"),
    ("ort", "Entropy"),
    ("qcal", "percentile"),
    ("qcal[fast]", "percentile"),
    ("ort", "Percentile"),
    ("qcal", "mse"),
    ("qcal[fast]", "mse"),
)


def render_ratios(summary: Sequence[dict[str, Any]]) -> None:
    """Print the ratio table of `summary` (rows of bench_calibration.summarize)."""
    ratios: dict[tuple[str, int], dict[tuple[str, str], float | None]] = {}
    floats: dict[tuple[str, int], float | None] = {}
    for row in summary:
        cell = (row["model"], row["samples"])
        if row["tool"] == "float":
            floats[cell] = row["seconds_median"]
        else:
            ratios.setdefault(cell, {})[(row["tool"], row["method"])] = row["ratio_to_float_median"]
    present = [c for c in _COLUMNS if any(c in by_job for by_job in ratios.values())]
    if not present:
        return
    rows = []
    for cell in sorted(ratios):
        by_job = ratios[cell]
        rows.append(
            [cell[0], cell[1], floats.get(cell)]
            + [None if by_job.get(c) is None else f"{by_job[c]:.2f}" for c in present]
        )
    print_table(
        "Calibration time / float inference time (median ratio; qcal[fast]: the numba kernels)",
        ["model", "N", "float s", *(f"{tool} {method}" for tool, method in present)],
        rows,
    )
