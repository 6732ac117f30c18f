"""Histogram observer and range selection: laws, hand-computed cases and independent references."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError
from qcal.numerics.histogram import (
    Histogram,
    HistogramObserver,
    RangeSelection,
    abs_distribution,
    entropy_divergences,
    entropy_range,
    mse_range,
    percentile_range,
    select_range,
)
from qcal.numerics.observers import MinMaxStats, PerChannel, PerTensor
from qcal.numerics.presets import build_preset

BITS = 8  # the observer's default resolution


def _observe(data: np.ndarray, granularity: Any = None, batches: int = 1) -> HistogramObserver:
    observer = HistogramObserver(granularity or PerTensor())
    for chunk in np.array_split(data, batches):
        observer.update(chunk)
    return observer


def _state_arrays(histogram: Histogram) -> tuple[np.ndarray, ...]:
    return histogram.groups, histogram.counts, histogram.min, histogram.max


def _assert_same_state(a: HistogramObserver, b: HistogramObserver) -> None:
    for x, y in zip(_state_arrays(a.state()), _state_arrays(b.state())):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    assert a.state().axis == b.state().axis
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())


def _awkward_values(rng: np.random.Generator, size: int) -> np.ndarray:
    """Normal values with exact zeros, negative zeros, subnormals and a few large outliers."""
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.random(size) < 0.05] = 0.0
    x[rng.random(size) < 0.02] = -0.0
    x[rng.random(size) < 0.01] = np.float32(1e-40)
    x[rng.random(size) < 0.001] *= 1000
    return x


# ---------------------------------------------------------------------------------------------
# the observer


@pytest.mark.parametrize("bits", [0, 5, BITS, 12])
@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(0)])
def test_bins_are_the_high_bits_of_the_float32_pattern(bits: int, granularity: Any) -> None:
    x = _awkward_values(np.random.default_rng(0), 3 * 30_000).reshape(3, 30_000)
    observer = HistogramObserver(granularity, mantissa_bits=bits)
    for batch in (x[:, :100], x[:, 100:]):  # small (sorted / buffered) and large (dense) counts
        observer.update(batch)
    state = observer.state()
    for channel, values in enumerate([x] if isinstance(granularity, PerTensor) else x):
        expected_keys, expected_counts = np.unique(
            values.view(np.uint32) >> (23 - bits), return_counts=True
        )
        keys, counts = state.channel_bins(channel)
        np.testing.assert_array_equal(keys, expected_keys)
        np.testing.assert_array_equal(counts, expected_counts)


def test_many_tiny_channels() -> None:
    # 40 000 channels x 2**17 bins: more bin keys than a uint32 holds, counted in one batch.
    x = _awkward_values(np.random.default_rng(17), 3 * 40_000).reshape(3, 40_000)
    state = _observe(x, PerChannel(1)).state()
    np.testing.assert_array_equal(state.total(), np.full(40_000, 3))
    for channel in (0, 7_231, 32_768, 39_999):
        expected = np.unique(x[:, channel].view(np.uint32) >> (23 - BITS), return_counts=True)
        for got, want in zip(state.channel_bins(channel), expected):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(1), PerChannel(-1)])
def test_state_is_independent_of_sample_order_and_batching(granularity: Any) -> None:
    rng = np.random.default_rng(1)
    # 48 samples of (3, 40, 50): per channel 2000 values a sample (sorted counting), 16k+ for
    # big batches (dense counting); per tensor both the key buffer and direct counting run.
    data = _awkward_values(rng, 48 * 3 * 40 * 50).reshape(48, 3, 40, 50)
    one_pass = _observe(data, granularity)
    for seed, sizes in ((2, [1] * 48), (3, [5, 1, 30, 12]), (4, [20, 28]), (5, [47, 1])):
        permuted = data[np.random.default_rng(seed).permutation(48)]
        observer = HistogramObserver(granularity)
        for chunk in np.split(permuted, np.cumsum(sizes)[:-1]):
            observer.update(chunk)
        _assert_same_state(observer, one_pass)


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(1)])
@pytest.mark.parametrize("shards", [1, 2, 5])
def test_merging_shards_through_json_equals_one_pass(granularity: Any, shards: int) -> None:
    data = _awkward_values(np.random.default_rng(6), 30 * 4 * 300).reshape(30, 4, 300)
    one_pass = _observe(data, granularity)
    pieces = np.array_split(data, shards)
    restored = [
        HistogramObserver.from_dict(json.loads(json.dumps(_observe(p, granularity).to_dict())))
        for p in pieces
    ]
    merged = HistogramObserver(granularity)
    for piece in restored[::-1]:
        merged.merge(piece)
    _assert_same_state(merged, one_pass)


def test_json_round_trip_is_exact() -> None:
    observer = _observe(
        _awkward_values(np.random.default_rng(7), 3000).reshape(3, 1000), PerChannel(0)
    )
    restored = HistogramObserver.from_dict(json.loads(json.dumps(observer.to_dict())))
    _assert_same_state(restored, observer)
    empty = HistogramObserver.from_dict(HistogramObserver(PerTensor()).to_dict())
    with pytest.raises(EmptyStatisticsError):
        empty.state()


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"kind": "minmax"},
        {"mantissa_bits": 20},
        {"granularity": {"per": "row"}},
        {"state": {"axis": None, "min": [0.0], "max": [1.0], "keys": [5, 3], "counts": [1, 1]}},
        {"state": {"axis": None, "min": [0.0], "max": [1.0], "keys": [3], "counts": [0]}},
        {"state": {"axis": None, "min": [2.0], "max": [1.0], "keys": [3], "counts": [1]}},
    ],
)
def test_malformed_saved_state_is_a_config_error(change: dict[str, Any]) -> None:
    saved = {**_observe(np.arange(10, dtype=np.float32)).to_dict(), **change}
    with pytest.raises(ConfigError):
        HistogramObserver.from_dict(saved)


def test_memory_does_not_grow_with_samples() -> None:
    rng = np.random.default_rng(8)
    few, many = HistogramObserver(PerTensor()), HistogramObserver(PerTensor())
    for observer, batches in ((few, 3), (many, 300)):
        for _ in range(batches):  # values in [1, 2): every batch fills the same bins
            observer.update(rng.uniform(1.0, 1.99, size=5000).astype(np.float32))
    assert many.state().total()[0] == 100 * few.state().total()[0]
    assert many.nbytes == few.nbytes
    shapes = {k: v.shape for k, v in vars(few).items() if isinstance(v, np.ndarray)}
    assert shapes == {k: v.shape for k, v in vars(many).items() if isinstance(v, np.ndarray)}
    big = _observe(rng.standard_normal(2_000_000).astype(np.float32))
    assert big.nbytes < 512 * (1 << BITS) * 8 + 100_000  # bounded by the bin count, not by 8 MB


@pytest.mark.parametrize(("value", "word"), [(np.nan, "NaN"), (np.inf, "+inf"), (-np.inf, "-inf")])
@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(0)])
def test_non_finite_values_are_refused_by_name(value: float, word: str, granularity: Any) -> None:
    x = np.ones((2, 5), dtype=np.float32)
    x[1, 3] = value
    with pytest.raises(DataError, match=re.escape(f"1 {word}")):
        HistogramObserver(granularity).update(x)


def test_empty_batches_are_ignored_and_no_data_is_an_error() -> None:
    observer = HistogramObserver(PerTensor())
    observer.update(np.zeros((0, 3), dtype=np.float32))
    with pytest.raises(EmptyStatisticsError):
        observer.state()


def test_channel_count_must_not_change() -> None:
    observer = HistogramObserver(PerChannel(1))
    observer.update(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(DataError, match="channels"):
        observer.update(np.zeros((2, 4), dtype=np.float32))
    other = HistogramObserver(PerChannel(1))
    other.update(np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ConfigError):
        observer.merge(other)
    with pytest.raises(ConfigError):
        observer.merge(HistogramObserver(PerTensor()))


def test_other_float_dtypes_and_layouts_count_as_float32() -> None:
    x = np.random.default_rng(9).standard_normal((30, 40))
    reference = _observe(x.astype(np.float32))
    _assert_same_state(_observe(x), reference)  # float64 input
    _assert_same_state(_observe(np.asfortranarray(x.astype(np.float32))), reference)


def test_one_channel_per_channel_equals_per_tensor() -> None:
    x = _awkward_values(np.random.default_rng(10), 20_000)
    tensor = _observe(x).state()
    channel = _observe(x.reshape(1, -1), PerChannel(0)).state()
    np.testing.assert_array_equal(channel.groups, tensor.groups)
    np.testing.assert_array_equal(channel.counts, tensor.counts)
    recipe = build_preset("pytorch").activation
    picks: list[Callable[[Histogram], RangeSelection]] = [
        lambda h: percentile_range(h, 99.9),
        lambda h: percentile_range(h, 99.0, symmetric=False),
        lambda h: entropy_range(h),
        lambda h: mse_range(h, recipe),
    ]
    for pick in picks:
        a, b = pick(tensor), pick(channel)
        np.testing.assert_array_equal(a.stats.min.reshape(-1), b.stats.min)
        np.testing.assert_array_equal(a.stats.max.reshape(-1), b.stats.max)


def test_each_channel_is_the_histogram_of_its_slice() -> None:
    x = _awkward_values(np.random.default_rng(11), 6 * 4 * 500).reshape(6, 4, 500)
    state = _observe(x, PerChannel(1)).state()
    selection = percentile_range(state, 99.0)
    for c in range(4):
        alone = _observe(x[:, c]).state()
        for got, want in zip(state.channel_bins(c), alone.channel_bins(0)):
            np.testing.assert_array_equal(got, want)
        assert selection.stats.max[c] == percentile_range(alone, 99.0).stats.max


# ---------------------------------------------------------------------------------------------
# percentile


def test_percentile_of_abs_by_hand() -> None:
    # Values 1..100; the bin of 50 = 1.5625 * 2**5 is [50, 50 + 2**(5-8)) = [50, 50.125).
    # 50 % of 100 values is reached at the end of that bin; 49.5 % halfway through it.
    state = _observe(np.arange(1, 101, dtype=np.float32)).state()
    assert percentile_range(state, 50.0).stats.max == np.float32(50.125)
    assert percentile_range(state, 49.5).stats.max == np.float32(50.0625)
    full = percentile_range(state, 100.0)
    assert (full.stats.min, full.stats.max) == (np.float32(1.0), np.float32(100.0))
    assert percentile_range(state, 50.0).summary["clipped_fraction"] == [0.5]
    # Ten zeros (a point mass at 0) and 1..10: half the values are reached at 0 itself.
    zeros = _observe(np.concatenate([np.zeros(10), np.arange(1, 11)]).astype(np.float32)).state()
    assert percentile_range(zeros, 50.0).stats.max == 0.0


def test_two_sided_percentile_by_hand() -> None:
    # -50..-1, 1..50. p = 98 clips 1 % on each side: the 1st value (-50; its bin
    # [-50.125, -50] is clipped at the minimum to the point -50) and everything past the end
    # of the 99th value's bin, [49, 49.125).
    values = np.concatenate([np.arange(-50, 0), np.arange(1, 51)]).astype(np.float32)
    selection = percentile_range(_observe(values).state(), 98.0, symmetric=False)
    assert (selection.stats.min, selection.stats.max) == (np.float32(-50.0), np.float32(49.125))
    assert selection.summary["clipped_fraction"] == pytest.approx([0.01])  # only the value 50


@pytest.mark.parametrize("p", [50.0, 90.0, 99.0, 99.9, 99.99])
def test_percentile_of_abs_is_within_one_bin_of_numpy(p: float) -> None:
    rng = np.random.default_rng(12)
    x = np.concatenate([rng.standard_normal(50_000), rng.standard_cauchy(500)]).astype(np.float32)
    t = float(percentile_range(_observe(x).state(), p).stats.max)
    ranked = np.sort(np.abs(x))
    k = math.ceil(p / 100 * x.size) - 1  # 0-based rank whose bin holds the result
    shift = 23 - BITS
    key = ranked.view(np.uint32)[k] >> shift
    lower = float(np.array([key << shift], dtype=np.uint32).view(np.float32)[0])
    upper = float(np.array([(key + 1) << shift], dtype=np.uint32).view(np.float32)[0])
    assert lower <= t <= upper
    bound = 2.0**-BITS * float(ranked[k]) + float(ranked[min(k + 1, x.size - 1)] - ranked[k - 1])
    assert abs(t - float(np.percentile(np.abs(x), p))) <= bound


# ---------------------------------------------------------------------------------------------
# entropy


def _slow_divergences(b: np.ndarray, levels: int, eps: float) -> np.ndarray:
    """The TensorRT-style KL search written out with loops, straight from its definition."""
    out = []
    for i in range(levels, len(b) + 1):
        p = [float(v) for v in b[:i]]
        p[i - 1] += float(sum(b[i:]))
        group_sum, group_nonzero = [0.0] * levels, [0] * levels
        for j in range(i):
            g = j * levels // i
            group_sum[g] += float(b[j])
            group_nonzero[g] += int(b[j] > 0)
        q = [0.0] * i
        for j in range(i):
            if b[j] > 0:
                q[j] = group_sum[j * levels // i] / group_nonzero[j * levels // i]
        if sum(q) == 0:
            out.append(math.inf)
            continue
        p = [v if v > 0 else eps for v in p]  # smoothing: empty bins get eps
        q = [v if v > 0 else eps for v in q]
        p_total, q_total = sum(p), sum(q)
        kl = 0.0
        for pj, qj in zip(p, q):
            if pj > 0:
                kl = (
                    math.inf
                    if qj == 0
                    else kl + pj / p_total * math.log((pj / p_total) / (qj / q_total))
                )
        out.append(kl)
    return np.array(out)


_KL_CASES = [(8, 2, 0), (16, 4, 1), (64, 8, 2), (300, 128, 3), (257, 16, 4)]


@pytest.mark.parametrize(
    ("bins", "levels", "seed", "eps"),
    [(*case, eps) for case in _KL_CASES for eps in (1e-4, 0.0)] + [(2048, 128, 5, 1e-4)],
)
def test_entropy_search_matches_a_loop_reference(
    bins: int, levels: int, seed: int, eps: float
) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.exponential(size=bins) * rng.integers(0, 3, size=bins)  # some empty bins
    counts[: levels // 2] *= rng.random(levels // 2) < 0.3  # an empty group early on
    counts[-1] = rng.choice([0.0, 0.25])
    fast = entropy_divergences(counts, levels, smoothing=eps)
    slow = _slow_divergences(counts, levels, eps)
    np.testing.assert_array_equal(np.isinf(fast), np.isinf(slow))
    finite = np.isfinite(slow)
    np.testing.assert_allclose(fast[finite], slow[finite], rtol=1e-9, atol=1e-12)
    best_fast = fast.size - 1 - int(np.argmin(fast[::-1]))
    assert fast[best_fast] == pytest.approx(slow.min(), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    ("bins", "levels", "seed"),
    [(2048, 128, 0), (2048, 128, 1), (300, 128, 2), (257, 16, 3), (1000, 100, 4), (64, 2, 5),
     (4096, 8, 6)],
)
def test_entropy_group_table_changes_no_bit(bins: int, levels: int, seed: int) -> None:
    # Terms shared between candidates are looked up, not recomputed: the same float64 numbers.
    rng = np.random.default_rng(seed)
    integer = np.floor(rng.exponential(40.0, bins) * (rng.random(bins) < 0.6))
    fractional = rng.random(bins) * (rng.random(bins) < 0.2)
    sparse = np.zeros(bins)
    sparse[rng.integers(0, bins, 3)] = rng.integers(1, 5, 3)
    for counts in (integer, fractional, sparse, np.zeros(bins)):
        for eps in (1e-4, 0.0):
            shared = entropy_divergences(counts, levels, smoothing=eps)
            direct = entropy_divergences(counts, levels, smoothing=eps, table=False)
            np.testing.assert_array_equal(shared.view(np.int64), direct.view(np.int64))


def test_entropy_divergences_by_hand() -> None:
    # b = [2, 1, 0, 1], 2 levels. i=2: P=[2,2], Q=[2,1]: .5 ln(.5/(2/3)) + .5 ln(.5/(1/3)).
    # i=3: groups {0,1}, {2}: P=[2,1,1], Q=[1.5,1.5,0]; i=4: groups {0,1}, {2,3}:
    # P=[2,1,0,1], Q=[1.5,1.5,0,1]. Unsmoothed, i=3 has p > 0 = q: inf.
    b = np.array([2.0, 1, 0, 1])
    i2 = 0.5 * math.log(0.75) + 0.5 * math.log(1.5)
    i4 = 0.5 * math.log(0.5 / 0.375) + 0.25 * math.log(0.25 / 0.375)
    np.testing.assert_allclose(entropy_divergences(b, 2, smoothing=0.0), [i2, math.inf, i4])
    # Smoothed: empty bins hold eps; i=3: Q sums to 3 + eps; i=4: P and Q both sum to 4 + eps.
    eps = 1e-4
    zq = 3 + eps
    i3 = (
        0.5 * math.log(0.5 / (1.5 / zq))
        + 0.25 * math.log(0.25 / (1.5 / zq))
        + 0.25 * math.log(0.25 / (eps / zq))
    )
    i4 = (2 * math.log(2 / 1.5) + math.log(1 / 1.5)) / (4 + eps)
    np.testing.assert_allclose(entropy_divergences(b, 2), [i2, i3, i4], rtol=1e-12)


def test_entropy_threshold_by_hand() -> None:
    # |x| in 4 bins over [0, 4]: 0.5 -> bin 0, 1.5 x3 -> bin 1, 4.0 -> bin 3: b = [1, 3, 0, 1].
    # i=2: P=[1,4], Q=[1,3]: .2 ln(.2/.25) + .8 ln(.8/.75) = 0.0070 (best)
    # i=3: P=[1,3,1], Q=[2,2,0+eps]: ~1.7 (the outlier lands on an empty bin of Q)
    # i=4: Q=[2,2,0,1]: ~ .2 ln .5 + .6 ln 1.5 = 0.105
    # Threshold: upper edge of bin 1 = 2.0; one value of five lies beyond it.
    x = np.array([0.5, 1.5, -1.5, 1.5, 4.0], dtype=np.float32)
    selection = entropy_range(_observe(x).state(), bins=4, quantized_bins=2)
    assert (selection.stats.min, selection.stats.max) == (np.float32(-1.5), np.float32(2.0))
    assert selection.details["threshold"] == [2.0]
    assert selection.details["kl_divergence"][0] == pytest.approx(
        0.2 * math.log(0.8) + 0.8 * math.log(0.8 / 0.75)
    )
    assert selection.summary["clipped_fraction"] == [pytest.approx(0.2)]


def state_counts(state: Histogram, bins: int = 2048) -> np.ndarray:
    top = float(max(-state.min[0], state.max[0]))
    return abs_distribution(state).histogram(0.0, top, bins)


def test_entropy_clips_isolated_outliers() -> None:
    # Two outliers at 40: every candidate threshold below them has them piled on an empty last
    # bin. Smoothing makes that a finite penalty, so the search clips them (as onnxruntime and
    # TensorRT do); without it all those candidates are infinite and nothing is clipped.
    rng = np.random.default_rng(13)
    x = np.concatenate([rng.standard_normal(100_000), [40.0, -35.0]]).astype(np.float32)
    state = _observe(x).state()
    chosen = entropy_range(state)
    assert 40 * 128 / 2048 <= chosen.details["threshold"][0] < 8.0
    assert 2 / x.size <= chosen.summary["clipped_fraction"][0] < 1e-3
    unsmoothed = entropy_divergences(state_counts(state), 128, smoothing=0.0)
    assert np.isinf(unsmoothed[:-1]).sum() > 1000  # most candidates would be out of reach


# ---------------------------------------------------------------------------------------------
# mse


@dataclass(frozen=True)
class _ThreeLevelParams:
    scale: np.ndarray
    zero_point: np.ndarray
    quant_min: int = -1
    quant_max: int = 1
    axis: int | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class _ThreeLevel:
    """Codes {-1, 0, 1} with step max|x|, half to even: small enough to reason about by hand."""

    def qparams(self, stats: MinMaxStats) -> _ThreeLevelParams:
        amax = np.maximum(-stats.min, stats.max).astype(np.float32)
        return _ThreeLevelParams(amax, np.zeros(amax.shape, np.int64), axis=stats.axis)

    def fake_quantize(self, x: np.ndarray, qparams: _ThreeLevelParams) -> np.ndarray:
        scale = qparams.scale if qparams.axis is None else qparams.scale[:, None]
        quantized: np.ndarray = (np.clip(np.rint(x / scale), -1, 1) * scale).astype(np.float32)
        return quantized


def test_mse_by_hand() -> None:
    # 100 000 values at +-1 and one at 100. With step t in [2/3, 2) the bulk maps to +-t and
    # the error is 1e5 (t - 1)**2 + (100 - t)**2 ~ 9800, minimal near t = 1 (the bulk sits in
    # its bins [1, 1 + 2**-8), so just above 1); any t >= 2 sends the bulk to 0: error >= 1e5.
    x = np.concatenate([np.ones(50_000), -np.ones(50_000), [100.0]]).astype(np.float32)
    selection = mse_range(_observe(x).state(), _ThreeLevel())
    assert selection.details["search"] == ["symmetric"]
    assert 0.99 <= float(selection.stats.max) <= 1.02
    assert float(selection.stats.min) == -1.0  # the observed range, clipped to [-t, t]
    assert selection.summary["clipped_fraction"] == [pytest.approx(1 / 100_001)]
    assert selection.details["mse"][0] < selection.details["mse_minmax"][0]


def _raw_errors(recipe: Any, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Mean squared error on the raw data of each range, saturated to the integer grid."""
    out = []
    for first in range(0, lo.size, 64):
        stats = MinMaxStats(lo[first : first + 64], hi[first : first + 64], axis=0)
        qparams = recipe.qparams(stats)
        scale = qparams.scale.astype(np.float64)[:, None]
        zero_point = np.asarray(qparams.zero_point, dtype=np.float64)[:, None]
        grid = np.clip(
            x, (qparams.quant_min - zero_point) * scale, (qparams.quant_max - zero_point) * scale
        )
        rows = np.broadcast_to(grid.astype(np.float32), (lo[first : first + 64].size, x.size))
        fq = recipe.fake_quantize(np.ascontiguousarray(rows), qparams).astype(np.float64)
        out.append(((fq - x.astype(np.float64)) ** 2).mean(axis=1))
    return np.concatenate(out)


