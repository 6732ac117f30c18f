"""The main graph and the graphs nested in its nodes' attributes (If/Loop/Scan bodies and
others), walked: nodes with where they sit, and value names defined in more than one graph."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from qcal.graph.structure import attribute_graphs

_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})


def _walk_nodes(
    graph: onnx.GraphProto, container: str | None
) -> Iterator[tuple[onnx.NodeProto, str | None]]:
    """Nodes depth first in graph order, with where they sit (None: the main graph)."""
    for node in graph.node:
        yield node, container
        for attribute in node.attribute:
            for subgraph in attribute_graphs(attribute):
                where = f"the {attribute.name} of {node.op_type} node {node.name!r}"
                yield from _walk_nodes(subgraph, container or where)


def _defined_twice(graph: onnx.GraphProto) -> frozenset[str]:
    """Value names defined in more than one graph (sibling subgraphs may reuse a name)."""
    seen: set[str] = set()
    twice: set[str] = set()

    def visit(g: onnx.GraphProto) -> None:
        names = {v.name for v in g.input} | {t.name for t in g.initializer}
        names.update(v for node in g.node for v in node.output)
        names.discard("")
        twice.update(names & seen)
        seen.update(names)
        for node in g.node:
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    visit(subgraph)

    visit(graph)
    return frozenset(twice)
