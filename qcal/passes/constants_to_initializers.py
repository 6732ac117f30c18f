"""Pass: turn the main graph's Constant nodes into initializers, so weights held in Constant
nodes (common in older exporters) are quantized like any other weight."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.passes._base import StepResult
from qcal.passes._graph import DEFAULT_DOMAINS, FLOAT_TYPES

__all__ = ["ConstantsToInitializers"]

# IR versions below 4 require every initializer to be listed as a graph input too.
_IR_INITIALIZERS_WITHOUT_INPUTS = 4


class ConstantsToInitializers:
    """Replace each main-graph Constant node by an initializer of the same name.

    Handles the dense forms (``value``, ``value_float(s)``, ``value_int(s)``); sparse and string
    constants, and constants that are graph outputs, stay nodes. Subgraph constants are left
    alone (subgraphs are not quantized yet).
    """

    name: ClassVar[str] = "constants-to-initializers"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        outputs = {v.name for v in graph.output}
        kept: list[onnx.NodeProto] = []
        moved: list[onnx.TensorProto] = []
        for node in graph.node:
            tensor = _dense_value(node) if node.output and node.output[0] not in outputs else None
            if tensor is None:
                kept.append(node)
            else:
                moved.append(tensor)
        if not moved:
            return StepResult(model, False)
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(moved)
        if model.ir_version < _IR_INITIALIZERS_WITHOUT_INPUTS:
            graph.input.extend(
                onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved
            )
        floats = sum(t.data_type in FLOAT_TYPES for t in moved)
        detail = (
            f"moved {len(moved)} Constant node{'s' * (len(moved) != 1)} into initializers "
            f"({floats} float)"
        )
        return StepResult(model, True, detail)


def _dense_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a Constant node produces, None when it is not a dense numeric Constant."""
    if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS or len(node.attribute) != 1:
        return None
    attribute = node.attribute[0]
    name = node.output[0]
    if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
        if attribute.t.data_type == onnx.TensorProto.STRING:
            return None
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attribute.t)
        tensor.name = name
        return tensor
    scalars: dict[str, object] = {
        "value_float": np.float32(attribute.f),
        "value_floats": np.asarray(attribute.floats, dtype=np.float32),
        "value_int": np.int64(attribute.i),
        "value_ints": np.asarray(attribute.ints, dtype=np.int64),
    }
    if attribute.name not in scalars:
        return None
    return numpy_helper.from_array(np.asarray(scalars[attribute.name]), name)
