"""Writing models: whole or not at all, inline or with their large tensors in one external file.

A protobuf cannot exceed 2 GiB, so a large model is written as two files: ``<name>`` (the graph,
small) and ``<name>.data`` beside it, holding every initializer of at least
`EXTERNAL_TENSOR_MIN_BYTES` of the main graph, in graph order, each at an offset aligned to
`ALIGNMENT_BYTES` (initializers of If/Loop/Scan bodies stay inline). The layout and names depend only on the model, so the
same model gives the same two files.

Both files are first written under temporary names beside their targets; `StagedModel.commit`
renames the data file into place and then writes the model file, so a model file on disk always
has its data. The tensors' bytes are written one at a time straight from the model being saved,
which is only read, or copied a chunk at a time from the files of tensors kept in files (see
`qcal.graph.files.large`): memory stays at about one copy of the model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx

from qcal.graph.files.atomic import StagedFile, write_atomic
from qcal.graph.files.large import (
    external_file,
    has_external_data,
    is_external,
    light_copy,
    read_external,
    serialize_within,
    serialized_size,
    weight_bytes,
)
from qcal.numerics.errors import OutputError

__all__ = [
    "ALIGNMENT_BYTES",
    "EXTERNAL_DATA_THRESHOLD_BYTES",
    "EXTERNAL_TENSOR_MIN_BYTES",
    "ExternalFile",
    "StagedModel",
    "data_path",
    "needs_external_data",
    "stage_model",
    "weights_in_files",
]

EXTERNAL_DATA_THRESHOLD_BYTES = 2**30
"""Models whose serialized size exceeds this are written with external data (the protobuf
limit is 2 GiB; the margin leaves room for what onnxruntime and onnx add when they load)."""
EXTERNAL_TENSOR_MIN_BYTES = 1024
"""Initializers at least this large go to the external data file; smaller ones stay inline."""
ALIGNMENT_BYTES = 4096
"""Offsets of tensors in the data file are multiples of this (onnxruntime can map them)."""
WEIGHTS_IN_FILES_BYTES = 64 << 20
"""Float weights above which a model is calibrated with them in files even where memory would
hold it whole: onnxruntime maps them instead of copying them into every session qcal builds
(one for statistics, one for the quantized model, one per check), and each copy peaked at
several times the weights while its session was made. VGG11 (506 MB of weights): 4.5 GB at
peak held whole, 2.4 GB in files, and 38 s against 29 s; ResNet-50 (97 MB) 1.1 GB against
0.64 GB; a DenseNet of 31 MB 0.74 GB against 0.64 GB."""


@dataclass(frozen=True)
class ExternalFile:
    """The external data file written beside a model."""

    path: Path
    size_bytes: int
    sha256: str


def data_path(path: Path) -> Path:
    """Where the external data of the model written to `path` goes: ``<path>.data``."""
    return path.with_name(f"{path.name}.data")


def weights_in_files(model: onnx.ModelProto) -> bool:
    """Whether `model` is calibrated with its large weights in files (`WeightFile`): it has
    external data of its own, its weights take over `WEIGHTS_IN_FILES_BYTES`, or it is too
    large to write inline."""
    return (has_external_data(model) or weight_bytes(model) > WEIGHTS_IN_FILES_BYTES
            or needs_external_data(model))


def needs_external_data(model: onnx.ModelProto, *, threshold_bytes: int | None = None) -> bool:
    """Whether `model` is too large to write inline (threshold: `EXTERNAL_DATA_THRESHOLD_BYTES`),
    its weights kept in files while calibrating (`weights_in_files`) counted as written inline."""
    limit = EXTERNAL_DATA_THRESHOLD_BYTES if threshold_bytes is None else threshold_bytes
    in_files = sum(external_file(t)[2] for t in model.graph.initializer if is_external(t))
    return serialized_size(model) + in_files > limit


class StagedModel:
    """A model written under temporary names beside `path`, until `commit` or `discard`.

    Attributes:
        model_bytes: the bytes the model file will hold.
        external: the external data file (final path, size, sha256), None when inline.
    """

    def __init__(
        self,
        path: Path,
        model_bytes: bytes,
        external: ExternalFile | None,
        staged_data: Path | None,
    ) -> None:
        self.path = path
        self.model_bytes = model_bytes
        self.external = external
        self._data = (StagedFile(external.path, staged_data)
                      if external is not None and staged_data is not None else None)

    def commit(self) -> None:
        """Rename the data file into place, then write the model file (atomically)."""
        if self._data is not None:
            self._data.commit()
        try:
            write_atomic(self.path, self.model_bytes)
        except BaseException:
            if self.external is not None:  # a data file without its model is no output
                self.external.path.unlink(missing_ok=True)
            raise

    def remove_committed(self) -> None:
        """Remove the committed files again (an output written beside it failed)."""
        self.path.unlink(missing_ok=True)
        if self.external is not None:
            self.external.path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove what was staged (nothing was written under the final names)."""
        if self._data is not None:
            self._data.discard()

    def __enter__(self) -> StagedModel:  # noqa: PYI034  (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def stage_model(
    model: onnx.ModelProto,
    path: Path,
    *,
    external: bool,
) -> StagedModel:
    """Stage `model` for writing to `path`; with `external`, its large tensors go to
    ``<path>.data`` (written now under a temporary name). `model` is left unchanged.

    Raises:
        OutputError: the model is too large to write inline, or its data file cannot be written.
    """
    if not external:
        data = None if has_external_data(model) else serialize_within(model, 2**31 - 1)
        if data is None:
            raise OutputError(
                f"output {path}: the model is over 2 GiB or has weights in files; "
                "write it with external data"
            )
        return StagedModel(path, data, None, None)
    target = data_path(path)
    fd, staged = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=path.resolve().parent
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            light, size, digest = _write_tensors(model, fh, target.name)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(staged, 0o666 & ~_umask())
        model_bytes = light.SerializeToString()
    except OSError as err:
        Path(staged).unlink(missing_ok=True)
        raise OutputError(
            f"output {target}: cannot write external data ({err.strerror or err})"
        ) from None
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise
    return StagedModel(path, model_bytes, ExternalFile(target, size, digest), Path(staged))


def _write_tensors(
    model: onnx.ModelProto,
    fh: BinaryIO,
    location: str,
) -> tuple[onnx.ModelProto, int, str]:
    """Write the large initializers' bytes to `fh`; return a copy of `model` referring to them."""
    light, detached = light_copy(model, min_bytes=EXTERNAL_TENSOR_MIN_BYTES)
    digest = hashlib.sha256()
    offset = 0
    for tensor, copy in zip(model.graph.initializer, light.graph.initializer):
        if is_external(tensor):
            chunks: Iterable[bytes] = read_external(tensor)
        elif tensor.name in detached:
            chunks = (tensor.raw_data,)  # one tensor's bytes at a time
        else:
            continue
        padding = b"\0" * ((-offset) % ALIGNMENT_BYTES)
        fh.write(padding)
        digest.update(padding)
        offset += len(padding)
        length = 0
        for chunk in chunks:
            fh.write(chunk)
            digest.update(chunk)
            length += len(chunk)
        del chunks
        copy.data_location = onnx.TensorProto.EXTERNAL
        del copy.external_data[:]
        for key, value in (
            ("location", location),
            ("offset", str(offset)),
            ("length", str(length)),
        ):
            entry = copy.external_data.add()
            entry.key, entry.value = key, value
        offset += length
    return light, offset, digest.hexdigest()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
