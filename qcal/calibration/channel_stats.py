"""Statistics passes for the float-equivalent rewrites: for SmoothQuant, per-channel extremes of
some activations along their last axis and a bounded sample of their rows; for the depthwise
inputs of `--equalize`, per-channel extremes along axis 1 (`collect_channel_extremes`). Both
over all the calibration data.

Each activation of width K is read as rows ``x.reshape(-1, K)``. The extremes are exact
(minimum and maximum commute with any split or order of the data). The row sample keeps, of all
the rows seen, the `ROWS` with the smallest 64-bit hash of their bits (ties, which only equal
rows or a hash collision give, broken by a second, independent hash): a bottom-k sample, the
same set of rows whatever the data order or batch split, and at most `ROWS` x K floats per
activation in memory. The rows leave onnxruntime whole, since the sample needs them; the
extremes are computed from the same arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from qcal.calibration.reduce_min_max import add_min_max_outputs, read_per_channel
from qcal.calibration.runtime import create_session, run_batches
from qcal.graph.shapes import value_ranks
from qcal.graph.structure import element_types, exposing
from qcal.numerics.errors import DataError

__all__ = ["ROWS", "ChannelStats", "collect_channel_extremes", "collect_channel_stats"]

ROWS = 512  # rows kept per activation for the layer error of `--smooth-quant auto`
_SEEDS = (0x5EED_0001, 0x5EED_0002)


@dataclass
class ChannelStats:
    """Extremes per channel (K,) and the row sample (R, K), R <= ROWS, in hash order."""

    channels: int
    min: np.ndarray = field(init=False)
    max: np.ndarray = field(init=False)
    rows: np.ndarray = field(init=False)
    _keys: np.ndarray = field(init=False, repr=False)  # (R, 2) uint64 hashes of the rows kept
    _multipliers: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.min = np.full(self.channels, np.inf, dtype=np.float32)
        self.max = np.full(self.channels, -np.inf, dtype=np.float32)
        self.rows = np.zeros((0, self.channels), dtype=np.float32)
        self._keys = np.zeros((0, 2), dtype=np.uint64)
        self._multipliers = np.stack([
            np.random.default_rng(seed).integers(1, 2**63, self.channels, dtype=np.uint64) | 1
            for seed in _SEEDS])

    def update(self, x: np.ndarray) -> None:
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.channels)
        if rows.shape[0] == 0:
            return
        if not np.all(np.isfinite(rows)):
            raise DataError("SmoothQuant statistics: the activation holds NaN or infinite values")
        np.minimum(self.min, rows.min(axis=0), out=self.min)
        np.maximum(self.max, rows.max(axis=0), out=self.max)
        keys = _row_hashes(rows, self._multipliers)
        if self._keys.shape[0] == ROWS:  # only rows that can enter the sample are sorted
            candidate = keys[:, 0] <= self._keys[-1, 0]
            rows, keys = rows[candidate], keys[candidate]
        all_rows = np.concatenate([self.rows, rows])
        all_keys = np.concatenate([self._keys, keys])
        order = np.lexsort((all_keys[:, 1], all_keys[:, 0]))[:ROWS]
        self.rows, self._keys = all_rows[order], all_keys[order]


def _row_hashes(rows: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """(n, 2) uint64: per row, two multiply-add hashes of its float32 bits, finalised by a
    64-bit mix (integer arithmetic wraps modulo 2**64: exact and platform-independent)."""
    bits = rows.view(np.uint32).astype(np.uint64)
    out = np.empty((rows.shape[0], 2), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(2):
            h = (bits * multipliers[k]).sum(axis=1, dtype=np.uint64)
            h ^= h >> np.uint64(33)
            h *= np.uint64(0xFF51AFD7ED558CCD)
            h ^= h >> np.uint64(33)
            out[:, k] = h
    return out


def collect_channel_stats(
    model: onnx.ModelProto,
    widths: Mapping[str, int],
    batches: Iterable[tuple[Mapping[str, np.ndarray], int]],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, ChannelStats]:
    """Run `model` over `batches` once, gathering `ChannelStats` of each activation in `widths`
    (name -> K)."""
    names = sorted(widths)
    stats = {name: ChannelStats(widths[name]) for name in names}
    if not names:
        return stats
    session = create_session(exposing(model, names), providers=providers, threads=threads,
                             what="SmoothQuant statistics model")
    for values in run_batches(session, names, batches, what="SmoothQuant statistics pass",
                              on_batch=on_batch):
        for name, value in values.items():
            if value.size % widths[name]:
                raise DataError(f"SmoothQuant statistics: {name!r} has {value.shape[-1]} values "
                                f"on its last axis, not {widths[name]}")
            stats[name].update(value)
    return stats


def collect_channel_extremes(
    model: onnx.ModelProto,
    names: Sequence[str],
    batches: Iterable[tuple[Mapping[str, np.ndarray], int]],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Run `model` over `batches` once: per activation of `names`, the (min, max) of each
    channel along axis 1 (NCHW), float32; absent for an activation that received no values.
    Float32 activations of known rank are reduced inside onnxruntime (`reduce_min_max`, as the
    collection's per-channel observers are), the others leave it whole. Exact, so the same
    whatever the data order or batch split; NaN where a channel held one (the caller leaves
    such a channel alone)."""
    ranks, types = value_ranks(model.graph), element_types(model.graph)
    in_graph: dict[str, int | None] = {
        name: 1 for name in names
        if ranks.get(name, 0) >= 2 and types.get(name) == onnx.TensorProto.FLOAT}
    whole = sorted(set(names) - in_graph.keys())
    reducing, layout = add_min_max_outputs(model, in_graph)
    session = create_session(exposing(reducing, whole), providers=providers, threads=threads,
                             what="equalization statistics model")
    del reducing
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def merge(name: str, low: np.ndarray, high: np.ndarray) -> None:
        if name in found:
            low, high = np.minimum(found[name][0], low), np.maximum(found[name][1], high)
        found[name] = (low.astype(np.float32), high.astype(np.float32))

    for arrays in run_batches(session, layout.output_names + whole, batches,
                              what="equalization statistics pass", on_batch=on_batch):
        for name, low, high in read_per_channel(layout, arrays):
            if low is not None and high is not None:  # None: empty in this batch
                merge(name, low, high)
        for name in whole:
            value = arrays[name]
            if value.ndim >= 2 and value.size:
                axes = (0, *range(2, value.ndim))
                merge(name, value.min(axis=axes), value.max(axis=axes))
    return found