@pytest.mark.parametrize(
    ("preset", "knobs"),
    [
        ("pytorch", {}),  # asymmetric uint8
        ("pytorch", {"quant_min": 0, "quant_max": 15}),  # 4-bit asymmetric
        ("pytorch-symmetric", {}),
        ("tensorflow", {"narrow_range": True}),  # symmetric, narrow, no clamp in its own op
        ("oneflow-cambricon", {}),  # power-of-two steps
        ("mindspore", {}),  # nudged zero point, half up
    ],
)
def test_mse_is_near_the_brute_force_optimum_on_raw_data(
    preset: str, knobs: dict[str, Any]
) -> None:
    rng = np.random.default_rng(14)
    x = np.concatenate(
        [rng.standard_normal(6000), rng.exponential(2.0, 300) + 3, -rng.exponential(1.0, 20) - 2]
    ).astype(np.float32)
    recipe = build_preset(preset, knobs).activation
    chosen = mse_range(_observe(x).state(), recipe)
    low, high = float(x.min()), float(x.max())
    fractions = np.linspace(0.05, 1.0, 40)
    lo, hi = (a.ravel() for a in np.meshgrid(low * fractions, high * fractions, indexing="ij"))
    brute = _raw_errors(recipe, x, lo.astype(np.float32), hi.astype(np.float32)).min()
    ours = _raw_errors(recipe, x, chosen.stats.min.reshape(1), chosen.stats.max.reshape(1))[0]
    minmax = _raw_errors(recipe, x, np.array([low], np.float32), np.array([high], np.float32))[0]
    assert ours <= 1.03 * brute
    assert ours <= minmax


