"""Pass: give every node a unique name, so plans and reports can refer to nodes by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import onnx

from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import attribute_graphs

__all__ = ["NameNodes"]


class NameNodes:
    """Name unnamed nodes ``<op_type>``, ``<op_type>_1``, ... and rename repeated names.

    Covers the main graph and every subgraph, depth first in graph order, so the names depend
    only on the model. New names are collision-checked against every node and value name of the
    model; of several nodes sharing a name, the first keeps it.
    """

    name: ClassVar[str] = "name-nodes"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        names = NameAllocator.from_model(model)
        seen: set[str] = set()
        unnamed = renamed = 0
        for node in _all_nodes(model.graph):
            if not node.name:
                node.name = names.allocate(node.op_type or "node")
                unnamed += 1
            elif node.name in seen:
                node.name = names.allocate(node.name)
                renamed += 1
            seen.add(node.name)
        parts = []
        if unnamed:
            parts.append(f"named {unnamed} unnamed node{'s' * (unnamed != 1)}")
        if renamed:
            parts.append(f"renamed {renamed} node{'s' * (renamed != 1)} with a repeated name")
        return StepResult(model, bool(parts), "; ".join(parts))


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in attribute_graphs(attribute):
                yield from _all_nodes(subgraph)
