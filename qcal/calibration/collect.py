"""Run the float model over calibration batches and feed every observed tensor to its observer.

One onnxruntime session runs a copy of the model that outputs what the observers need. Min-max
observers (all but histograms) need only each batch's extremes: the graph computes them next to
the tensors (qcal.calibration.reduce_min_max), only a few small arrays leave onnxruntime, and the
tensors are freed as in plain inference. Other observers get whole tensors as extra outputs.
Each batch's arrays go to the observers and are dropped before the next-but-one batch runs, so
peak memory depends on the batch size, never on the number of samples. Observer updates of batch
k run on a worker thread while onnxruntime computes batch k+1 (both release the GIL); batches
reach the observers strictly in data order, so order-dependent observers (EMA) stay deterministic.
When whole tensors are observed, onnxruntime's idle threads sleep instead of spinning, so that
the observers' threads get the cores onnxruntime is not computing on (histograms counted by
the compiled kernels of ``qcal[fast]`` leave the GIL for the whole count). With in-graph
extremes only, little work falls between two runs, and the threads keep onnxruntime's default
(spinning), which spares a wake-up per parallel node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnx

from qcal.calibration.data import find_nonfinite
from qcal.calibration.data import name_samples as name_in_data
from qcal.calibration.expose_subgraph_tensors import expose_subgraph_tensors
from qcal.calibration.reduce_min_max import (
    MinMaxLayout,
    add_min_max_outputs,
    read_per_channel,
    read_per_tensor,
)
from qcal.calibration.runtime import Feed, create_session
from qcal.graph.shapes import value_ranks
from qcal.graph.structure import element_types
from qcal.numerics import kernels
from qcal.numerics.errors import DataError, ModelError, QcalError
from qcal.numerics.observers import Observer, PerChannel, PerTensorExtremesFeed

__all__ = ["CollectionSummary", "OutputSink", "collect", "expose_tensors"]

OnBatch = Callable[[int], None]
# Whole tensors (histograms) are observed by two threads, each tensor's observer by one of them
# per batch. numpy leaves the GIL in its counting and reduction loops, and while the observers
# are the bottleneck onnxruntime has finished the next batch and leaves a core idle.
_WORKERS = 2
# Values to count from which loading the compiled kernels pays (a second of numpy counting).
_KERNELS_PAY_FROM_VALUES = 300_000_000


@dataclass(frozen=True)
class OutputSink:
    """Where the model's own outputs `names` of each batch go, in data order: the calibration
    pass computes them anyway, and a comparison on the same data need not run the model again."""

    names: tuple[str, ...]
    keep: Callable[[list[np.ndarray]], None]


@dataclass(frozen=True)
class CollectionSummary:
    samples: int
    batches: int
    seconds: float
    providers: tuple[str, ...] = ()  # the execution providers onnxruntime ran with


def expose_tensors(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph outputs also include `tensors` (types from shape inference)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    graph = exposed.graph
    known = {vi.name: vi for vi in (*graph.value_info, *graph.input, *graph.output)}
    present = {o.name for o in graph.output}
    inits = {i.name: i for i in graph.initializer}
    for name in tensors:
        if name in present:
            continue
        if name in known:
            graph.output.append(known[name])
        elif name in inits:
            graph.output.append(onnx.helper.make_tensor_value_info(name, inits[name].data_type, None))
        else:
            raise ModelError(f"tensor {name!r}: its type is unknown (shape inference did not reach it)")
        present.add(name)
    return exposed


def _reducible(
    model: onnx.ModelProto, observers: Mapping[str, tuple[str, Observer]]
) -> dict[str, int | None]:
    """Outputs whose extremes onnxruntime computes in the graph, with their channel axis (None:
    per tensor).

    Min-max observers need only the extremes of each batch, so their tensors never leave
    onnxruntime. Per-tensor histograms get the whole array too, and take its extremes from the
    graph rather than in a pass of their own. Float16 tensors and per-channel tensors of
    unknown rank get whole arrays only.
    """
    types = element_types(model.graph)
    ranks = value_ranks(model.graph)
    found: dict[str, int | None] = {}
    for output, (_, observer) in observers.items():
        if types.get(output) != onnx.TensorProto.FLOAT:
            continue
        if _takes_extremes(observer):
            found[output] = None
            continue
        if not (hasattr(observer, "update_min_max") and hasattr(observer, "channel_axis")):
            continue
        if not isinstance(getattr(observer, "granularity", None), PerChannel):
            found[output] = None
            continue
        rank = ranks.get(output)
        if rank is None:
            continue
        try:
            found[output] = observer.channel_axis(rank)
        except DataError:
            continue  # the update with the whole batch reports it, naming the tensor
    return found


def _takes_extremes(observer: Observer) -> bool:
    """A whole-array observer that accepts the batch's extremes computed elsewhere."""
    return bool(getattr(observer, "takes_batch_extremes", False))


