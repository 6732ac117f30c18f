"""Batching: joins consecutive samples of a source along the model's dim 0 into feeds of up to
a batch size, when the model's inputs allow it and the samples agree on their other dims.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from qcal.calibration.data._source import DataSource
from qcal.calibration.runtime import Feed
from qcal.numerics.errors import ConfigError

if TYPE_CHECKING:
    from qcal.graph.model import InputSpec


def unjoinable_input(inputs: Sequence[InputSpec]) -> str | None:
    """Why samples cannot be joined along the model's dim 0: the first input whose dim 0 is
    fixed or that has none, described (None: every input's dim 0 is symbolic or unknown)."""
    for spec in inputs:
        if not spec.shape:
            return f"input {spec.name!r} has no dimension to join samples along (rank 0)"
        if isinstance(spec.shape[0], int):
            return f"input {spec.name!r} has a fixed first dimension ({spec.shape[0]})"
    return None


def _joinable(first: Feed, sample: Feed) -> bool:
    return first.keys() == sample.keys() and all(
        a.ndim >= 1 and a.dtype == sample[k].dtype and a.shape[1:] == sample[k].shape[1:]
        for k, a in first.items()
    )


def _join(pending: list[Feed]) -> Feed:
    if len(pending) == 1:
        return pending[0]
    return {k: np.concatenate([s[k] for s in pending], axis=0) for k in pending[0]}


def iter_batches(
    source: DataSource, inputs: Sequence[InputSpec], batch_size: int
) -> Iterator[tuple[Feed, int]]:
    """Yield (feed, number of samples in it), joining up to `batch_size` samples along axis 0.

    Samples are joined (concatenated on the model's dim 0) only when every model input has a
    symbolic or unknown dim 0; otherwise each sample is its own batch. Consecutive samples whose
    other dims or dtypes differ are not joined: the batch so far is yielded and a new one starts,
    so varying shapes give smaller batches, never an error. Order is the data order.

    Raises:
        ConfigError: batch_size below 1.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    return _batches(source, batch_size if unjoinable_input(inputs) is None else 1)


def _batches(source: DataSource, batch_size: int) -> Iterator[tuple[Feed, int]]:
    pending: list[Feed] = []
    for sample in source.samples():
        if pending and not _joinable(pending[0], sample):
            batch, n, pending = _join(pending), len(pending), []
            yield batch, n
            del batch
        pending.append(sample)
        del sample  # only `pending` may hold it, so it goes when the batch is yielded
        if len(pending) == batch_size:
            batch, n, pending = _join(pending), len(pending), []
            yield batch, n
            del batch
    if pending:
        yield _join(pending), len(pending)