def test_mse_keeps_the_widest_of_equal_parameters() -> None:
    # Power-of-two steps: a whole band of thresholds gives the same step and the same error;
    # the next candidate up (1/64 octave wider) must therefore change the step, or not exist.
    x = np.random.default_rng(15).standard_normal(20_000).astype(np.float32)
    recipe = build_preset("oneflow-cambricon").activation
    chosen = mse_range(_observe(x).state(), recipe)
    t, top = float(chosen.stats.max), float(max(-x.min(), x.max()))
    assert chosen.details["search"] == ["symmetric"]
    wider = min(t * 2 ** (1 / 64), top)
    if wider > t:
        stats = MinMaxStats(np.float32(-wider), np.float32(wider))
        assert recipe.qparams(stats).scale != recipe.qparams(chosen.stats).scale


# ---------------------------------------------------------------------------------------------
# dispatch, errors and report summaries


def test_select_range_dispatches_and_summaries_are_json() -> None:
    x = np.random.default_rng(16).standard_normal((4, 3, 200)).astype(np.float32)
    recipe = build_preset("pytorch-symmetric").activation
    for granularity in (PerTensor(), PerChannel(1)):
        state = _observe(x, granularity).state()
        for method in ("percentile", "entropy", "mse"):
            selection = select_range(
                state, method, recipe, percentile=99.0, bins=256, quantized_bins=32
            )
            assert selection.method == method
            assert selection.stats.min.shape == selection.observed.min.shape
            assert np.all(selection.stats.min >= selection.observed.min)
            assert np.all(selection.stats.max <= selection.observed.max)
            summary = json.loads(json.dumps(selection.summary, allow_nan=False))
            assert len(summary["clipped_fraction"]) == state.channels
            recipe.qparams(selection.stats)  # every method feeds the preset's parameters


