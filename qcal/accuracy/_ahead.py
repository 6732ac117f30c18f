"""The quantized model's runs of a comparison, started ahead of it on the second core."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from qcal.calibration.runtime import Feed

__all__ = ["runs_ahead"]


# Quantized runs under way at once: each on one thread of its own (COMPARE_THREADS), so the
# figures are the same whichever finishes first, and the comparison takes them in data order.
_RUNS_AHEAD = 2
# Runs shorter than this stay on the calling thread: handing a streaming model's 0.16 ms chunk
# to another thread and back took 0.24 ms (silero-vad's 120 chunks: 29 ms against 20 ms).
_RUN_WORTH_A_THREAD = 1e-3  # seconds


def runs_ahead(
    session: Any, names: list[str], batches: Iterable[tuple[Feed, int]]
) -> Generator[tuple[Feed, int, Future[list[np.ndarray]]], None, None]:
    """The batches, each with the quantized model's run of it: once a run but the first (which
    pays the session's first allocations: 1.7 ms of silero-vad's) takes `_RUN_WORTH_A_THREAD`,
    the rest start up to `_RUNS_AHEAD` batches ahead on the calibration's two cores (the float
    model's outputs are mostly kept, and the fallback's checks would otherwise leave one core
    idle)."""
    pool: ThreadPoolExecutor | None = None
    pending: deque[tuple[Feed, int, Future[list[np.ndarray]]]] = deque()
    first = True
    try:
        for feed, n in batches:
            if pool is None:
                started = time.perf_counter()
                done = _ran(session, names, feed)
                if not first and time.perf_counter() - started >= _RUN_WORTH_A_THREAD:
                    pool = ThreadPoolExecutor(max_workers=_RUNS_AHEAD,
                                              thread_name_prefix="qcal-compare")
                first = False
                yield feed, n, done
                continue
            pending.append((feed, n, pool.submit(session.run, names, dict(feed))))
            if len(pending) >= _RUNS_AHEAD:
                yield pending.popleft()
        while pending:
            yield pending.popleft()
    finally:  # closed early (an error, an interrupt): runs not started are dropped
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _ran(session: Any, names: list[str], feed: Feed) -> Future[list[np.ndarray]]:
    """A run on this thread, as a finished future (its error raised where its result is read)."""
    done: Future[list[np.ndarray]] = Future()
    try:
        done.set_result(session.run(names, dict(feed)))
    except Exception as err:  # noqa: BLE001  onnxruntime raises untyped exceptions
        done.set_exception(err)
    return done
