"""onnx shape inference on a model of any size, shared by the passes that need shapes."""

from __future__ import annotations

import onnx
from onnx import shape_inference

from qcal.graph.files.large import run_detached

__all__ = ["infer_shapes"]


def infer_shapes(model: onnx.ModelProto, *, strict: bool) -> onnx.ModelProto:
    """onnx shape inference (with data propagation) on a copy of a model of any size; the copy
    has no large weights when the model is too large to serialize."""
    def tool(light: onnx.ModelProto | bytes) -> onnx.ModelProto:
        return shape_inference.infer_shapes(
            light, check_type=False, strict_mode=strict, data_prop=True
        )

    return run_detached(model, tool, what="shape inference", reattach=False)
