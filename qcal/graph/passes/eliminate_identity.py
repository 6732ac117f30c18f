"""Pass: remove Identity nodes of the main graph, so quantization rules see the real producer
and consumer (an Identity between a weight and its Conv would otherwise hide the weight)."""

from __future__ import annotations

from typing import ClassVar

import onnx

from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, bypass_nodes

__all__ = ["EliminateIdentity"]


class EliminateIdentity:
    """Make every reader of an Identity's output read its input instead, and drop the node.

    An Identity whose output is a graph output stays (removing it would rename the output).
    Reads from inside subgraphs are redirected too. Chains collapse in one run.
    """

    name: ClassVar[str] = "eliminate-identity"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        outputs = {v.name for v in graph.output}
        removed = [position for position, node in enumerate(graph.node)
                   if node.op_type == "Identity" and node.domain in DEFAULT_DOMAINS
                   and len(node.input) == 1 and len(node.output) == 1
                   and node.output[0] not in outputs]
        if not removed:
            return StepResult(model, False)
        bypass_nodes(graph, removed)
        count = len(removed)
        return StepResult(model, True, f"removed {count} Identity node{'s' * (count != 1)}")
