"""Compiled kernels (qcal[fast]) against the numpy reference: bit-identical statistics.

Every case feeds the same batches to an observer under QCAL_KERNELS=numpy and under
QCAL_KERNELS=numba and compares the whole state (blocks, counts, extremes, saved form) bit for
bit, and the error, when one is raised, word for word.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qcal.numerics import kernels
from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.histogram import HistogramObserver
from qcal.numerics.observers import (
    Granularity,
    MinMaxObserver,
    PerChannel,
    PerTensor,
    reduce_min_max,
)

HAS_NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(
    not HAS_NUMBA, reason="numba is not installed (pip install 'qcal[fast]')"
)


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    kernels.reset()
    yield
    kernels.reset()


def _with_kernels(
    monkeypatch: pytest.MonkeyPatch, choice: str, run: Callable[[], Any]
) -> Any:
    monkeypatch.setenv(kernels.KERNELS_ENV, choice)
    kernels.reset()
    try:
        assert kernels.active() == choice
        return run()
    finally:
        kernels.reset()


def _feed(granularity: Granularity, batches: Sequence[np.ndarray]) -> Callable[[], Any]:
    """Update a fresh histogram observer batch by batch: its saved state, or the error."""

    def run() -> Any:
        observer = HistogramObserver(granularity)
        outcome: list[Any] = []
        for batch in batches:
            try:
                observer.update(batch)
            except DataError as err:
                outcome.append(str(err))
        state = observer.to_dict()
        if state["state"] is not None:
            snapshot = observer.state()
            outcome.append(
                [snapshot.groups.tobytes(), snapshot.counts.tobytes(), snapshot.min.tobytes(),
                 snapshot.max.tobytes(), snapshot.counts.dtype.str]
            )
        outcome.append(json.dumps(state))
        return outcome

    return run


def _awkward(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """Normal values with zeros of both signs, subnormals, ties, outliers and bin edges."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    pick = rng.random(flat.size)
    flat[pick < 0.1] = 0.0
    flat[(pick >= 0.1) & (pick < 0.15)] = -0.0
    flat[(pick >= 0.15) & (pick < 0.17)] = np.float32(1e-40)  # subnormal
    flat[(pick >= 0.17) & (pick < 0.25)] = np.float32(0.75)  # ties
    flat[(pick >= 0.25) & (pick < 0.26)] *= 1e6
    # Bin edges: patterns whose low mantissa bits (below the 8 a key keeps) are all zero.
    edges = (pick >= 0.26) & (pick < 0.35)
    flat[edges] = (flat[edges].view(np.uint32) & np.uint32(0xFFFF8000)).view(np.float32)
    with np.errstate(over="ignore"):  # float16: the outliers become infinities (refused)
        return x.astype(dtype)


def _cases() -> Iterator[tuple[str, Granularity, list[np.ndarray]]]:
    rng = np.random.default_rng(16)
    small = [_awkward(rng, (3, 7)) for _ in range(5)]  # below the numpy path's buffering
    large = [_awkward(rng, (1, 70_000)) for _ in range(2)]
    yield "per tensor, small and large batches", PerTensor(), small + large + small
    yield "per tensor, float64", PerTensor(), [_awkward(rng, (50, 40), np.float64) for _ in range(3)]
    yield "per tensor, float16", PerTensor(), [_awkward(rng, (2, 3000), np.float16) for _ in range(2)]
    yield "per tensor, integers", PerTensor(), [rng.integers(-300, 300, (40, 40)) for _ in range(2)]
    yield "per tensor, one value", PerTensor(), [np.float32([-0.0]), np.float32([0.0])]
    frozen = _awkward(rng, (64, 64))
    frozen.flags.writeable = False
    yield "per tensor, read-only batch", PerTensor(), [frozen, frozen]
    yield "per tensor, empty batch", PerTensor(), [np.zeros((0, 4), np.float32), small[0]]
    for axis in (0, 1, -1):
        batches = [_awkward(rng, (4, 6, 5, 3)) for _ in range(3)]
        yield f"per channel, axis {axis}", PerChannel(axis), batches
    yield "per channel, non-contiguous", PerChannel(1), [
        _awkward(rng, (6, 8, 10)).transpose(2, 1, 0) for _ in range(2)
    ]
    yield "per channel, many values", PerChannel(0), [_awkward(rng, (3, 200_000))]
    yield "per channel, float64", PerChannel(1), [_awkward(rng, (5, 4, 9), np.float64)]
    yield "per channel, more channels than the kernel maps", PerChannel(0), [
        _awkward(rng, (20_000, 3)) for _ in range(2)
    ]
    nan = _awkward(rng, (40, 40))
    nan[3, 5] = np.nan
    pos_inf = _awkward(rng, (40, 40))
    pos_inf[0, 0] = np.inf
    neg_inf = _awkward(rng, (40, 40))
    neg_inf[-1, -1] = -np.inf
    yield "per tensor, NaN and inf refused", PerTensor(), [small[1], nan, pos_inf, neg_inf, small[2]]
    good = _awkward(rng, (40, 40))
    yield "per channel, NaN and inf refused", PerChannel(0), [nan, good, pos_inf, neg_inf, good]


