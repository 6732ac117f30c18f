"""Observers: merge law, per-channel reduction, EMA conventions, data policies, serialisation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError
from qcal.numerics.observer_state import observer_from_dict
from qcal.numerics.observers import (
    DataPolicy,
    FixedRangeObserver,
    MindSporeObserver,
    MinMaxObserver,
    MinMaxStats,
    MovingAverageMinMaxObserver,
    Observer,
    OneFlowMovingAverageObserver,
    PerChannel,
    PerTensor,
    PerTensorExtremesFeed,
    reduce_min_max,
)

f32 = np.float32


def _bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def _data(seed: int, shape: tuple[int, ...], special: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e4])).astype(np.float32)
    if special:  # signed zeros, repeated extremes, exact integers
        flat = x.reshape(-1)
        picks = rng.integers(0, flat.size, size=max(1, flat.size // 4))
        flat[picks] = rng.choice(
            np.array([0.0, -0.0, 3.0, -3.0], dtype=np.float32), size=picks.size
        )
    return x


@st.composite
def _split_case(draw: st.DrawFn) -> tuple[np.ndarray, int | None, list[int]]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    x = _data(draw(st.integers(0, 2**32 - 1)), shape, draw(st.booleans()))
    axis = draw(st.one_of(st.none(), st.integers(-ndim, ndim - 1)))
    cuts = sorted(draw(st.lists(st.integers(0, shape[0]), max_size=4)))
    return x, axis, cuts


@settings(max_examples=100, deadline=None)
@given(case=_split_case())
def test_minmax_merge_equals_one_pass(case: tuple[np.ndarray, int | None, list[int]]) -> None:
    """Any split of the data into pieces, merged in any order, gives bit-identical statistics."""
    x, axis, cuts = case
    granularity = PerTensor() if axis is None else PerChannel(axis)
    split_axis = 0
    if axis is not None and axis % x.ndim == 0:
        split_axis = 1 if x.ndim > 1 else -1
    whole = MinMaxObserver(granularity)
    whole.update(x)
    pieces = np.split(x, cuts, axis=split_axis) if split_axis >= 0 else [x]
    parts = []
    for piece in pieces:
        observer = MinMaxObserver(granularity)
        observer.update(piece)  # empty pieces are ignored
        parts.append(observer)
    merged = parts[-1]
    for other in reversed(parts[:-1]):
        merged.merge(other)
    state, reference = merged.state(), whole.state()
    np.testing.assert_array_equal(_bits(state.min), _bits(reference.min))
    np.testing.assert_array_equal(_bits(state.max), _bits(reference.max))
    assert state.axis == reference.axis


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), axis=st.sampled_from([0, 1, 2, -1]))
def test_one_channel_equals_per_tensor(seed: int, rows: int, axis: int) -> None:
    """A single channel gives the per-tensor statistics, for every observer convention."""
    rng = np.random.default_rng(seed)
    shape = [rows, 3, 4]
    shape[axis] = 1
    batches = [_data(int(rng.integers(2**32)), tuple(shape), True) for _ in range(3)]
    makers = [
        lambda g: MinMaxObserver(g),
        lambda g: MovingAverageMinMaxObserver(g, averaging_constant=0.3),
        lambda g: MindSporeObserver(g, ema=True, ema_decay=0.7, min_init=-1.0, max_init=2.0),
        lambda g: MindSporeObserver(g, ema=False),
    ]
    for make in makers:
        per_tensor, per_channel = make(PerTensor()), make(PerChannel(axis))
        for batch in batches:
            per_tensor.update(batch)
            per_channel.update(batch)
        a, b = per_tensor.state(), per_channel.state()
        assert b.min.shape == (1,)
        np.testing.assert_array_equal(_bits(b.min), _bits(a.min.reshape(1)))
        np.testing.assert_array_equal(_bits(b.max), _bits(a.max.reshape(1)))


@pytest.mark.parametrize(
    "shape, axis",
    [
        ((300, 7, 61), -1),  # folded channel-last reduction
        ((2, 4099, 3), 2),
        ((1, 65537, 2), 2),
        ((5, 6), 0),
        ((3, 700, 600), 1),  # blocked along axis 0
        ((1, 9, 130_000), 1),  # blocked along the channel axis itself
        ((1_100_000,), 0),
        ((4, 1000, 300), 2),  # blocked and folded
    ],
)
def test_per_channel_reduction_matches_reference(shape: tuple[int, ...], axis: int) -> None:
    """Large tensors are reduced in blocks and channel-last ones folded; both must equal a plain
    reduction."""
    x = _data(7, shape, True)
    lo, hi, normalised = reduce_min_max(x, PerChannel(axis))
    channel_first = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
    np.testing.assert_array_equal(lo, channel_first.min(axis=1))
    np.testing.assert_array_equal(hi, channel_first.max(axis=1))
    assert normalised == axis % x.ndim


def test_blocked_per_tensor_reduction() -> None:
    x = _data(9, (3, 600, 700), True)
    lo, hi, _ = reduce_min_max(x, PerTensor())
    assert (lo, hi) == (x.min(), x.max())
    x[-1, -1, -1] = np.nan  # in the last block
    with pytest.raises(DataError, match="NaN"):
        MinMaxObserver().update(x)


def test_reduction_keeps_the_batch_dtype() -> None:
    """float16/float64/int batches are reduced natively and the extremes converted to float32."""
    rng = np.random.default_rng(3)
    for dtype in (np.float16, np.float64, np.int32, np.uint8):
        x = (rng.standard_normal((8, 5)) * 50).astype(dtype)
        lo, hi, _ = reduce_min_max(x, PerTensor())
        assert lo.dtype == np.float32 and hi.dtype == np.float32
        assert lo == x.astype(np.float32).min() and hi == x.astype(np.float32).max()
    with pytest.raises(DataError, match="complex"):
        reduce_min_max(np.ones(3, dtype=np.complex64), PerTensor())


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    c=st.sampled_from([0.01, 0.1, 0.3, 0.5, 1.0]),
    axis=st.sampled_from([None, 0, 1]),
)
def test_moving_average_float32_operation_order(seed: int, c: float, axis: int | None) -> None:
    """PyTorch/Horizon EMA: first batch initialises, then f32(old + f32(c32*f32(new - old)))."""
    rng = np.random.default_rng(seed)
    batches = [_data(int(rng.integers(2**32)), (3, 4), False) for _ in range(5)]
    granularity = PerTensor() if axis is None else PerChannel(axis)
    observer = MovingAverageMinMaxObserver(granularity, averaging_constant=c)
    c32 = f32(c)
    lo = hi = None
    for batch in batches:
        observer.update(batch)
        other = None if axis is None else tuple(i for i in range(2) if i != axis)
        cur_lo, cur_hi = batch.min(axis=other), batch.max(axis=other)
        if lo is None or hi is None:
            lo, hi = cur_lo, cur_hi
        else:
            lo = np.float32(lo + np.float32(c32 * np.float32(cur_lo - lo)))
            hi = np.float32(hi + np.float32(c32 * np.float32(cur_hi - hi)))
    state = observer.state()
    np.testing.assert_array_equal(_bits(state.min), _bits(lo))
    np.testing.assert_array_equal(_bits(state.max), _bits(hi))


def test_mindspore_ema_starts_from_init_and_forces_zero() -> None:
    observer = MindSporeObserver(PerTensor(), ema=True, ema_decay=0.5, min_init=-1.0, max_init=1.0)
    observer.update(np.array([-3.0, 5.0], dtype=np.float32))
    state = observer.state()
    assert state.min == f32(-1.0) * f32(0.5) + f32(-3.0) * f32(0.5)
    assert state.max == f32(3.0)
    observer.update(np.array([1.0, 2.0], dtype=np.float32))  # positive-only batch
    assert observer.state().min == min(f32(f32(state.min * f32(0.5)) + f32(1.0 * f32(0.5))), 0)
    decay = 0.999  # (1 - c) is evaluated in double, then rounded
    slow = MindSporeObserver(PerTensor(), ema=True, ema_decay=decay)
    slow.update(np.array([-1.0, 1.0], dtype=np.float32))
    assert slow.state().max == f32(f32(6.0) * f32(decay)) + f32(f32(1.0) * f32(1.0 - decay))


def test_mindspore_without_ema_keeps_the_current_batch() -> None:
    observer = MindSporeObserver(PerTensor(), ema=False)
    with pytest.raises(EmptyStatisticsError):
        observer.state()
    assert observer.initial_state().min == -6.0
    observer.update(np.array([-5.0, 5.0], dtype=np.float32))
    observer.update(np.array([0.5, 2.0], dtype=np.float32))
    state = observer.state()
    assert (state.min, state.max) == (0.0, 2.0)  # last batch only, 0 forced in
    with pytest.raises(ConfigError):
        observer.merge(MindSporeObserver(PerTensor()))
    vector = MindSporeObserver(PerChannel(1), ema=False)
    vector.update(np.array([-1.0, 2.0, 3.0], dtype=np.float32))  # a 1-D input is reduced on axis 0
    np.testing.assert_array_equal(vector.state().max, [0.0, 2.0, 3.0])


def test_mindspore_per_channel_init_lists() -> None:
    observer = MindSporeObserver(
        PerChannel(0), ema=True, ema_decay=0.5, min_init=[-1.0, -2.0], max_init=[1.0, 2.0]
    )
    observer.update(np.zeros((2, 3), dtype=np.float32))
    np.testing.assert_array_equal(observer.state().min, [-0.5, -1.0])
    bad = MindSporeObserver(PerChannel(0), ema=True, min_init=[-1.0, -2.0], max_init=[1.0, 2.0])
    with pytest.raises(DataError, match="channels"):
        bad.update(np.zeros((3, 3), dtype=np.float32))
    with pytest.raises(ConfigError, match="max_init"):
        MindSporeObserver(PerTensor(), min_init=1.0, max_init=1.0)


def test_oneflow_moving_average_reinitialises_exact_zero() -> None:
    m = 0.9
    keep = f32(1.0) - f32(m)
    symmetric = OneFlowMovingAverageObserver(momentum=m, symmetric=True)
    symmetric.update(np.array([-4.0, 3.0], dtype=np.float32))
    symmetric.update(np.array([-1.0, 2.0], dtype=np.float32))
    state = symmetric.state()
    expected = f32(f32(f32(4.0) * f32(m)) + f32(f32(2.0) * keep))
    assert state.max == expected and state.min == expected  # moving_min := moving_max
    affine = OneFlowMovingAverageObserver(momentum=m, symmetric=False)
    affine.update(np.array([0.0, 0.0], dtype=np.float32))
    affine.update(np.array([-2.0, 5.0], dtype=np.float32))  # stored zeros are re-initialised
    assert (affine.state().min, affine.state().max) == (-2.0, 5.0)
    with pytest.raises(ConfigError, match="per-layer"):
        OneFlowMovingAverageObserver(PerChannel(0))
    with pytest.raises(DataError, match="empty"):
        affine.update(np.zeros((0, 2), dtype=np.float32))


def test_empty_batches_follow_the_policy() -> None:
    observer = MinMaxObserver()
    observer.update(np.zeros((0, 3), dtype=np.float32))
    with pytest.raises(EmptyStatisticsError):
        observer.state()
    observer.update(np.array([1.0, 2.0], dtype=np.float32))
    observer.update(np.zeros((0,), dtype=np.float32))
    assert observer.state().max == 2.0
    strict = MinMaxObserver(policy=DataPolicy(empty="reject"))
    with pytest.raises(DataError, match="empty"):
        strict.update(np.zeros((0,), dtype=np.float32))


def test_non_finite_values_follow_the_policy() -> None:
    nan = np.array([1.0, np.nan], dtype=np.float32)
    inf = np.array([1.0, np.inf], dtype=np.float32)
    with pytest.raises(DataError, match="NaN"):
        MinMaxObserver(PerChannel(0)).update(nan)
    permissive = MinMaxObserver(policy=DataPolicy(nan="propagate"))
    permissive.update(nan)
    assert np.isnan(permissive.state().max)
    torch_like = MovingAverageMinMaxObserver()  # infinities reach the state (scale inf, §1.3)
    torch_like.update(inf)
    assert torch_like.state().max == np.inf
    with pytest.raises(DataError, match="infinite"):
        MindSporeObserver().update(inf)


def test_order_dependent_observers_refuse_to_merge() -> None:
    observers: list[Observer] = [
        MovingAverageMinMaxObserver(),
        MindSporeObserver(ema=True),
        OneFlowMovingAverageObserver(),
    ]
    for observer in observers:
        assert observer.is_order_dependent
        with pytest.raises(ConfigError, match="order-dependent"):
            observer.merge(observer)
    assert not MinMaxObserver.is_order_dependent
    with pytest.raises(ConfigError):
        MinMaxObserver().merge(MinMaxObserver(PerChannel(0)))


def test_shape_mismatches_are_data_errors() -> None:
    observer = MinMaxObserver(PerChannel(1))
    observer.update(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(DataError, match="channels"):
        observer.update(np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(DataError, match="axis 2"):
        MinMaxObserver(PerChannel(2)).update(np.zeros((2, 3), dtype=np.float32))


def test_fixed_range_observer() -> None:
    observer = FixedRangeObserver(-1.0, 2.5)
    observer.update(np.array([100.0], dtype=np.float32))
    assert (observer.state().min, observer.state().max) == (-1.0, 2.5)
    per_axis = FixedRangeObserver([-1.0, -2.0], [1.0, 2.0], PerChannel(-1))
    with pytest.raises(EmptyStatisticsError):
        per_axis.state()
    per_axis.update(np.zeros((4, 2), dtype=np.float32))
    assert per_axis.state().axis == 1
    with pytest.raises(ConfigError):
        FixedRangeObserver(1.0, -1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: MinMaxObserver(PerChannel(-1), policy=DataPolicy(inf="reject")),
        lambda: MovingAverageMinMaxObserver(PerTensor(), averaging_constant=0.25),
        lambda: MindSporeObserver(
            PerChannel(0), ema=True, ema_decay=0.9, min_init=[-1.0, -2.0], max_init=2.0
        ),
        lambda: OneFlowMovingAverageObserver(momentum=0.8, symmetric=False),
        lambda: FixedRangeObserver([-1.0, -3.0], [1.0, 0.5], PerChannel(0)),
    ],
)
def test_to_dict_round_trip(make: object) -> None:
    """A saved observer, reloaded, continues exactly where the original left off."""
    assert callable(make)
    original = make()
    rng = np.random.default_rng(11)
    original.update(rng.standard_normal((2, 5)).astype(np.float32))
    text = json.dumps(original.to_dict())
    restored = observer_from_dict(json.loads(text))
    assert type(restored) is type(original)
    batch = rng.standard_normal((2, 5)).astype(np.float32)
    original.update(batch)
    restored.update(batch)
    a, b = original.state(), restored.state()
    np.testing.assert_array_equal(_bits(a.min), _bits(b.min))
    np.testing.assert_array_equal(_bits(a.max), _bits(b.max))
    assert json.loads(json.dumps(restored.to_dict())) == json.loads(json.dumps(original.to_dict()))


def test_unobserved_and_non_finite_states_serialise() -> None:
    empty = MinMaxObserver().to_dict()
    assert empty["state"] is None and empty["version"] == 1
    permissive = MinMaxObserver(policy=DataPolicy(nan="propagate"))
    permissive.update(np.array([np.nan, -np.inf], dtype=np.float32))
    text = json.dumps(permissive.to_dict(), allow_nan=False)
    restored = observer_from_dict(json.loads(text)).state()
    assert np.isnan(restored.min) or restored.min == -np.inf
    with pytest.raises(ConfigError, match="version"):
        observer_from_dict({**empty, "version": 2})
    with pytest.raises(ConfigError, match="kind"):
        observer_from_dict({**empty, "kind": "mystery"})


def test_stats_validate_shapes() -> None:
    with pytest.raises(DataError):
        MinMaxStats(np.zeros(3), np.zeros(2))
    stats = MinMaxStats(np.array([1, 2]), np.array([3, 4]), 0)
    assert stats.min.dtype == np.float32 and stats.is_per_channel


# ---------------------------------------------------------------------------------------------
# PerTensorExtremesFeed


def _feed_observers(lenient: bool) -> list[Observer]:
    """Every per-tensor range observer in an irregular order; `lenient`: NaN and infinities
    reach the statistics, else some observers refuse them."""
    propagate = DataPolicy("ignore", "propagate", "propagate")
    strict = propagate if lenient else None
    return [
        MinMaxObserver(policy=strict),
        MovingAverageMinMaxObserver(averaging_constant=0.3, policy=strict),
        MinMaxObserver(policy=propagate),
        MindSporeObserver(ema=True, ema_decay=0.9, policy=strict),
        MovingAverageMinMaxObserver(averaging_constant=0.01, policy=propagate),
        OneFlowMovingAverageObserver(momentum=0.8, symmetric=False, policy=propagate),
        MinMaxObserver(policy=propagate if lenient else DataPolicy("ignore", "reject", "reject")),
        FixedRangeObserver(-1.0, 2.0),
    ]


def _extremes_batches(rng: np.random.Generator, n: int, count: int) -> list[tuple[np.ndarray, ...]]:
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45], np.float32)
    batches = []
    for _ in range(count):
        a = rng.standard_normal(n).astype(np.float32) * 10
        b = rng.standard_normal(n).astype(np.float32) * 10
        lows, highs = np.minimum(a, b), np.maximum(a, b)
        special = rng.random(n) < 0.1
        lows[special] = rng.choice(specials, int(special.sum()))
        special = rng.random(n) < 0.1
        highs[special] = rng.choice(specials, int(special.sum()))
        batches.append((lows, highs, rng.random(n) > 0.2))
    return batches


def _update_one_by_one(
    observers: list[Observer], names: list[str], batch: tuple[np.ndarray, ...]
) -> None:
    lows, highs, present = batch
    for name, observer, lo, hi, here in zip(names, observers, lows, highs, present):
        if here:
            try:
                observer.update_min_max(lo, hi)  # type: ignore[attr-defined]
            except DataError as err:
                raise DataError(f"tensor {name!r}: {err}") from None


@pytest.mark.parametrize("seed", range(4))
def test_extremes_feed_equals_updating_each_observer(seed: int) -> None:
    """Same states bit for bit (signed zeros, NaN, infinities, overflow, empty batches)."""
    rng = np.random.default_rng(seed)
    fed, reference = _feed_observers(lenient=True), _feed_observers(lenient=True)
    names = [f"t{i}" for i in range(len(fed))]
    for observers in (fed, reference):  # a state the feed takes over
        observers[1].update_min_max(np.float32(-3.0), np.float32(4.0))  # type: ignore[attr-defined]
    feed = PerTensorExtremesFeed(fed, names)
    for batch in _extremes_batches(rng, len(names), 12):
        _update_one_by_one(reference, names, batch)
        feed.update(*batch)
    feed.close()
    for name, got, want in zip(names, fed, reference):
        assert got.to_dict() == want.to_dict(), name
        assert type(got._min) is type(want._min), name  # type: ignore[attr-defined]
        for a, b in ((got.state().min, want.state().min), (got.state().max, want.state().max)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


@pytest.mark.parametrize("seed", range(6))
def test_extremes_feed_names_the_first_refusing_tensor(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fed, reference = _feed_observers(lenient=False), _feed_observers(lenient=False)
    names = [f"t{i}" for i in range(len(fed))]
    feed = PerTensorExtremesFeed(fed, names)
    for batch in _extremes_batches(rng, len(names), 40):
        try:
            _update_one_by_one(reference, names, batch)
        except DataError as err:
            with pytest.raises(DataError) as raised:
                feed.update(*batch)
            assert str(raised.value) == str(err)
            return
        feed.update(*batch)
    pytest.fail("no batch was refused")
