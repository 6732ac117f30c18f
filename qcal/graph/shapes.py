"""What a graph states of its values' shapes: dimensions, ranks, and the shapes fully known for
a sample."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

__all__ = ["declared_rank", "known_dims", "static_shapes", "value_ranks"]


def known_dims(value: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    """The dimensions `value` states (None for one it leaves unknown), None without a shape."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return tuple(int(d.dim_value) if d.HasField("dim_value") else None
                 for d in tensor_type.shape.dim)


def value_dims(graph: onnx.GraphProto) -> dict[str, tuple[int | None, ...] | None]:
    """`known_dims` of every value the graph declares (outputs, inputs, value_info; a value
    declared twice takes its value_info's)."""
    return {v.name: known_dims(v) for v in (*graph.output, *graph.input, *graph.value_info)}


def declared_rank(value: onnx.ValueInfoProto) -> int | None:
    """The rank a tensor value states, None where it states no shape (or is no tensor)."""
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
        return None
    return len(tensor_type.shape.dim)


def value_ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """Ranks of the main graph's values known from value_info, inputs and outputs."""
    ranks: dict[str, int] = {}
    for info in (*graph.value_info, *graph.input, *graph.output):
        if (rank := declared_rank(info)) is not None:
            ranks[info.name] = rank
    return ranks


def static_shapes(
    graph: onnx.GraphProto, sample: Mapping[str, np.ndarray] | None
) -> dict[str, tuple[int, ...]]:
    """Fully known shapes from value_info and initializers, input symbols bound from `sample`."""
    symbols: dict[str, int] = {}
    if sample is not None:
        for value in graph.input:
            array = sample.get(value.name)
            input_dims = value.type.tensor_type.shape.dim
            if array is None or len(input_dims) != array.ndim:
                continue
            for dim, size in zip(input_dims, array.shape):
                if dim.HasField("dim_param"):
                    symbols.setdefault(dim.dim_param, int(size))
    shapes: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims: list[int] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value > 0:
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param") and dim.dim_param in symbols:
                dims.append(symbols[dim.dim_param])
            else:
                break
        else:
            shapes.setdefault(value.name, tuple(dims))
    if sample is not None:
        shapes.update({name: tuple(a.shape) for name, a in sample.items()})
    return shapes
