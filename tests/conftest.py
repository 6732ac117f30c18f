"""Settings every test shares."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from qcal import _users_model
from qcal.accuracy import latency

_TOLERANCE = latency._TOLERANCE


@pytest.fixture(autouse=True, scope="session")
def _no_timing_verdicts() -> Iterator[None]:
    """Tests assert behaviour, never speed (these machines are noisy, and most test models are
    small enough for Q/DQ to cost more than integer kernels save): the built-in not-slower gate,
    whose verdict is a timing, never fails a run in this process unless the test is marked
    `timing_verdict` (and the latency check stops after the few dozen pairs a figure needs).
    The pipeline times its models in this process (`time_here`), not in a process of their own
    as qcal does (about 0.3 s a run, which tripled the suite's time): that process is tested on
    its own (`test_latency`), and by the suite's `qcal` subprocesses, which are not patched
    (they calibrate the sample digits CNN, which runs faster quantized)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "_TOLERANCE", math.inf)  # every model as fast as float
        patch.setattr(_users_model, "time_side_by_side", latency.time_here)
        yield


@pytest.fixture(autouse=True)
def _timing_verdict_when_marked(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("timing_verdict") is not None:
        monkeypatch.setattr(latency, "_TOLERANCE", _TOLERANCE)
