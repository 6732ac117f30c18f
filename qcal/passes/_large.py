"""Run onnx's C++ tools (version converter, shape inference) on models of any size.

Those tools take the model as one serialized protobuf, which cannot exceed 2 GiB. For a model
near that limit, the bytes of its large initializers are lifted out while the tool runs (the
tools only need their names, types and shapes) and put back afterwards, so memory stays close
to one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx
from google.protobuf.descriptor import FieldDescriptor  # type: ignore[import-untyped]
from google.protobuf.message import EncodeError, Message  # type: ignore[import-untyped]

from qcal.errors import ModelError

__all__ = ["SERIALIZE_LIMIT_BYTES", "light_copy", "run_detached", "serialized_size"]

# Serialized protobufs are limited to 2 GiB; keep a margin for what the tool adds.
SERIALIZE_LIMIT_BYTES = 2**31 - 1 - 64 * 2**20
DETACH_MIN_BYTES = 2**20  # only tensors this large are lifted out: small ones may be shape data


def serialized_size(message: Message) -> int:
    """`message.ByteSize()`, or 2**31 when the message is too large to serialize (protobuf
    raises instead of answering then)."""
    try:
        return int(message.ByteSize())
    except EncodeError:
        return 2**31


def run_detached(
    model: onnx.ModelProto,
    tool: Callable[[onnx.ModelProto], onnx.ModelProto],
    *,
    what: str,
    reattach: bool = True,
) -> onnx.ModelProto:
    """`tool(model)`; when the model is too large to serialize, the tool gets a copy without
    the raw data of large initializers, and the data is re-attached to the tool's result by
    initializer name (unless `reattach` is False: the caller only reads types and shapes from
    the result).

    `model` itself is never changed.
    """
    if serialized_size(model) <= SERIALIZE_LIMIT_BYTES:
        return tool(model)
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
        wanted = names is None or tensor.name in names
        if not (wanted and tensor.HasField("raw_data") and tensor.ByteSize() >= min_bytes):
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