@needs_numba
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_compiled_histograms_are_bit_identical(
    case: tuple[str, Granularity, list[np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, granularity, batches = case
    reference = _with_kernels(monkeypatch, "numpy", _feed(granularity, batches))
    compiled = _with_kernels(monkeypatch, "numba", _feed(granularity, batches))
    assert compiled == reference


@needs_numba
def test_compiled_histograms_take_extremes_from_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-tensor batches with their extremes given (as onnxruntime computes them)."""
    rng = np.random.default_rng(3)
    batches = [_awkward(rng, (int(n),)) for n in rng.integers(1, 90_000, 12)]

    def run() -> Any:
        observer = HistogramObserver(PerTensor())
        for batch in batches:
            observer.update(batch, extremes=(batch.min(), batch.max()))
        return json.dumps(observer.to_dict())

    assert _with_kernels(monkeypatch, "numba", run) == _with_kernels(monkeypatch, "numpy", run)


@needs_numba
def test_merge_and_reload_mix_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state counted by one path and merged into or reloaded by the other stays exact."""
    rng = np.random.default_rng(5)
    first, second = _awkward(rng, (30_000,)), _awkward(rng, (50_000,))

    def observe(batch: np.ndarray) -> HistogramObserver:
        observer = HistogramObserver(PerTensor())
        observer.update(batch)
        return observer

    by_numpy = _with_kernels(monkeypatch, "numpy", lambda: observe(first))
    by_numba = _with_kernels(monkeypatch, "numba", lambda: observe(second))
    by_numpy.merge(by_numba)
    reloaded = HistogramObserver.from_dict(by_numpy.to_dict())
    _with_kernels(monkeypatch, "numba", lambda: reloaded.update(first))
    whole = _with_kernels(monkeypatch, "numpy", lambda: observe(np.concatenate([first, second, first])))
    assert json.dumps(reloaded.to_dict()) == json.dumps(whole.to_dict())
    # The counts reach every value once: an independent total.
    assert int(reloaded.state().total()[0]) == 2 * first.size + second.size


@needs_numba
def test_compiled_counts_match_an_independent_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bins by the float32 bit pattern, counted with Python's own Counter."""
    from collections import Counter

    rng = np.random.default_rng(9)
    x = _awkward(rng, (5000,))
    observer = HistogramObserver(PerTensor(), mantissa_bits=4)
    _with_kernels(monkeypatch, "numba", lambda: observer.update(x))
    expected = Counter(int(p) >> (23 - 4) for p in x.view(np.uint32))
    keys, counts = observer.state().channel_bins(0)
    assert dict(zip(keys.tolist(), counts.tolist())) == dict(expected)


def test_numpy_choice_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "numpy")
    assert kernels.compiled() is None and kernels.active() == "numpy"
    observer = HistogramObserver(PerTensor())
    observer.update(np.float32([1.0, 2.0]))
    assert observer._offsets is None  # the compiled path keeps block offsets; numpy never builds them


@needs_numba
def test_auto_choice_uses_numba_once_preloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    assert kernels.active() == "numpy"  # nothing loads numba behind the caller's back
    kernels.preload()
    deadline = time.monotonic() + 60
    while kernels.compiled() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kernels.active() == "numba"
    observer = HistogramObserver(PerTensor())
    observer.update(np.float32([1.0, 2.0]))
    assert observer._offsets is not None


def test_unknown_choice_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "fortran")
    with pytest.raises(ConfigError, match="QCAL_KERNELS='fortran'"):
        HistogramObserver(PerTensor()).update(np.float32([1.0]))


def test_numba_asked_for_but_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba now raises ImportError
    monkeypatch.delitem(sys.modules, "qcal.numerics.kernels._compiled", raising=False)
    monkeypatch.delattr(kernels, "_compiled", raising=False)
    monkeypatch.setenv(kernels.KERNELS_ENV, "numba")
    with pytest.raises(ConfigError, match=r"pip install 'qcal\[fast\]'"):
        kernels.compiled()
    monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
    kernels.reset()
    assert kernels.compiled() is None  # auto falls back to numpy quietly


def test_min_max_observers_do_not_depend_on_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    x = _awkward(rng, (8, 300, 300))

    def run() -> Any:
        observer = MinMaxObserver(PerChannel(1))
        observer.update(x)
        lo, hi, _ = reduce_min_max(x, PerTensor())
        return json.dumps(observer.to_dict()), lo.tobytes(), hi.tobytes()

    choices = ["numpy", "numba"] if HAS_NUMBA else ["numpy"]
    assert len({_with_kernels(monkeypatch, c, run) for c in choices}) == 1


def test_preload_switches_to_the_compiled_kernels_in_the_background(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches before and after the switch add up to the reference state."""
    import time

    rng = np.random.default_rng(21)
    batches = [_awkward(rng, (int(n),)) for n in rng.integers(1, 50_000, 40)]
    reference = _with_kernels(monkeypatch, "numpy", _feed(PerTensor(), batches))
    monkeypatch.delenv(kernels.KERNELS_ENV)
    kernels.reset()
    kernels.preload()
    observer = HistogramObserver(PerTensor())
    for batch in batches:
        observer.update(batch)
    deadline = time.monotonic() + 60
    while HAS_NUMBA and kernels.compiled() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kernels.active() == ("numba" if HAS_NUMBA else "numpy")
    for batch in batches:
        observer.update(batch)
    twice = _with_kernels(monkeypatch, "numpy", _feed(PerTensor(), batches + batches))
    assert reference != twice
    assert json.dumps(observer.to_dict()) == twice[-1]


def test_preload_leaves_a_forced_choice_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "numpy")
    kernels.preload()
    assert kernels.compiled() is None


def test_cli_refuses_an_unknown_kernel_choice_with_exit_3(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from qcal.cli import main

    samples = Path(__file__).resolve().parents[1] / "sample_models"
    monkeypatch.setenv(kernels.KERNELS_ENV, "fortran")
    out, report = tmp_path / "m.qdq.onnx", tmp_path / "m.qcal.json"
    result = CliRunner().invoke(main, [
        "calibrate", str(samples / "digits_cnn.onnx"), "--method", "entropy", "--limit", "4",
        "-o", str(out), "--report", str(report), "-q",
    ])
    assert result.exit_code == 3
    assert "QCAL_KERNELS='fortran'" in result.output
    assert not out.exists() and not report.exists()


@needs_numba
def test_cli_model_and_report_are_the_same_with_and_without_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from qcal.cli import main

    samples = Path(__file__).resolve().parents[1] / "sample_models"
    written = {}
    for choice in ("numpy", "numba"):
        monkeypatch.setenv(kernels.KERNELS_ENV, choice)
        kernels.reset()
        out, report = tmp_path / f"{choice}.qdq.onnx", tmp_path / f"{choice}.qcal.json"
        result = CliRunner().invoke(main, [
            "calibrate", "--min-product-macs", "0", str(samples / "transformer_block.onnx"), "--method", "percentile",
            "-o", str(out), "--report", str(report), "-q",
        ])
        assert result.exit_code == 0, result.output
        assert kernels.active() == choice
        document = json.loads(report.read_text())
        document.pop("timings_seconds")
        document["output_model"].pop("path")
        written[choice] = (out.read_bytes(), document)
    assert written["numpy"] == written["numba"]


def test_calibration_loads_the_kernels_only_when_counting_pays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small runs never import numba; large ones start loading it from the projected size."""
    from qcal.calibration import collect

    started: list[bool] = []
    monkeypatch.setattr(kernels, "preload", lambda: started.append(True))
    pay = collect._KERNELS_PAY_FROM_VALUES
    small = collect._KernelsWhenWorthIt(expected_samples=1000)
    for _ in range(1000):
        small.counted(pay // 2000, 1)
    assert not started
    large = collect._KernelsWhenWorthIt(expected_samples=1000)
    large.counted(pay // 500, 1)  # 1000 such samples would count twice what pays
    assert started == [True]
    large.counted(pay, 1)
    assert started == [True]  # once
    unknown = collect._KernelsWhenWorthIt(expected_samples=None)
    unknown.counted(pay // 2, 1)
    assert started == [True]
    unknown.counted(pay // 2, 1)  # what was counted so far reaches it
    assert started == [True, True]


@needs_numba
def test_compiled_count_takes_back_a_batch_with_nan_it_was_told_was_finite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Extremes that hide a NaN break update()'s contract; the kernel still refuses the batch
    and leaves the counts as they were (its second, subtracting pass)."""
    rng = np.random.default_rng(4)
    good = _awkward(rng, (5000,))
    bad = good.copy()
    bad[1234] = np.nan

    def run() -> Any:
        observer = HistogramObserver(PerTensor())
        observer.update(good)
        before = json.dumps(observer.to_dict())
        with pytest.raises(DataError, match="1 NaN"):
            observer.update(bad, extremes=(good.min(), good.max()))
        return before, json.dumps(observer.to_dict())

    before, after = _with_kernels(monkeypatch, "numba", run)
    assert before == after
