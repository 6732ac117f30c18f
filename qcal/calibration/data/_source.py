"""What every calibration data source shares: the sample type, the `DataSource` protocol, the
header-only description of samples (`SampleLayout`), and the helpers every reader uses to match
its arrays to the model inputs and to word its errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from qcal.calibration.runtime import Feed
from qcal.numerics.errors import DataError, one_line

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec


class DataSource(Protocol):
    """Calibration samples, streamed; `samples()` starts afresh on every call."""

    kind: str  # "npz" | "npz-dir" | "onnx-test-data" | "synthetic"
    path: Path | None
    is_synthetic: bool

    def num_samples(self) -> int | None:
        """Number of samples `samples()` yields (after the limit), or None if unknown."""
        ...

    def samples(self) -> Iterator[Feed]:
        """A fresh iterator over the samples, one full model feed each."""
        ...


@dataclass(frozen=True)
class ArrayInfo:
    """Where one input of a sample comes from, and its dtype and shape as fed to the model."""

    origin: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SampleLayout:
    """The arrays of one sample (or of every sample of an .npz file), known from headers only."""

    origin: str
    arrays: Mapping[str, ArrayInfo]


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    native: np.dtype[Any] = dtype.newbyteorder("=")
    return native


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _check_names(origin: str, keys: Iterable[str], inputs: Sequence[InputSpec]) -> None:
    """Raise DataError if the data's names are not exactly the model's input names."""
    found = set(keys)
    expected = [spec.name for spec in inputs]
    missing = [name for name in expected if name not in found]
    extra = sorted(found.difference(expected))
    if not missing and not extra:
        return
    problems = []
    if missing:
        problems.append(f"missing input{'s' if len(missing) > 1 else ''} {_quoted(missing)}")
    if extra:
        verb = "is not a model input" if len(extra) == 1 else "are not model inputs"
        problems.append(f"{_quoted(extra)} {verb}")
    raise DataError(f"{origin}: {'; '.join(problems)} (model inputs: {_quoted(expected)})")


def _shape_str(spec: InputSpec) -> str:
    dims = ["?" if d is None else str(d) for d in spec.shape]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _visible(folder: Path) -> list[Path]:
    try:
        return sorted(
            (p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.name
        )
    except OSError as err:
        raise DataError(f"{folder}: cannot list folder ({one_line(err)})") from None
