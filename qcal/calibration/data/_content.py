"""Samples by their content: what picks the same samples whatever order the data comes in.

A run that holds samples out of calibration to check the quantized model on, or measures
sensitivity on a few samples, must not pick them by position: the same data in another order
(another file listing, a shuffled export) would then calibrate on other samples and write
another model. `content_order` ranks the samples by the SHA-256 of their content, an order that
depends on the samples alone (samples holding NaN or infinite values last: the calibration's
checks judge those, an evaluation cannot), and `SampleSubset` serves the samples at chosen
positions, in the order chosen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcal.calibration.data._validate import find_nonfinite
from qcal.calibration.runtime import Feed

__all__ = ["ContentOrder", "SampleSubset", "content_order", "name_samples", "sample_digest"]


def sample_digest(feed: Mapping[str, np.ndarray]) -> int:
    """The SHA-256 of one sample, as an integer: its inputs in name order, each as name, dtype,
    shape and little-endian C-order bytes."""
    digest = hashlib.sha256()
    for name in sorted(feed):
        array = np.asarray(feed[name])
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        digest.update(name.encode() + b"\0" + data.dtype.str.encode() + b"\0")
        digest.update(repr(tuple(int(d) for d in data.shape)).encode() + b"\0")
        digest.update(data.tobytes())
    return int.from_bytes(digest.digest(), "big")


@dataclass(frozen=True)
class ContentOrder:
    """A source's sample positions ranked by content: those whose numbers are all finite first,
    each part by digest (then position).

    Attributes:
        positions: the ranking.
        finite: how many samples hold no NaN or infinite value (the first `finite` positions).
        sizes: each sample's count of input values, by position.
        leading: the first samples of the ranking themselves (as many as asked for), so that
            the checks that run on a few samples need not read the data again.
    """

    positions: list[int]
    finite: int
    sizes: list[int]
    leading: tuple[Feed, ...]


def content_order(source: Any, keep: int = 0) -> ContentOrder:
    """The positions of `source`'s samples ordered by their digests, samples holding NaN or
    infinite values last, with the first `keep` samples of that order (one pass over the data;
    beyond those, nothing is kept but a digest, a flag and a size per sample). Samples of equal
    digests are equal, so whichever of them a prefix of this order takes, it takes the same
    contents."""
    keys: list[tuple[bool, int, int]] = []
    sizes: list[int] = []
    kept: list[tuple[tuple[bool, int, int], Feed]] = []  # the `keep` smallest keys so far
    for position, sample in enumerate(source.samples()):
        key = (bool(find_nonfinite(sample)), sample_digest(sample), position)
        keys.append(key)
        sizes.append(sum(int(np.size(value)) for value in sample.values()))
        if keep:
            kept.append((key, sample))
            kept.sort(key=lambda entry: entry[0])
            del kept[keep:]
    positions = sorted(range(len(keys)), key=keys.__getitem__)
    return ContentOrder(positions, sum(1 for nonfinite, _, _ in keys if not nonfinite), sizes,
                        tuple(sample for _, sample in kept))


class SampleSubset:
    """The samples of `source` at `positions`, in the order of `positions`.

    The source is read once per `samples()` call, up to the last position wanted; a sample read
    before its turn is held until then, so positions in ascending order hold nothing and any
    order holds at most the subset."""

    def __init__(self, source: Any, positions: Sequence[int]) -> None:
        self.kind, self.path, self.is_synthetic = source.kind, source.path, source.is_synthetic
        self._source, self.positions = source, tuple(positions)

    def num_samples(self) -> int:
        return len(self.positions)

    def samples(self) -> Iterator[Feed]:
        if not self.positions:
            return
        turn = {position: k for k, position in enumerate(self.positions)}
        waiting: dict[int, Feed] = {}
        given = 0
        for position, sample in enumerate(self._source.samples()):
            k = turn.get(position)
            if k is None:
                continue
            waiting[k] = sample
            while given in waiting:
                yield waiting.pop(given)
                given += 1
            if given == len(self.positions):
                return


def name_samples(source: Any, first: int, n: int) -> str:
    """The `n` samples from the `first` that `source` gave, as an error names them: 0-based
    positions in the data the user gave (a `SampleSubset` maps its own count to those)."""
    positions = (source.positions[first:first + n] if isinstance(source, SampleSubset)
                 else range(first, first + n))
    if len(positions) <= 1:
        return f"sample {positions[0] if positions else first}"
    if list(positions) == list(range(positions[0], positions[0] + len(positions))):
        return f"samples {positions[0]}-{positions[-1]}"
    return "samples " + ", ".join(str(p) for p in positions)
