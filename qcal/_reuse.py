"""`calibrate --stats`: the observers of a run read from a statistics file instead of collected.

The file must come from the same model (SHA-256) and hold, for every tensor this run observes,
the statistics its range method needs: the histogram for `percentile`, `entropy` and `mse`;
for `minmax` and `moving-average`, a range observer defined exactly as this run's preset defines
it (same kind, data policy and settings). Other options (scheme details of the preset, bins,
percentile, fallback, evaluation) are free: they act after the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qcal._quantize_tensors import _observed
from qcal.calibration.collect import CollectionSummary
from qcal.calibration.statistics import HISTOGRAM, Statistics, read_ranges, read_statistics
from qcal.config import CalibrationConfig
from qcal.graph.files.atomic import sha256_of_file
from qcal.graph.model import QuantPlan
from qcal.graph.names import first_and_more
from qcal.numerics.errors import StatisticsError
from qcal.numerics.observers import FixedRangeObserver, Observer, PerTensor
from qcal.numerics.presets import Preset
from qcal.numerics.ranges import HISTOGRAM_METHODS

__all__ = ["ReusedStatistics", "reuse_statistics"]


@dataclass(frozen=True)
class ReusedStatistics:
    observers: dict[str, Observer]
    summary: CollectionSummary
    source: dict[str, Any] | None  # what the report says of the file (None: no file)


def _definition(observer_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in observer_dict.items() if k != "state"}


def reuse_statistics(
    given: Path | Statistics, model_sha256: str, plan: QuantPlan, preset: Preset,
    config: CalibrationConfig,
) -> ReusedStatistics:
    """The observers of `plan`'s observed tensors from the file at `given`: a statistics file,
    or a ranges file of another tool (`qcal.calibration.statistics._exchange`); or from
    statistics this run collected elsewhere (on Ray), which the report does not name.

    Raises:
        StatisticsError: another model, an unfinished collection, or a tensor whose statistics
            for this run's method and preset are not in the file.
    """
    if isinstance(given, Path) and not _is_zip(given):
        return _reuse_ranges(given, plan, config)
    stats = read_statistics(given) if isinstance(given, Path) else given
    path = given if isinstance(given, Path) else "statistics collected on Ray"
    if stats.model_sha256 != model_sha256:
        raise StatisticsError(
            f"{path}: collected on another model (sha256 {stats.model_sha256[:12]}..., this "
            f"model's is {model_sha256[:12]}...)")
    if not stats.complete:
        raise StatisticsError(f"{path}: an unfinished collection ({stats.samples} samples so far); "
                              "resume it with qcal collect --checkpoint")
    observers: dict[str, Observer] = {}
    for target in plan.activations:
        if not _observed(target, config):
            continue
        tensor = target.tensor
        method = config.method_for(tensor)
        held = stats.observers.get(tensor)
        if held is None:
            raise StatisticsError(
                f"{path}: no statistics for tensor {tensor!r}, which these options quantize; "
                "collect with the same selection options (--op-types, --exclude-*, --placement, "
                "--preset)")
        key = HISTOGRAM if method in HISTOGRAM_METHODS else method
        observer = held.get(key)
        if observer is None:
            hint = ("collect without --no-histograms" if key == HISTOGRAM
                    else f"collect with --method {method}")
            raise StatisticsError(f"{path}: no {key} statistics for tensor {tensor!r} "
                                  f"(--method {method}); {hint}")
        if key != HISTOGRAM:
            wanted = preset.activation.observer(method, PerTensor()).to_dict()
            if _definition(wanted) != _definition(observer.to_dict()):
                raise StatisticsError(
                    f"{path}: tensor {tensor!r}: its {method} statistics were collected with "
                    f"preset {stats.plan.get('preset')!r}, whose observer is not the one preset "
                    f"{config.preset!r} uses; collect with --preset {config.preset}, or use a "
                    "histogram method")
            if observer.is_order_dependent and stats.plan.get("batch_size") != config.batch_size:
                raise StatisticsError(
                    f"{path}: {method} statistics depend on the batching; they were collected "
                    f"with --batch-size {stats.plan.get('batch_size')}, this run has "
                    f"{config.batch_size}")
        observers[tensor] = observer
    summary = CollectionSummary(stats.samples, 0, 0.0, stats.providers)
    source = None if not isinstance(given, Path) else {
        "path": str(given), "sha256": sha256_of_file(given), "samples": stats.samples,
        "format": "qcal-statistics", "fingerprint": stats.fingerprint.hex()}
    return ReusedStatistics(observers, summary, source)


def _is_zip(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"PK\x03\x04"
    except OSError as err:
        raise StatisticsError(f"{path}: cannot read ({err.strerror or err})") from None


def _reuse_ranges(path: Path, plan: QuantPlan, config: CalibrationConfig) -> ReusedStatistics:
    """Observers that give each tensor the range a ranges file holds for it."""
    kind, ranges = read_ranges(path)
    methods = sorted({config.method_for(t.tensor) for t in plan.activations} - {"minmax", "auto"})
    if methods:
        raise StatisticsError(f"{path}: a ranges file gives each tensor its range; --method "
                              f"{methods[0]} does not apply (leave it at minmax)")
    observers: dict[str, Observer] = {}
    missing = []
    for target in plan.activations:
        if not _observed(target, config):
            continue
        if target.tensor not in ranges:
            missing.append(target.tensor)
            continue
        lo, hi = ranges[target.tensor]
        observers[target.tensor] = FixedRangeObserver(lo, hi)
    if missing:
        raise StatisticsError(
            f"{path}: no range for tensor {first_and_more(missing)}"
            " that these options quantize; keep them float with --exclude-tensors, or give "
              "a file that covers them")
    summary = CollectionSummary(0, 0, 0.0, ())
    source = {"path": str(path), "sha256": sha256_of_file(path), "samples": 0, "format": kind}
    return ReusedStatistics(observers, summary, source)
