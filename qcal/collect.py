"""Run the float model over calibration batches and feed every observed tensor to its observer.

One onnxruntime session runs a copy of the model whose outputs include every tensor to observe.
Each batch's arrays go to the observers and are dropped before the next-but-one batch runs, so
peak memory depends on the batch size, never on the number of samples. Observer updates of batch
k run on a worker thread while onnxruntime computes batch k+1 (both release the GIL); batches
reach the observers strictly in data order, so order-dependent observers (EMA) stay deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.errors import DataError, ModelError, QcalError
from qcal.observers import Observer
from qcal.runtime import create_session

__all__ = ["CollectionSummary", "collect", "expose_tensors"]

Feed = Mapping[str, np.ndarray]
OnBatch = Callable[[int], None]


@dataclass(frozen=True)
class CollectionSummary:
    samples: int
    batches: int
    seconds: float


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


def _update_observers(
    observers: Mapping[str, Observer], names: list[str], arrays: list[np.ndarray]
) -> None:
    for name, array in zip(names, arrays):
        observer = observers.get(name)
        if observer is None:
            continue
        if array.dtype != np.float32:
            array = array.astype(np.float32)
        try:
            observer.update(array)
        except QcalError as err:
            raise type(err)(f"tensor {name!r}: {err}") from None


def collect(
    model: onnx.ModelProto,
    observers: Mapping[str, Observer],
    batches: Iterable[tuple[Feed, int]],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: OnBatch | None = None,
) -> CollectionSummary:
    """Run `model` on every batch and update `observers` (keyed by tensor name) in data order."""
    started = time.perf_counter()
    session = create_session(
        expose_tensors(model, sorted(observers)), providers=providers, threads=threads,
        what="calibration model",
    )
    output_names = [o.name for o in session.get_outputs()]
    samples = batch_count = 0
    pending: Future[None] | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qcal-observe") as pool:
        try:
            for feed, n in batches:
                arrays = _run(session, output_names, feed)
                if pending is not None:
                    pending.result()  # keeps at most two batches of activations alive
                pending = pool.submit(_update_observers, observers, output_names, arrays)
                del arrays
                samples += n
                batch_count += 1
                if on_batch is not None:
                    on_batch(n)
            if pending is not None:
                pending.result()
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
    if samples == 0:
        raise DataError("calibration data has no samples")
    return CollectionSummary(samples, batch_count, time.perf_counter() - started)


def _run(session: object, output_names: list[str], feed: Feed) -> list[np.ndarray]:
    try:
        return session.run(output_names, dict(feed))  # type: ignore[attr-defined, no-any-return]
    except Exception as err:  # onnxruntime raises its own untyped exceptions
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"onnxruntime failed on a calibration batch: {message}") from None