def _needs_arrays(observer: Observer) -> bool:
    return not hasattr(observer, "update_min_max")


Extremes = dict[str, tuple[Any, Any] | tuple[None, None]]


@dataclass(frozen=True)
class _ReducedBatch:
    """One batch's in-graph extremes, as :class:`_ReducedFeed` hands them to the worker."""

    lows: np.ndarray  # per-tensor values fed together
    highs: np.ndarray
    present: np.ndarray
    channels: list[tuple[str, Any, Any]]  # per-channel (value, min, max); None, None: empty


class _ReducedFeed:
    """Feeds the in-graph extremes of each batch to their min-max observers.

    Per-tensor values go to their observers together as arrays (a few array operations per
    batch instead of a few calls per tensor), per-channel values one by one after them.
    """

    def __init__(
        self, observers: Mapping[str, tuple[str, Observer]], reduced: MinMaxLayout
    ) -> None:
        self.reduced = reduced
        values = reduced.per_tensor_values
        fed = [i for i, v in enumerate(values) if not _needs_arrays(observers[v][1])]
        self.fed = np.array(fed, dtype=np.int64)
        self.feed = PerTensorExtremesFeed(
            [observers[values[i]][1] for i in fed], [observers[values[i]][0] for i in fed]
        )
        # Per-tensor histograms take the extremes with their whole arrays.
        self.extremes_of = [
            (i, v) for i, v in enumerate(values) if _takes_extremes(observers[v][1])
        ]

    def read(self, arrays: Mapping[str, np.ndarray]) -> tuple[_ReducedBatch, Extremes]:
        """One batch's extremes: what :meth:`update` takes, and the whole arrays' extremes."""
        per_tensor = read_per_tensor(self.reduced, arrays)
        fed = self.fed
        batch = _ReducedBatch(
            per_tensor.lows[fed], per_tensor.highs[fed], ~per_tensor.empty[fed],
            list(read_per_channel(self.reduced, arrays)),
        )
        empty = per_tensor.empty
        extremes: Extremes = {
            value: (per_tensor.lows[i], per_tensor.highs[i]) for i, value in self.extremes_of
            if not empty[i]
        }
        return batch, extremes


def _update_reduced(
    observers: Mapping[str, tuple[str, Observer]], feed: _ReducedFeed, batch: _ReducedBatch
) -> None:
    """Feed the in-graph extremes of one batch to their min-max observers."""
    feed.feed.update(batch.lows, batch.highs, batch.present)
    for value, lo, hi in batch.channels:
        if lo is None or hi is None:
            continue  # no values in this batch, as for whole arrays below
        tensor, observer = observers[value]
        if _needs_arrays(observer):
            continue  # fed with the whole array
        try:
            observer.update_min_max(lo, hi, feed.reduced.axes[value])  # type: ignore[attr-defined]
        except QcalError as err:
            raise type(err)(f"tensor {tensor!r}: {err}") from None


