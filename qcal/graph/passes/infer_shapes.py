"""Pass: record element types and shapes of intermediate tensors with onnx shape inference.

The planner quantizes only tensors it knows to be float, so types matter; inference that cannot
complete (custom operators, data-dependent shapes) is reported, never fatal.
"""

from __future__ import annotations

from typing import ClassVar

import onnx

from qcal.graph.passes._base import StepResult
from qcal.graph.passes._inference import infer_shapes
from qcal.graph.structure import all_graphs, attribute_graphs, element_types

__all__ = ["InferShapes", "infer_shapes"]


class InferShapes:
    """Replace the model's value_info (all graphs) with what onnx shape inference finds.

    Runs strict inference first; when it fails, keeps what non-strict inference could still
    infer and says why in the step detail.

    A dimension is recorded only as the model states it (a number, or a name the model gives
    it): a name shape inference makes up (``unk__3``) stands for a size computed from the
    data, such as a detector's count of boxes, and onnxruntime, told that two tensors share
    it, folds a Reshape between them into a target that fails when the count is 0 (RetinaNet
    failed on every image without a box, in calibration and as written; the float model runs).
    """

    name: ClassVar[str] = "infer-shapes"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        failure = ""
        try:
            inferred = infer_shapes(model, strict=True)
        except Exception as err:  # noqa: BLE001  the C++ inference raises assorted types
            failure = _first_line(err)
            try:
                inferred = infer_shapes(model, strict=False)
            except Exception as err2:  # noqa: BLE001  same: an untyped model is still usable
                detail = f"shape inference could not complete: {_first_line(err2)}"
                return StepResult(model, False, detail)
        _copy_types(inferred.graph, model.graph, _dimension_names(model.graph))
        known, total = _typed_count(model.graph)
        detail = f"element types known for {known} of {total} intermediate tensors"
        if failure:
            detail = f"shape inference could not complete ({failure}); {detail}"
        return StepResult(model, True, detail)


def _copy_types(source: onnx.GraphProto, target: onnx.GraphProto, names: set[str]) -> None:
    """Copy value_info and output types of `source` into the same-shaped `target`, recursively,
    with only the dimension `names` the model states."""
    del target.value_info[:]
    target.value_info.extend(source.value_info)
    for source_output, target_output in zip(source.output, target.output):
        if source_output.HasField("type"):
            target_output.type.CopyFrom(source_output.type)
    for value in (*target.value_info, *target.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param not in names:
                dim.ClearField("dim_param")
    for source_node, target_node in zip(source.node, target.node):
        for source_attribute, target_attribute in zip(source_node.attribute, target_node.attribute):
            pairs = zip(attribute_graphs(source_attribute), attribute_graphs(target_attribute))
            for source_graph, target_graph in pairs:
                _copy_types(source_graph, target_graph, names)


def _dimension_names(graph: onnx.GraphProto) -> set[str]:
    """The dimension names the model states (inputs, outputs, value_info, in every graph)."""
    return {dim.dim_param for g in all_graphs(graph)
            for value in (*g.input, *g.output, *g.value_info)
            for dim in value.type.tensor_type.shape.dim if dim.HasField("dim_param")}


def _typed_count(graph: onnx.GraphProto) -> tuple[int, int]:
    types = element_types(graph)
    produced = [v for node in graph.node for v in node.output if v]
    return sum(v in types for v in produced), len(produced)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
