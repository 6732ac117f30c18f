"""Run onnx's C++ tools (version converter, shape inference) on models of any size.

Those tools take the model as one serialized protobuf, which cannot exceed 2 GiB. For a model
near that limit, the bytes of its large initializers are lifted out while the tool runs (the
tools only need their names, types and shapes) and put back afterwards, so memory stays close
to one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from qcal.errors import ModelError

__all__ = ["run_detached"]

# Serialized protobufs are limited to 2 GiB; keep a margin for what the tool adds.
SERIALIZE_LIMIT_BYTES = 2**31 - 1 - 64 * 2**20
DETACH_MIN_BYTES = 2**20  # only tensors this large are lifted out: small ones may be shape data


def run_detached(
    model: onnx.ModelProto,
    tool: Callable[[onnx.ModelProto], onnx.ModelProto],
    *,
    what: str,
    reattach: bool = True,
) -> onnx.ModelProto:
    """`tool(model)`, with the raw data of large initializers detached when the model is too
    large to serialize; the data is re-attached to the tool's result by initializer name
    (unless `reattach` is False: the caller only reads types and shapes from the result).

    `model` itself is left as it was (its data is restored even when the tool fails).
    """
    if model.ByteSize() <= SERIALIZE_LIMIT_BYTES:
        return tool(model)
    stash: dict[str, bytes] = {}
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data") and len(tensor.raw_data) >= DETACH_MIN_BYTES:
            stash[tensor.name] = tensor.raw_data
            tensor.ClearField("raw_data")
    try:
        result = tool(model)
    finally:
        for tensor in model.graph.initializer:
            if tensor.name in stash:
                tensor.raw_data = stash[tensor.name]
    if result is model or not reattach:
        return result
    for tensor in result.graph.initializer:
        if tensor.name in stash and not tensor.HasField("raw_data"):
            tensor.raw_data = stash.pop(tensor.name)
    if stash:
        lost = ", ".join(sorted(stash)[:3])
        raise ModelError(f"{what} dropped or changed large initializers: {lost}")
    return result
