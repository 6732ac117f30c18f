"""A sample's content as one number: what tells samples apart whatever order the data comes in."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

__all__ = ["sample_digest"]


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
