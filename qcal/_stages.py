"""What every stage of a run shares: the caller's progress callback and the stage timings."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

Progress = Callable[[str, int, "int | None"], None]
"""Called as progress(stage, samples_done_since_last_call, total_samples_or_None)."""


@dataclass
class _Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started  # a stage may come back (qparams)
            self.seconds[name] = round(self.seconds.get(name, 0.0) + elapsed, 6)


def _stage_progress(progress: Progress | None, stage: str, total: int | None) -> Callable[[int], None] | None:
    if progress is None:
        return None
    progress(stage, 0, total)
    return lambda n: progress(stage, n, total)
