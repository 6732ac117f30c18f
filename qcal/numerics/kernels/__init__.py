"""Which kernels compute the statistics of a batch: compiled (numba) or numpy.

The numpy code in :mod:`qcal.numerics.observers` and :mod:`qcal.numerics.histogram` is the
reference. With the ``qcal[fast]`` extra installed (numba), histogram counting (per tensor and
per channel, any layout) runs as a compiled kernel instead: one pass over each batch, without
holding the GIL, so it overlaps with onnxruntime's run of the next batch. It gives the same
statistics bit for bit: counts are integers, so neither the order nor the grouping of the
additions can change them.

The environment variable ``QCAL_KERNELS`` chooses: ``auto`` (the default: compiled when numba
imports and :func:`preload` was called), ``numpy`` (the reference path, for debugging and for
comparing), ``numba`` (always compiled; an error when numba is missing). The choice is read once
per process, at the first batch that could use a kernel or by :func:`preload`; numba is imported
only then, so runs that need no kernel do not pay its import.

Importing numba and loading the kernels from the cache takes a few tenths of a second.
:func:`preload` does it on a thread of its own while the caller goes on (calibration starts it
once a run has enough values to count for the kernels to pay); batches counted until the
kernels are ready take the numpy path. Both paths give the same statistics, so when the switch happens changes
nothing but the time.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

from qcal.numerics.errors import ConfigError

__all__ = ["KERNELS_ENV", "active", "compiled", "preload", "reset"]

KERNELS_ENV = "QCAL_KERNELS"
_CHOICES = ("auto", "numpy", "numba")
_UNDECIDED = object()
_LOADING = object()
_loaded: object = _UNDECIDED  # the compiled module, None for numpy, _UNDECIDED or _LOADING
_generation = 0  # bumped by reset(): a preload started before it publishes nothing
_chosen: str | None = None  # QCAL_KERNELS as read


def compiled() -> ModuleType | None:
    """The compiled kernels (:mod:`qcal.numerics.kernels._compiled`), or None for numpy.

    With ``QCAL_KERNELS=numba`` the first call loads them (and waits for that); with ``auto``
    only :func:`preload` does, so until it has finished this is None.

    Raises:
        ConfigError: ``QCAL_KERNELS`` holds an unknown value, or ``numba`` without numba.
    """
    global _loaded
    if _loaded is _UNDECIDED:
        choice = _choice()
        if choice == "auto":
            return None  # numpy until preload() has loaded the kernels
        _loaded = _load(choice)
    if _loaded is _LOADING:
        return None
    return _loaded  # type: ignore[return-value]


def preload() -> None:
    """Start loading the kernels on a daemon thread, unless they are chosen already.

    An unknown ``QCAL_KERNELS`` or ``numba`` without numba is left for :func:`compiled` to
    report (at the first batch, where the error reaches the caller).
    """
    global _loaded
    if _loaded is not _UNDECIDED or _choice() != "auto":
        return
    _loaded = _LOADING
    generation = _generation

    def load() -> None:
        global _loaded
        try:
            module = _load("auto")
            if module is not None:
                module.warm_up()  # reads the compiled code from the cache (or compiles it)
        except Exception:  # noqa: BLE001  numba that cannot compile here: numpy does the work
            module = None
        if generation == _generation:
            _loaded = module

    threading.Thread(target=load, name="qcal-kernels", daemon=True).start()


def _choice() -> str:
    """``QCAL_KERNELS``, read once (every batch of every tensor asks)."""
    global _chosen
    if _chosen is None:
        _chosen = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    return _chosen


def active() -> str:
    """``"numba"`` or ``"numpy"``: the kernels in use now (decides if undecided)."""
    return "numpy" if compiled() is None else "numba"


def reset() -> None:
    """Forget the choice: the next batch reads ``QCAL_KERNELS`` again (for tests)."""
    global _loaded, _generation, _chosen
    _loaded, _chosen = _UNDECIDED, None
    _generation += 1


def _load(choice: str) -> ModuleType | None:
    if choice not in _CHOICES:
        raise ConfigError(
            f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}"
        )
    if choice == "numpy":
        return None
    try:
        from qcal.numerics.kernels import _compiled
    except ImportError:
        if choice == "numba":
            raise ConfigError(
                f"{KERNELS_ENV}=numba needs numba: pip install 'qcal[fast]'"
            ) from None
        return None
    return _compiled
