"""An order-invariant fingerprint of calibration samples, and sources that take it as they read.

Each sample (one model feed) is hashed on its own: SHA-256 of its inputs in name order, each as
name, dtype, shape and little-endian C-order bytes. The fingerprint is the sum of these digests,
read as 256-bit integers, modulo 2**256, with the sample count beside it. A sum does not depend on
the order of its terms, and the fingerprint of disjoint shards added together is the fingerprint
of their union: the data of a merged file and of one run over all of it have the same one. Unlike
an XOR, a sample seen twice is not cancelled. It tells data sets apart by accident, not against
someone crafting a collision.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from qcal.calibration.data._content import sample_digest

__all__ = ["SCHEME", "Fingerprint", "FingerprintedSource"]

SCHEME = "sum-sha256-v1"
_MODULUS = 1 << 256


class Fingerprint:
    """A running fingerprint: `add` samples, `merge` another's, `hex` for the file."""

    def __init__(self, total: int = 0, samples: int = 0) -> None:
        self.total = total % _MODULUS
        self.samples = samples

    def add(self, feed: Mapping[str, np.ndarray]) -> None:
        self.total = (self.total + sample_digest(feed)) % _MODULUS
        self.samples += 1

    def merge(self, other: Fingerprint) -> None:
        self.total = (self.total + other.total) % _MODULUS
        self.samples += other.samples

    def hex(self) -> str:
        return f"{self.total:064x}"

    @classmethod
    def from_hex(cls, text: str, samples: int) -> Fingerprint:
        return cls(int(text, 16), samples)


class FingerprintedSource:
    """Samples [start, stop) of `source`, read once in order, each added to `fingerprint`.

    `take(n)` hands out the next n samples as a source of their own (the chunks a collection
    with checkpoints runs one after the other) without reading the data again from its start.
    """

    def __init__(self, source: Any, start: int = 0, stop: int | None = None) -> None:
        self.kind, self.path, self.is_synthetic = source.kind, source.path, source.is_synthetic
        total = source.num_samples()
        self._count = None if total is None else max(0, (total if stop is None
                                                         else min(stop, total)) - start)
        self._samples = islice(source.samples(), start, stop)
        self._next: dict[str, np.ndarray] | None = None  # read ahead by `exhausted`
        self.fingerprint = Fingerprint()

    def num_samples(self) -> int | None:
        return self._count

    def take(self, n: int | None) -> _Chunk:
        return _Chunk(self, n)

    def exhausted(self) -> bool:
        """Whether every sample was handed out (reads one ahead to know)."""
        if self._next is None:
            self._next = next(self._samples, None)
        return self._next is None

    def _read(self, n: int | None) -> Iterator[dict[str, np.ndarray]]:
        given = 0
        while n is None or given < n:
            sample, self._next = self._next, None
            if sample is None:
                sample = next(self._samples, None)
                if sample is None:
                    return
            self.fingerprint.add(sample)
            given += 1
            yield sample


class _Chunk:
    """The next `n` samples of a FingerprintedSource (all that are left when n is None)."""

    def __init__(self, parent: FingerprintedSource, n: int | None) -> None:
        self.kind, self.path, self.is_synthetic = parent.kind, parent.path, parent.is_synthetic
        self._parent, self._n = parent, n

    def num_samples(self) -> int | None:
        return self._n

    def samples(self) -> Iterator[dict[str, np.ndarray]]:
        return self._parent._read(self._n)
