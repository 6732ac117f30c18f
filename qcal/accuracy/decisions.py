"""How a model output is read: the decisions whose agreement float vs quantized is counted.

An output computed by a linear layer or a softmax (through reshapes) holds scores whose argmax is
what a user reads; an output computed otherwise (a pooled or normalized embedding, hidden
states) has no meaningful argmax and is compared by SQNR and cosine only. Which outputs are
read how, and at which shapes:

* scores ``[N, classes]`` (at least 2 classes) from Gemm, MatMul, Add, Softmax or LogSoftmax:
  one argmax per sample;
* a softmax over the last axis of a higher rank (a CTC recognizer's ``[N, T, classes]``, a token
  classifier): one argmax per position, since that is how such an output is decoded;
* a Sigmoid's output, any shape: every element is a yes/no at 0.5 (voice activity per frame,
  multi-label tags, a detector's objectness).

A linear layer's output of a higher rank is hidden states, not scores. Reshapes, casts and a
scaling by a positive constant (a temperature) in between change no decision. An output none of
these rules reads may still be a softmax spelled out (Exp, ReduceSum, Div): the evaluation
measures that on the values (`qcal.accuracy.evaluate`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

__all__ = ["DecisionRule", "decision_rules", "is_classifier_like"]

_SCORE_OPS = frozenset({"Gemm", "MatMul", "Add", "Softmax", "LogSoftmax"})
_SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
_PASS_THROUGH = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Cast"})


def is_classifier_like(shape: tuple[int, ...], *, per_position: bool = False) -> bool:
    """[N, classes]; with `per_position` (a softmax over the last axis), any rank from 2."""
    return (len(shape) == 2 or (per_position and len(shape) > 2)) and shape[-1] >= 2


@dataclass(frozen=True)
class DecisionRule:
    """How one output is read.

    Attributes:
        threshold: a sigmoid's probabilities, each a yes/no at 0.5.
        softmax_axis: for a softmax (or the version converter's spelling of an old one), the
            axis it normalizes; its positions are decisions when that is the last axis.
    """

    threshold: bool = False
    softmax_axis: int | None = None

    def applies(self, shape: tuple[int, ...]) -> bool:
        """Whether an output of this shape holds decisions under the rule."""
        if self.threshold:
            return len(shape) > 0
        last = self.softmax_axis is not None and self.softmax_axis in (-1, len(shape) - 1)
        return is_classifier_like(shape, per_position=last and len(shape) > 2)

    def count(self, x: np.ndarray, y: np.ndarray) -> tuple[int, int, np.ndarray | None]:
        """(decisions that agree, decisions, the float model's per-sample classes or None)."""
        if self.threshold:
            fx, fy = x > 0.5, y > 0.5
            return int(np.count_nonzero(fx == fy)), int(fx.size), None
        fx, fy = np.argmax(x, axis=-1), np.argmax(y, axis=-1)
        return int(np.count_nonzero(fx == fy)), int(fx.size), fx if fx.ndim == 1 else None


def decision_rules(model: onnx.ModelProto) -> dict[str, DecisionRule]:
    """Main-graph outputs that hold decisions (module docstring) -> how they are read."""
    producer = {v: n for n in model.graph.node for v in n.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    positive = _positive_scalars(model)
    found = {}
    for output in model.graph.output:
        node = producer.get(output.name)
        reshaped = False
        while node is not None and node.input:
            if node.op_type in _PASS_THROUGH:
                reshaped = reshaped or node.op_type != "Identity"
                node = producer.get(node.input[0])
            elif (node.op_type in ("Mul", "Div") and len(node.input) == 2
                  and node.input[1] in positive):
                node = producer.get(node.input[0])  # a temperature: the same argmax
            elif node.op_type == "Mul" and len(node.input) == 2 and node.input[0] in positive:
                node = producer.get(node.input[1])
            else:
                break
        if node is None:
            continue
        if node.op_type == "Sigmoid":
            found[output.name] = DecisionRule(threshold=True)
        elif node.op_type in _SCORE_OPS:
            found[output.name] = DecisionRule(
                softmax_axis=_softmax_axis(node, producer, opset, reshaped))
    return found


def _positive_scalars(model: onnx.ModelProto) -> set[str]:
    """Initializers (and Constant outputs) holding one positive finite number."""
    tensors = [(t.name, t) for t in model.graph.initializer]
    tensors += [(n.output[0], a.t) for n in model.graph.node if n.op_type == "Constant"
                for a in n.attribute if a.name == "value"]
    found = set()
    for name, tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or np.prod(tensor.dims) != 1:
            continue
        value = onnx.numpy_helper.to_array(tensor)
        if value.dtype.kind == "f" and np.isfinite(value).all() and float(value.ravel()[0]) > 0:
            found.add(name)
    return found


def _softmax_axis(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto], opset: int,
                  reshaped: bool) -> int | None:
    if node.op_type not in _SOFTMAX_OPS:
        return None
    # Before opset 13 a softmax flattens its input to 2-D at `axis` (default 1).
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1 if opset >= 13 else 1)
    if not reshaped:
        return axis
    # Reshaped back after a Flatten at k (how onnx's version converter writes an old softmax):
    # a softmax over the dimensions from k.
    flatten = producer.get(node.input[0]) if node.input else None
    if flatten is None or flatten.op_type != "Flatten" or axis not in (-1, 1):
        return None
    return next((a.i for a in flatten.attribute if a.name == "axis"), 1)
