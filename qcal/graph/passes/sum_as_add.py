"""Pass: write a Sum of two inputs as the Add it is.

Sum adds any number of tensors; a Sum of two computes what Add computes, value for value (both
broadcast alike since opset 8, and qcal prepares at opset 13 or above). Caffe2's exports write
every residual connection as a Sum, tf2onnx writes Keras' Add of a list that way. qcal
quantizes Add (onnxruntime runs it as QLinearAdd on the codes) and has no rule for Sum, which
quantized stays a float node between a DequantizeLinear and a QuantizeLinear: at every
residual connection of a Caffe2 ShuffleNet, next to integer Convs that run channels-last,
onnxruntime also transposed both inputs to channels-first and back (with its shuffles written
as a Gather too, `qcal.graph.passes.shuffle_as_gather`: 1.87x / 2.24x -> 0.85x / 0.94x its float
model at one / two threads). A Sum of three or more stays: as a chain of Adds its sum could
round differently.
"""

from __future__ import annotations

from typing import ClassVar

import onnx

from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS

__all__ = ["SumAsAdd"]


class SumAsAdd:
    """Rename each two-input Sum of the main graph to Add (same name, inputs and output)."""

    name: ClassVar[str] = "sum-as-add"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        count = 0
        for node in model.graph.node:
            if (node.op_type == "Sum" and node.domain in DEFAULT_DOMAINS
                    and len(node.input) == 2 and all(node.input)):
                node.op_type = "Add"
                count += 1
        if not count:
            return StepResult(model, False)
        return StepResult(model, True, f"wrote {count} Sum{'s' * (count != 1)} of two inputs "
                                       "as Add")
