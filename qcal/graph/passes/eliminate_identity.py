"""Pass: remove Identity nodes of the main graph, so quantization rules see the real producer
and consumer (an Identity between a weight and its Conv would otherwise hide the weight)."""

from __future__ import annotations

from typing import ClassVar

import onnx

from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, drop_value_info

__all__ = ["EliminateIdentity"]


class EliminateIdentity:
    """Make every reader of an Identity's output read its input instead, and drop the node.

    An Identity whose output is a graph output stays (removing it would rename the output).
    Reads from inside subgraphs are redirected too. Chains collapse in one run.
    """

    name: ClassVar[str] = "eliminate-identity"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        removed: set[int] = set()  # node positions
        for position, node in enumerate(graph.node):
            if (
                node.op_type != "Identity"
                or node.domain not in DEFAULT_DOMAINS
                or len(node.input) != 1
                or len(node.output) != 1
                or node.output[0] in index.graph_outputs
            ):
                continue
            # Graph order: an Identity's input was already redirected if it was itself an
            # Identity output, so chains resolve to their first real value.
            index.replace_uses(node.output[0], node.input[0])
            removed.add(position)
        if not removed:
            return StepResult(model, False)
        kept = [n for p, n in enumerate(graph.node) if p not in removed]
        dropped = {graph.node[p].output[0] for p in removed}
        del graph.node[:]
        graph.node.extend(kept)
        drop_value_info(graph, dropped)
        count = len(removed)
        return StepResult(model, True, f"removed {count} Identity node{'s' * (count != 1)}")
