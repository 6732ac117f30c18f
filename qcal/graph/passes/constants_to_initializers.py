"""Pass: turn Constant nodes into initializers, so weights held in Constant nodes (common in
older exporters, and inside If/Loop/Scan bodies) are quantized like any other weight."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, FLOAT_TYPES, attribute_graphs

__all__ = ["ConstantsToInitializers"]

_BODY_OPS = frozenset({"If", "Loop", "Scan"})


class ConstantsToInitializers:
    """Replace each Constant node of the main graph and of If/Loop/Scan bodies by an
    initializer of the same name in the same graph.

    Handles the dense forms (``value``, ``value_float(s)``, ``value_int(s)``); sparse and string
    constants, and constants that are graph outputs, stay nodes. Below IR version 4, where
    initializers must also be graph inputs, bodies are left alone (their inputs are fixed).
    """

    name: ClassVar[str] = "constants-to-initializers"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        with_bodies = model.ir_version >= IR_INITIALIZERS_WITHOUT_INPUTS
        moved = _move_constants(graph, with_bodies=with_bodies)
        if not moved:
            return StepResult(model, False)
        if not with_bodies:
            graph.input.extend(
                onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved
            )
        floats = sum(t.data_type in FLOAT_TYPES for t in moved)
        detail = (
            f"moved {len(moved)} Constant node{'s' * (len(moved) != 1)} into initializers "
            f"({floats} float)"
        )
        return StepResult(model, True, detail)


def _move_constants(graph: onnx.GraphProto, *, with_bodies: bool) -> list[onnx.TensorProto]:
    """Move `graph`'s Constant nodes (and, `with_bodies`, its bodies') into initializers."""
    moved: list[onnx.TensorProto] = []
    if with_bodies:  # bodies first: the nodes holding them are copied below
        for node in graph.node:
            if node.op_type in _BODY_OPS and node.domain in DEFAULT_DOMAINS:
                for attribute in node.attribute:
                    for body in attribute_graphs(attribute):
                        moved += _move_constants(body, with_bodies=True)
    outputs = {v.name for v in graph.output}
    kept: list[onnx.NodeProto] = []
    here: list[onnx.TensorProto] = []
    for node in graph.node:
        tensor = _dense_value(node) if node.output and node.output[0] not in outputs else None
        if tensor is None:
            kept.append(node)
        else:
            here.append(tensor)
    if here:
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(here)
    return here + moved


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
