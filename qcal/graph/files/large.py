"""Models of any size: onnx's C++ tools on them, and large weights kept in files.

onnx's tools (version converter, shape inference) take the model as one serialized protobuf,
which cannot exceed 2 GiB. For a model near that limit, the bytes of its large initializers are
lifted out while the tool runs (the tools only need their names, types and shapes) and put back
afterwards, so memory stays close to one copy of the weights.

A large model is calibrated with the bytes of its large main-graph initializers in files, not
in memory: such a tensor has ``data_location`` EXTERNAL and an absolute ``location`` (its
offset and length as usual). The files are the model's own external data (see
`qcal.graph.files.load.load_model`) or a `WeightFile` written while calibrating. onnxruntime maps them
(`qcal.calibration.runtime.create_session`), the output writer copies them (`qcal.graph.files.save`), and
`tensor_array` reads one when its values are needed. Nothing else reads them: the model held
in memory stays small, and each weight is in memory at most once.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor  # type: ignore[import-untyped]
from google.protobuf.message import EncodeError, Message  # type: ignore[import-untyped]

from qcal.numerics.errors import ModelError, OutputError

__all__ = [
    "SERIALIZE_LIMIT_BYTES",
    "WeightFile",
    "external_file",
    "has_external_data",
    "is_external",
    "light_copy",
    "load_external_data",
    "read_external",
    "refer_to_file",
    "run_detached",
    "serialize_within",
    "serialized_size",
    "tensor_array",
]

# Serialized protobufs are limited to 2 GiB; keep a margin for what the tool adds.
SERIALIZE_LIMIT_BYTES = 2**31 - 1 - 64 * 2**20
DETACH_MIN_BYTES = 2**20  # only tensors this large are lifted out: small ones may be shape data


def serialized_size(message: Message) -> int:
    """`message.ByteSize()`, or 2**31 when the message is too large to serialize (protobuf
    raises instead of answering then).

    It costs as much as serializing (protobuf encodes the message to count its bytes): where
    the bytes are wanted too, `serialize_within` gives both for the price of one.
    """
    try:
        return int(message.ByteSize())
    except EncodeError:
        return 2**31


def serialize_within(message: Message, limit: int) -> bytes | None:
    """`message.SerializeToString()`, or None when that is over `limit` bytes or too large
    for protobuf to serialize."""
    try:
        data: bytes = message.SerializeToString()
    except EncodeError:
        return None
    return data if len(data) <= limit else None


def run_detached(
    model: onnx.ModelProto,
    tool: Callable[[onnx.ModelProto | bytes], onnx.ModelProto],
    *,
    what: str,
    reattach: bool = True,
) -> onnx.ModelProto:
    """`tool(model)`, the tool getting a copy of the model without the raw data of its large
    initializers (it reads only their names, types and shapes), the data re-attached to the
    tool's result by initializer name (unless `reattach` is False: the caller only reads types
    and shapes from the result). A model over 2 GiB cannot be serialized whole for onnx's C++
    tools at all, and a smaller one costs four copies of its weights so (the bytes, the tool's
    model, its result's bytes, its result): a 437 MB BERT-base took 2.2 GB to prepare.

    `model` itself is never changed.
    """
    if not any(_detachable(t, DETACH_MIN_BYTES) for t in model.graph.initializer):
        return tool(model.SerializeToString())  # onnx's C++ tools take bytes: serialized once
    light, detached = light_copy(model, min_bytes=DETACH_MIN_BYTES)
    result = tool(light)
    if not reattach:
        return result
    originals = {t.name: t for t in model.graph.initializer if t.name in detached}
    for tensor in result.graph.initializer:
        if tensor.name in originals and not tensor.HasField("raw_data"):
            tensor.raw_data = originals.pop(tensor.name).raw_data
    if originals:
        lost = ", ".join(sorted(originals)[:3])
        raise ModelError(f"{what} dropped or changed large initializers: {lost}")
    return result


def light_copy(
    model: onnx.ModelProto, *, min_bytes: int, names: Collection[str] | None = None
) -> tuple[onnx.ModelProto, set[str]]:
    """A copy of `model` without the raw data of its main graph's initializers of at least
    `min_bytes` (among `names`, when given), and their names. `model` is only read: protobuf
    keeps the memory of cleared fields until the whole message goes, so detaching and restoring
    would cost a copy too.
    """
    light = onnx.ModelProto()
    for field, value in model.ListFields():  # message fields come as views, not copies
        if field.name != "graph":
            _copy_field(light, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(light.graph, field, value)
    detached: set[str] = set()
    for tensor in model.graph.initializer:
        copy = light.graph.initializer.add()
        if not ((names is None or tensor.name in names) and _detachable(tensor, min_bytes)):
            copy.CopyFrom(tensor)
            continue
        for field in tensor.DESCRIPTOR.fields:  # never reads raw_data (a copy of the bytes)
            if field.name == "raw_data":
                continue
            if _is_repeated(field):
                getattr(copy, field.name).extend(getattr(tensor, field.name))
            elif not field.has_presence or tensor.HasField(field.name):
                _copy_field(copy, field, getattr(tensor, field.name))
        detached.add(tensor.name)
    return light, detached


def _detachable(tensor: onnx.TensorProto, min_bytes: int) -> bool:
    """Whether `light_copy` leaves out `tensor`'s bytes: raw data of at least `min_bytes`."""
    return bool(tensor.HasField("raw_data") and tensor.ByteSize() >= min_bytes)


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; `label` before
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def _copy_field(target: Message, field: FieldDescriptor, value: object) -> None:
    if _is_repeated(field):
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


# ------------------------------------------------------------------ large weights kept in files

_ALIGNMENT_BYTES = 4096  # offsets onnxruntime can map (it copies tensors at other offsets)
_READ_CHUNK_BYTES = 2**24
_SUB_BYTE_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
)


