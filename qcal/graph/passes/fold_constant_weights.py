"""Pass: store a weight computed from constants alone as the initializer it computes.

Two kinds of computation reach a Conv, ConvTranspose, MatMul or Gemm as its weight:

* views: a Transpose, Reshape, Squeeze, Unsqueeze, Flatten or Cast of constants. torch.onnx's
  dynamo exporter writes a tied language-model head as ``MatMul(h, Transpose(embedding))``;
* arithmetic: the same exporter keeps weight normalization (``g * v / ||v||``: ReduceL2, Div,
  Mul on the parameters) for every weight too large for its own constant folding, as in
  vocoders and wav2vec2's positional convolution; weight standardization and scaled weights are
  written the same way.

Planned as it stands, such a weight is an activation: observed over the calibration data,
quantized per tensor and quantized again by a QuantizeLinear on every run (a weight-normalized
vocoder ran 1.12x its float latency, against 0.75x for the same network exported with the
computation folded). Folded, it is a weight like any other (per channel, codes stored once).
onnxruntime folds such nodes itself when it loads the float model. Both are computed by onnx's
reference evaluator (numpy): views exactly, arithmetic possibly differing from onnxruntime's
kernels in the last bit of a sum, far below any quantization step.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx

from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.passes._folding import evaluate_node, fold_into_initializers, tensor_size
from qcal.graph.structure import COMPUTE_OPS, DEFAULT_DOMAINS, default_opset

__all__ = ["FoldConstantWeights"]

_VIEW_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast"})
# Deterministic arithmetic on float constants that exporters write to compute a weight; random
# operators, and those without inputs, never fold.
_ARITHMETIC_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Pow", "Exp", "Log",
    "Max", "Min", "Clip", "Sign", "Tanh", "Sigmoid", "Erf",
    "ReduceL1", "ReduceL2", "ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceMax",
    "ReduceMin", "LpNormalization", "Concat", "Slice", "Gather", "Expand", "Tile", "Where",
})
_FOLDED_OPS = _VIEW_OPS | _ARITHMETIC_OPS
# A bias or scale a Conv's output is shifted or scaled by (paddle2onnx writes a Conv's bias as an
# Add of a reshaped constant): folded, fold-batchnorm moves it into the Conv.
_CHANNEL_AFFINE_OPS = frozenset({"Add", "Mul"})
# A computed weight holds at most as many values as its operands together, or this many.
_FEW_VALUES = 1 << 16


class FoldConstantWeights:
    """Replace each view of or arithmetic on constants in the main graph whose float result a
    Conv, ConvTranspose, MatMul or Gemm reads (through further such nodes), or that a Mul or
    Add reads beside such a node's output, by an initializer of its output's name; chains fold
    in one run, and a constant nothing reads any more goes. What is read otherwise stays."""

    name: ClassVar[str] = "fold-constant-weights"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:  # initializers must be inputs
            return StepResult(model, False)
        opset = default_opset(model) or 1
        wanted = _read_as_weights(model.graph)
        folded = {"views": 0, "arithmetic": 0}

        def value_of(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
                     ) -> np.ndarray | None:
            if node.output[0] not in wanted:
                return None
            value = _value(node, constants, opset)
            if value is not None:
                folded["views" if node.op_type in _VIEW_OPS else "arithmetic"] += 1
            return value

        count = fold_into_initializers(model, value_of)
        if not count:
            return StepResult(model, False)
        views, arithmetic = folded["views"], folded["arithmetic"]
        parts = [f"{views} view{'s' * (views != 1)}"] if views else []
        if arithmetic:
            parts.append(f"{arithmetic} computation{'s' * (arithmetic != 1)}")
        return StepResult(model, True, f"stored {' and '.join(parts)} of constant weights "
                                       "as initializers")


def _read_as_weights(graph: onnx.GraphProto) -> set[str]:
    """Values a compute node reads as an operand, or a Mul or Add reads beside a compute node's
    output (a bias or scale that fold-batchnorm then folds into it), and the values the views
    and arithmetic that make them read (walked back from the readers, so chains count)."""
    computed = {v for n in graph.node if n.op_type in COMPUTE_OPS and n.domain in DEFAULT_DOMAINS
                for v in n.output}
    wanted = {v for n in graph.node if n.op_type in COMPUTE_OPS and n.domain in DEFAULT_DOMAINS
              for v in n.input[:2] if v}
    wanted.update(v for n in graph.node if n.op_type in _CHANNEL_AFFINE_OPS
                  and n.domain in DEFAULT_DOMAINS and any(v in computed for v in n.input)
                  for v in n.input if v and v not in computed)
    for node in reversed(graph.node):  # readers come after what they read
        if (node.op_type in _FOLDED_OPS and node.domain in DEFAULT_DOMAINS and node.input
                and any(o in wanted for o in node.output)):
            wanted.update(v for v in node.input if v)
    return wanted


def _value(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
           opset: int) -> np.ndarray | None:
    """The float value a view of or arithmetic on constants (all it reads) computes (onnx's reference
    evaluator: a view moves the values exactly), or None."""
    if (node.op_type not in _FOLDED_OPS or node.domain not in DEFAULT_DOMAINS
            or len(node.output) != 1 or not node.input[0]):
        return None
    value = evaluate_node(node, constants, opset)
    if value is None or value.dtype.kind != "f":
        return None
    # An Expand or Tile that only repeats a constant stays: onnxruntime folds it at load, and
    # stored, it would grow the model file.
    read = sum(tensor_size(constants[v]) for v in node.input if v)
    return value if value.size <= max(read, _FEW_VALUES) else None
