"""What the passes that fold constants share: nodes replaced by the initializers they compute."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.structure import drop_unread_initializers

__all__ = ["fold_into_initializers"]

# A node's value from the constants it may read (None: the node stays).
ValueOf = Callable[[onnx.NodeProto, dict[str, onnx.TensorProto]], "np.ndarray | None"]


def fold_into_initializers(model: onnx.ModelProto, value_of: ValueOf) -> int:
    """Replace each main-graph node whose value `value_of` computes by an initializer of its
    output's name, in graph order: the constants it is given (initializers that are not graph
    inputs) include what folded before it, so chains fold in one run. A graph output never
    folds; once something has, the initializers nothing reads any more go. Returns how many
    nodes folded."""
    graph = model.graph
    inputs = {v.name for v in graph.input}
    constants = {t.name: t for t in graph.initializer if t.name not in inputs}
    outputs = {v.name for v in graph.output}
    folded: list[onnx.TensorProto] = []
    kept = []
    for node in graph.node:
        value = None
        if node.output and node.output[0] not in outputs:
            value = value_of(node, constants)
        if value is None:
            kept.append(node)
            continue
        tensor = numpy_helper.from_array(value, node.output[0])
        constants[tensor.name] = tensor
        folded.append(tensor)
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(folded)
        drop_unread_initializers(graph, {t.name for t in graph.initializer})
    return len(folded)