def _whole_tensor_shares(
    observers: Mapping[str, tuple[str, Observer]],
    whole: set[str],
    names: list[str],
    arrays: list[np.ndarray],
) -> list[list[int]]:
    """Positions of the whole tensors of one batch, split between the workers by size."""
    shares: list[list[int]] = [[] for _ in range(_WORKERS)]
    loads = [0] * _WORKERS
    wanted = [i for i, n in enumerate(names) if n in whole]
    for i in sorted(wanted, key=lambda i: -arrays[i].size):
        lightest = loads.index(min(loads))
        shares[lightest].append(i)
        loads[lightest] += arrays[i].size
    return [share for share in shares if share]


def _update_observers(
    observers: Mapping[str, tuple[str, Observer]],
    names: list[str],
    arrays: list[np.ndarray],
    positions: list[int],
    extremes: Extremes,
) -> None:
    """Feed whole session outputs (at `positions`) to the observers of the tensors they carry."""
    for position in positions:
        name, array = names[position], arrays[position]
        tensor, observer = observers[name]
        if array.size == 0:
            # No values: an If branch not taken, a Loop without iterations, an empty batch.
            continue
        if array.dtype != np.float32:
            array = array.astype(np.float32)
        try:
            if name in extremes:  # only observers that take them, only non-empty batches
                observer.update(array, extremes=extremes[name])  # type: ignore[call-arg]
            else:
                observer.update(array)
        except QcalError as err:
            raise type(err)(f"tensor {tensor!r}: {err}") from None


_IN_ORDER = partial(name_in_data, None)  # samples named as counted in the batches


def collect(
    model: onnx.ModelProto,
    observers: Mapping[str, Observer],
    batches: Iterable[tuple[Feed, int]],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: OnBatch | None = None,
    expected_samples: int | None = None,
    outputs: OutputSink | None = None,
    name_samples: Callable[[int, int], str] = _IN_ORDER,
) -> CollectionSummary:
    """Run `model` on every batch and update `observers` (keyed by tensor name) in data order;
    the model's outputs go to `outputs` when given. An error names the samples of a batch by
    `name_samples(first, n)` (counted in the batches' order by default).

    `expected_samples` (the size of the data, when known) decides early whether loading the
    compiled kernels pays (:class:`_KernelsWhenWorthIt`); results never depend on it.
    """
    started = time.perf_counter()
    # Tensors of If/Loop/Scan bodies reach the outputs through routes of their own.
    routed = expose_subgraph_tensors(model, observers)
    by_output = {routed.sources[t]: (t, observer) for t, observer in observers.items()}
    calibration_model, reduced = add_min_max_outputs(
        routed.model, _reducible(routed.model, by_output)
    )
    del routed
    whole = sorted(
        o for o, (_, observer) in by_output.items()
        if o not in reduced.axes or _needs_arrays(observer)
    )
    session = create_session(
        expose_tensors(calibration_model, whole), providers=providers, threads=threads,
        what="calibration model", node_order=True, spin=not whole,
    )
    del calibration_model
    output_names = reduced.output_names + whole
    kept = list(outputs.names) if outputs is not None else []
    output_names += [name for name in kept if name not in output_names]
    statistics = _ReducedFeed(by_output, reduced)
    samples = batch_count = 0
    kernels_when_worth_it = _KernelsWhenWorthIt(expected_samples)
    # The batch being observed, with its feed and samples (to name bad inputs on failure).
    pending: tuple[list[Future[None]], Feed, str] | None = None
    # Not a `with` block: on an interrupt (Ctrl-C raises wherever the program is, even inside a
    # lock the workers need) the pool is left without waiting for its threads. Started only
    # for whole tensors: extremes taken inside onnxruntime are a few numbers a batch, fed here
    # faster than a worker thread could take them (its start and the interpreter lock passed
    # back and forth cost a small model more than its whole inference).
    pool: ThreadPoolExecutor | None = None
    try:
        for feed, n in batches:
            which = name_samples(samples, n)
            arrays = _run(session, output_names, feed, which)
            by_name = dict(zip(output_names, arrays))
            if outputs is not None:  # copies: onnxruntime's arrays held 0.5 GB more on det
                outputs.keep([np.array(by_name[name], copy=True) for name in kept])
            if pending is not None:
                _wait(*pending)  # keeps at most two batches of activations alive
            batch, extremes = statistics.read(by_name)
            shares = _whole_tensor_shares(by_output, set(whole), output_names, arrays)
            kernels_when_worth_it.counted(sum(arrays[i].size for s in shares for i in s), n)
            if shares:
                if pool is None:
                    pool = ThreadPoolExecutor(max_workers=_WORKERS,
                                              thread_name_prefix="qcal-observe")
                futures = [pool.submit(_update_reduced, by_output, statistics, batch)]
                futures += [pool.submit(_update_observers, by_output, output_names, arrays,
                                        share, extremes) for share in shares]
            else:
                futures = [_done_here(_update_reduced, by_output, statistics, batch)]
            pending = (futures, feed, which)
            del arrays, by_name
            samples += n
            batch_count += 1
            if on_batch is not None:
                on_batch(n)
        if pending is not None:
            _wait(*pending)
        statistics.feed.close()
    except KeyboardInterrupt:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    if pool is not None:
        pool.shutdown(wait=True)
    if samples == 0:
        raise DataError("calibration data has no samples")
    return CollectionSummary(
        samples, batch_count, time.perf_counter() - started, tuple(session.get_providers())
    )


