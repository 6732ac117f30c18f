"""Deterministic, collision-checked names for tensors and nodes a pass adds to a model.

A pass asks for a name built from a base (``conv1_out_quantized``); the allocator returns the
base itself when nobody uses it, else the first free ``<base>_<k>`` for k = 1, 2, ... . It knows
every name already in the model, including node and value names inside subgraphs and local
functions, so a new name never shadows an outer-scope value or collides with a node.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["NameAllocator", "add_initializer", "first_and_more", "model_names"]


def first_and_more(names: list[str]) -> str:
    """The first of `names` quoted, and how many more there are: "'conv1' and 3 more"."""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"{names[0]!r}{more}"


class NameAllocator:
    """Hands out names that no existing or previously allocated name uses.

    The result depends only on the taken names and the order of requests, so a pass that asks
    in sorted order gets identical names on every run.
    """

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self._taken: set[str] = set(taken)
        self._taken.discard("")  # "" means "optional input absent" in ONNX, never a name
        self._next_suffix: dict[str, int] = {}

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> NameAllocator:
        """An allocator that knows every tensor, initializer and node name in `model`."""
        return cls(model_names(model))

    def __contains__(self, name: object) -> bool:
        return name in self._taken

    def allocate(self, base: str) -> str:
        """Return `base` if free, else the first free ``<base>_<k>``; the result is reserved."""
        if not base:
            raise ValueError("a name base must not be empty")
        name = base
        suffix = self._next_suffix.get(base, 1)
        while name in self._taken:
            name = f"{base}_{suffix}"
            suffix += 1
        self._next_suffix[base] = suffix
        self._taken.add(name)
        return name


def add_initializer(names: NameAllocator, graph: onnx.GraphProto, base: str,
                    value: np.ndarray) -> str:
    """A new initializer of `graph` holding `value`, named from `base`; its name."""
    name = names.allocate(base)
    graph.initializer.append(numpy_helper.from_array(value, name))
    return name


def model_names(model: onnx.ModelProto) -> set[str]:
    """Every value and node name in `model`: main graph, subgraphs and local functions."""
    names: set[str] = set()
    for graph in _graphs(model.graph):
        names.update(_graph_names(graph))
    for function in model.functions:
        names.update(function.input)
        names.update(function.output)
        for node in function.node:
            names.update(_node_names(node))
            for attribute in node.attribute:
                for subgraph in _attribute_graphs(attribute):
                    for graph in _graphs(subgraph):
                        names.update(_graph_names(graph))
    names.discard("")
    return names


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every graph nested in its nodes' attributes, depth first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in _attribute_graphs(attribute):
                yield from _graphs(subgraph)


def _attribute_graphs(attribute: onnx.AttributeProto) -> Iterator[onnx.GraphProto]:
    if attribute.type == onnx.AttributeProto.GRAPH:
        yield attribute.g
    elif attribute.type == onnx.AttributeProto.GRAPHS:
        yield from attribute.graphs


def _graph_names(graph: onnx.GraphProto) -> Iterator[str]:
    for value in (*graph.input, *graph.output, *graph.value_info):
        yield value.name
    for tensor in graph.initializer:
        yield tensor.name
    for sparse in graph.sparse_initializer:
        yield sparse.values.name
        yield sparse.indices.name
    for node in graph.node:
        yield from _node_names(node)


def _node_names(node: onnx.NodeProto) -> Iterator[str]:
    yield node.name
    yield from node.input
    yield from node.output
