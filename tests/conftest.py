"""Settings every test shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qcal.accuracy import latency

_NOISE_LEVEL = latency._NOISE_LEVEL


@pytest.fixture(autouse=True, scope="session")
def _no_timing_verdicts() -> Iterator[None]:
    """Tests assert behaviour, never speed (these machines are noisy, and most test models are
    small enough for Q/DQ to cost more than integer kernels save): the built-in not-slower gate,
    whose verdict is a timing, never fails a run in this process unless the test is marked
    `timing_verdict`. A `qcal` subprocess is not patched: such tests pass --allow-slower."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "_NOISE_LEVEL", 0.0)
        yield


@pytest.fixture(autouse=True)
def _timing_verdict_when_marked(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("timing_verdict") is not None:
        monkeypatch.setattr(latency, "_NOISE_LEVEL", _NOISE_LEVEL)
