"""Collected statistics as a value: the header (model, plan, data, providers) and the observers
of every tensor; to and from the file's bytes, and the exact merge of disjoint collections."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qcal.calibration.statistics._fingerprint import SCHEME, Fingerprint
from qcal.calibration.statistics._format import FORMAT, VERSION, decode, encode, read_file
from qcal.calibration.statistics._observers import (
    decode_observers,
    encode_observers,
    merge_observers,
)
from qcal.numerics.errors import StatisticsError
from qcal.numerics.observers import Observer

__all__ = ["Statistics", "merge_statistics", "read_statistics"]


@dataclass
class Statistics:
    """What one collection (or a merge of several) gathered.

    Attributes:
        model_sha256: SHA-256 of the model file the statistics were collected on.
        plan: the options that decide which tensors are observed and how (JSON).
        fingerprint: the data's order-invariant fingerprint; its `samples` is the sample count.
        providers: the onnxruntime execution providers the model ran with.
        observers: per tensor, its observers keyed by the range methods they serve.
        complete: False for a checkpoint of a collection still under way.
    """

    model_sha256: str
    plan: dict[str, Any]
    fingerprint: Fingerprint
    providers: tuple[str, ...]
    observers: dict[str, dict[str, Observer]]
    synthetic: bool = False
    complete: bool = True

    @property
    def samples(self) -> int:
        return self.fingerprint.samples

    def header(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        tensors = [
            {"name": name, "observers": encode_observers(str(i), self.observers[name], arrays)}
            for i, name in enumerate(sorted(self.observers))
        ]
        return {
            "format": FORMAT,
            "version": VERSION,
            "complete": self.complete,
            "model": {"sha256": self.model_sha256},
            "plan": self.plan,
            "data": {"samples": self.samples, "synthetic": self.synthetic,
                     "fingerprint": {"scheme": SCHEME, "value": self.fingerprint.hex()}},
            "providers": list(self.providers),
            "tensors": tensors,
        }

    def to_bytes(self) -> bytes:
        arrays: dict[str, np.ndarray] = {}
        header = self.header(arrays)
        return encode(header, arrays)

    @classmethod
    def from_bytes(cls, data: bytes, origin: str) -> Statistics:
        header, arrays = decode(data, origin)
        return _from_parts(header, arrays, origin)


def _from_parts(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], origin: str) -> Statistics:
    fingerprint = header["data"].get("fingerprint")
    if not (isinstance(fingerprint, dict) and fingerprint.get("scheme") == SCHEME
            and isinstance(fingerprint.get("value"), str)):
        raise StatisticsError(f"{origin}: malformed statistics header: data.fingerprint")
    try:
        print_ = Fingerprint.from_hex(fingerprint["value"], header["data"]["samples"])
    except ValueError:
        raise StatisticsError(f"{origin}: malformed statistics header: data.fingerprint") from None
    observers = {
        entry["name"]: decode_observers(entry["observers"], arrays, f"{origin}: tensor "
                                                                    f"{entry['name']!r}")
        for entry in header["tensors"]
    }
    return Statistics(
        model_sha256=header["model"]["sha256"], plan=dict(header["plan"]), fingerprint=print_,
        providers=tuple(str(p) for p in header["providers"]), observers=observers,
        synthetic=bool(header["data"].get("synthetic", False)), complete=header["complete"],
    )


def read_statistics(path: Path) -> Statistics:
    """The statistics file at `path`.

    Raises:
        StatisticsError: missing, unreadable, malformed or of another format version.
    """
    header, arrays = read_file(path)
    return _from_parts(header, arrays, str(path))


def merge_statistics(parts: Sequence[tuple[str, Statistics]]) -> Statistics:
    """The statistics of all the parts' data, exactly as one collection over it would hold them.

    Raises:
        StatisticsError: fewer than one part, unfinished parts, other models, plans or providers,
            or observers whose result depends on the order of the batches.
    """
    if not parts:
        raise StatisticsError("nothing to merge")
    first_name, first = parts[0]
    merged = copy.deepcopy(first)
    for name, part in parts:
        if not part.complete:
            raise StatisticsError(f"{name}: an unfinished collection (a checkpoint); finish it "
                                  "with qcal collect --checkpoint before merging")
    for name, part in parts[1:]:
        where = f"{name} and {first_name}"
        if part.model_sha256 != first.model_sha256:
            raise StatisticsError(f"{where}: collected on different models "
                                  f"(sha256 {part.model_sha256[:12]}... and "
                                  f"{first.model_sha256[:12]}...)")
        if part.plan != first.plan:
            keys = sorted(k for k in {*part.plan, *first.plan} if part.plan.get(k) != first.plan.get(k))
            raise StatisticsError(f"{where}: collected with different options "
                                  f"({', '.join(keys)})")
        if part.providers != first.providers:
            raise StatisticsError(f"{where}: collected with different execution providers "
                                  f"({', '.join(part.providers)} / {', '.join(first.providers)})")
        if set(part.observers) != set(merged.observers):
            raise StatisticsError(f"{where}: observe different tensors")
        for tensor, observers in merged.observers.items():
            merge_observers(observers, part.observers[tensor], f"{where}: tensor {tensor!r}")
        merged.fingerprint.merge(part.fingerprint)
        merged.synthetic = merged.synthetic or part.synthetic
    return merged
