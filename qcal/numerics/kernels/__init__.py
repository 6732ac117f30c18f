"""Which kernels compute the statistics of a batch: compiled (numba) or numpy.

The numpy code in :mod:`qcal.numerics.observers` and :mod:`qcal.numerics.histogram` is the
reference. With the ``qcal[fast]`` extra installed (numba), the hot loops (histogram counting,
min/max with NaN detection, per-channel reductions) run as compiled kernels instead: one pass
over each batch, without holding the GIL, so they overlap with onnxruntime's run of the next
batch. They give the same statistics bit for bit: counts are integers, and min/max of float32
values are exact whatever the order of the comparisons.

The environment variable ``QCAL_KERNELS`` chooses: ``auto`` (the default: compiled when numba
imports), ``numpy`` (the reference path, for debugging and for comparing), ``numba`` (an error
when numba is missing). The choice is read once per process, at the first batch that could use
a kernel; numba is imported only then, so runs that need no kernel do not pay its import.
"""

from __future__ import annotations

import os
from types import ModuleType

from qcal.numerics.errors import ConfigError

__all__ = ["KERNELS_ENV", "active", "compiled", "reset"]

KERNELS_ENV = "QCAL_KERNELS"
_CHOICES = ("auto", "numpy", "numba")
_UNDECIDED = object()
_loaded: object = _UNDECIDED  # the compiled module, None for numpy, or _UNDECIDED


def compiled() -> ModuleType | None:
    """The compiled kernels (:mod:`qcal.numerics.kernels._compiled`), or None for numpy.

    Raises:
        ConfigError: ``QCAL_KERNELS`` holds an unknown value, or ``numba`` without numba.
    """
    global _loaded
    if _loaded is _UNDECIDED:
        _loaded = _load(os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto")
    return _loaded  # type: ignore[return-value]


def active() -> str:
    """``"numba"`` or ``"numpy"``: the kernels this process uses (decides if undecided)."""
    return "numpy" if compiled() is None else "numba"


def reset() -> None:
    """Forget the choice: the next batch reads ``QCAL_KERNELS`` again (for tests)."""
    global _loaded
    _loaded = _UNDECIDED


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