class _KernelsWhenWorthIt:
    """Starts loading the compiled kernels (``qcal[fast]``) once a run counts enough values.

    numpy counts a histogram value in about 3 ns, the compiled kernels in about 1.3, but loading
    them (importing numba) holds the interpreter for most of a second, which small runs would
    feel: the kernels are loaded only when the values still to count, projected from the data
    size when it is known (else those counted so far), pay for that. Batches counted before
    they are ready take the numpy path; the statistics are the same either way.
    """

    def __init__(self, expected_samples: int | None) -> None:
        self._expected = expected_samples
        self._values = 0
        self._samples = 0
        self._started = False

    def counted(self, values: int, samples: int) -> None:
        """One batch of `samples` is about to have `values` counted by histograms."""
        if self._started or not values:
            return
        self._values += values
        self._samples += samples
        projected = self._values
        if self._expected and self._expected > self._samples:
            projected = self._values * self._expected // max(self._samples, 1)
        if projected >= _KERNELS_PAY_FROM_VALUES:
            kernels.preload()
            self._started = True


def _run(session: object, output_names: list[str], feed: Feed, which: str) -> list[np.ndarray]:
    try:
        return session.run(output_names, dict(feed))  # type: ignore[attr-defined, no-any-return]
    except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"onnxruntime failed on calibration {which}: {message}"
        ) from None


def _done_here(update: Callable[..., None], *args: object) -> Future[None]:
    """`update(*args)` run in this thread, its outcome held as a worker's would be."""
    future: Future[None] = Future()
    try:
        update(*args)
    except Exception as err:  # noqa: BLE001  raised where the workers' are: in _wait
        future.set_exception(err)
    else:
        future.set_result(None)
    return future


def _wait(futures: list[Future[None]], feed: Feed, which: str) -> None:
    """The observers' update of one batch; a failure names the inputs holding NaN/inf."""
    try:
        for future in futures:
            future.result()
    except DataError as err:
        bad = find_nonfinite(feed)
        if not bad:
            raise
        names = ", ".join(repr(name) for name in bad)
        raise DataError(
            f"input {names} holds NaN or infinite values in calibration "
            f"{which} (0-based); {err}"
        ) from None