def is_external(tensor: onnx.TensorProto) -> bool:
    """Whether `tensor`'s data is in a file rather than in the message."""
    return tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL


def external_file(tensor: onnx.TensorProto) -> tuple[Path, int, int]:
    """(absolute path, offset, length) of the data of a tensor kept in a file."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    path = Path(entries.get("location", ""))
    if not path.is_absolute():
        raise ModelError(f"tensor {tensor.name!r}: its external data is not located by an absolute path")
    offset = int(entries.get("offset", "0"))
    length = int(entries["length"]) if "length" in entries else path.stat().st_size - offset
    return path, offset, length


def refer_to_file(tensor: onnx.TensorProto, path: Path, offset: int, length: int) -> None:
    """Make `tensor` refer to `length` bytes of the file at absolute `path`, from `offset`."""
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", str(path)), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def has_external_data(model: onnx.ModelProto) -> bool:
    """Whether some initializer of the main graph of `model` has its data in a file."""
    return any(is_external(tensor) for tensor in model.graph.initializer)


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initializers, those in files counted by their length."""
    return sum(external_file(t)[2] if is_external(t) else t.ByteSize()
               for t in model.graph.initializer)


def read_external(tensor: onnx.TensorProto, chunk_bytes: int = _READ_CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of a tensor kept in a file, `chunk_bytes` at a time."""
    path, offset, length = external_file(tensor)
    with path.open("rb") as fh:
        fh.seek(offset)
        while length > 0:
            chunk = fh.read(min(chunk_bytes, length))
            if not chunk:
                raise ModelError(f"tensor {tensor.name!r}: {path} is shorter than its data")
            length -= len(chunk)
            yield chunk


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """`onnx.numpy_helper.to_array`, also for a tensor kept in a file (read from it)."""
    if not is_external(tensor):
        return onnx.numpy_helper.to_array(tensor)
    path, offset, length = external_file(tensor)
    shape = tuple(tensor.dims)
    if tensor.data_type in _SUB_BYTE_TYPES:  # packed two (or four) codes a byte: onnx unpacks
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = onnx.TensorProto.DEFAULT
        inline.raw_data = b"".join(read_external(tensor))
        return onnx.numpy_helper.to_array(inline)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != length:
        raise ModelError(
            f"tensor {tensor.name!r}: {length} bytes of external data for {count} {dtype} values"
        )
    array = np.fromfile(path, dtype=dtype, count=count, offset=offset)
    if array.size != count:
        raise ModelError(f"tensor {tensor.name!r}: {path} is shorter than its data")
    return array.reshape(shape)


def load_external_data(model: onnx.ModelProto) -> None:
    """Read the data of the main graph's initializers kept in files into `model` itself."""
    for tensor in model.graph.initializer:
        if is_external(tensor):
            data = b"".join(read_external(tensor))
            del tensor.external_data[:]
            tensor.ClearField("data_location")  # as if it had never left
            tensor.raw_data = data
            del data


class WeightFile:
    """A temporary folder for the bytes of large initializers moved out of memory.

    The folder goes with `close` (or, failing that, when the object is collected).
    """

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="qcal-weights-"))
        self._files = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)

    def offload(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of `model` whose main-graph initializers of at least `DETACH_MIN_BYTES` held
        in memory are written to a new file of the folder, and referred to there. `model` is
        only read (its memory goes when the caller drops it); the copy is `model` itself when
        nothing is that large."""
        light, detached = light_copy(model, min_bytes=DETACH_MIN_BYTES)
        if not detached:
            return model
        self._files += 1
        path = self.folder / f"weights-{self._files}.bin"
        offset = 0
        try:
            with path.open("wb") as fh:
                for tensor, copy in zip(model.graph.initializer, light.graph.initializer):
                    if tensor.name not in detached:
                        continue
                    data = tensor.raw_data  # one tensor's bytes at a time
                    padding = (-offset) % _ALIGNMENT_BYTES
                    fh.write(b"\0" * padding)
                    offset += padding
                    fh.write(data)
                    refer_to_file(copy, path, offset, len(data))
                    offset += len(data)
                    del data
        except OSError as err:
            raise OutputError(
                f"{path}: cannot write weights out of memory ({err.strerror or err})"
            ) from None
        return light

    def close(self) -> None:
        """Remove the folder and its files."""
        self._cleanup()