@pytest.mark.parametrize(
    "call",
    [
        lambda s: select_range(s, "kl"),
        lambda s: select_range(s, "mse"),
        lambda s: percentile_range(s, 0.0),
        lambda s: percentile_range(s, 100.5),
        lambda s: entropy_range(s, bins=64, quantized_bins=128),
        lambda s: entropy_range(s, quantized_bins=1),
    ],
)
def test_bad_method_options_are_config_errors(call: Any) -> None:
    with pytest.raises(ConfigError):
        call(_observe(np.arange(10, dtype=np.float32)).state())


def test_constant_and_zero_data_keep_the_observed_range() -> None:
    recipe = build_preset("pytorch").activation
    for value in (0.0, 3.0, -2.0):
        state = _observe(np.full(100, value, dtype=np.float32)).state()
        for selection in (percentile_range(state), entropy_range(state), mse_range(state, recipe)):
            lo, hi = float(selection.stats.min), float(selection.stats.max)
            assert (lo, hi) == (value, value) or (value == 0.0 and lo == hi == 0.0)


def test_entropy_ignores_the_relu_spike_at_zero() -> None:
    """Half the values of a ReLU output are exactly 0; they must not drag the threshold down."""
    from qcal.numerics.histogram import HistogramObserver, entropy_range
    from qcal.numerics.observers import PerTensor

    rng = np.random.default_rng(11)
    relu = np.maximum(rng.standard_normal(200_000).astype(np.float32), 0)
    observer = HistogramObserver(PerTensor())
    observer.update(relu)
    with_spike = entropy_range(observer.state())
    positive = HistogramObserver(PerTensor())
    positive.update(relu[relu > 0])
    without_spike = entropy_range(positive.state())
    # The zeros change nothing about where the non-zero values are best cut.
    assert float(with_spike.stats.max) == float(without_spike.stats.max)
    assert float(with_spike.stats.max) > 3.0  # a normal's tail beyond 3 sigma is 0.13 %
