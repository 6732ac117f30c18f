"""How a model output is read: the decisions whose agreement float vs quantized is counted.

An output computed by a linear layer or a softmax (through reshapes) holds scores whose argmax is
what a user reads; an output computed otherwise (a pooled or normalized embedding, hidden
states) has no meaningful argmax and is compared by SQNR and cosine only. Which outputs are
read how, and at which shapes:

* scores ``[N, classes]`` (at least 2 classes) from Gemm, MatMul, Conv, Softmax or
  LogSoftmax, or an Add of a constant bias or of two heads' scores to those: one argmax per
  sample (a convolutional head's class maps reach it through a global pooling, a Relu or a
  1x1 Conv on the pooled vector and a flatten; a Conv over a feature map, only reshaped, is a
  regression head's coordinates);
* a softmax over the last axis of a higher rank (a CTC recognizer's ``[N, T, classes]``, a token
  classifier): one argmax per position, since that is how such an output is decoded; and so is
  a linear layer's output of a higher rank (a MatMul or Gemm, or its bias added on its own,
  through reshapes): the same heads exported without their softmax, whose logits a CTC decoder
  or a tagger reads alike (a CRNN's ``[T, N, classes]``, a per-frame classifier); at rank 3 each
  sample's positions are also read together, as the sequence a decoder reads
  (`sequences_read_alike`);
* a softmax over axis 1 of a map ``[N, classes, ...]``, and a Conv's maps of at least
  MAP_CLASSES channels brought to another size by a Resize (a segmentation's logits
  upsampled to the image), or named logits by their exporter: one argmax over the channels per
  position, a class per pixel (a detector's heads and a pose model's heatmaps are given at the
  stride they are computed at);
* a Sigmoid's output, any shape, also transposed: every element is a yes/no at 0.5 (voice
  activity per frame, multi-label tags, a detector's objectness or class scores, which
  paddle2onnx's PicoDet transposes to anchors x classes); so is a mean of it (a chunk's speech
  probability), and an If's output that every branch computes from a Sigmoid. Its yes
  decisions are also counted apart (`yes_decisions`): on a detector's map the confident
  background agrees by itself, and what a user reads is the few cells called yes. Unless the
  float model leaves most of its values undecided: an image through a sigmoid holds values,
  which the evaluation measures (`qcal.accuracy.evaluate`).

A model that gives probabilities (a softmax's or a sigmoid's output) gives a linear layer's raw
outputs beside them as values: a face stage's box offsets and landmarks beside its face
softmax, or the logits of those very probabilities.

A linear layer's or softmax's output stating the dimensions of a float model input after the
batch's, at least 64 values a sample, is that input reconstructed (an autoencoder's pixels):
values, whose argmax means nothing.

Hidden states are a normalization's or a residual Add's output, not a linear layer's; an
exporter that names them (`last_hidden_state`) is taken at its word below. Reshapes, casts and a
scaling by a positive constant (a temperature) in between change no decision. An output named as
a value (an embedding, hidden states, features, a pooled output, boxes, coordinates, keypoints,
depth) holds none, whatever computes it. An output none of these rules reads may still be a
softmax spelled out (Exp, ReduceSum, Div): the evaluation measures that on the values
(`qcal.accuracy.evaluate`).

How the decisions are counted, near-ties of the float model as agreement, is
`qcal.accuracy.decision_counts`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import onnx
import onnx.numpy_helper

from qcal.accuracy.decision_counts import DecisionRule
from qcal.graph.structure import FLOAT_TYPES, node_subgraphs

__all__ = ["decision_rules"]

_SCORE_OPS = frozenset({"Gemm", "MatMul", "Conv", "Add", "Softmax", "LogSoftmax"})
# Upsampling between a Conv's class maps and an output: the logits of a segmentation brought
# to the image's size. A detector's heads, a pose model's heatmaps and a regression's maps are
# given at the stride they are computed at.
_RESIZE_OPS = frozenset({"Resize", "Upsample"})
_SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
# Ops between scores and an output that keep each class's rank: shape changes, casts.
_PASS_THROUGH = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                           "Cast"})
# And between a Conv's class maps and an output: their global pooling, a Relu (order kept,
# ties at 0 alike). Only there: pooled hidden states of a linear layer are an embedding.
_CLASS_MAP_OPS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax",
                            "Relu"})
# Outputs their exporter names as values, not choices: a CLIP tower's projected `text_embeds`
# come from a linear layer like logits do, a DETR head's sigmoid `pred_boxes` like yes/no
# probabilities do, yet their argmax or threshold means nothing.
_NOT_DECISIONS = re.compile(r"embed|hidden|feature|pool|box|coord|landmark|keypoint|depth",
                            re.IGNORECASE)
# And a Conv's maps their exporter names logits are a segmentation's at the size it computes
# them (Hugging Face's SegFormer, MobileViT and BEiT heads at a quarter of the image, a UNet's
# at its full size), where nothing in the graph tells them from a pose model's heatmaps.
_LOGITS = re.compile(r"logit", re.IGNORECASE)


def decision_rules(model: onnx.ModelProto) -> dict[str, DecisionRule]:
    """Main-graph outputs that hold decisions (module docstring) -> how they are read."""
    producer = {v: n for n in model.graph.node for v in n.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    positive = _positive_scalars(model)
    constants = ({t.name for t in model.graph.initializer}
                 | {n.output[0] for n in model.graph.node if n.op_type == "Constant"})
    reconstructed = {_trailing_dims(i) for i in model.graph.input if i.name not in constants
                     and _holds_floats(i)} - {None}
    found = {}
    for output in model.graph.output:
        if _NOT_DECISIONS.search(output.name):
            continue
        node, reshaped, pooled, transposed, resized = _source(output.name, producer, positive)
        if node is None or (transposed and node.op_type != "Sigmoid"):
            continue  # a transposed argmax would be read over another axis
        if node.op_type == "Sigmoid":
            # Pooled too: a mean (or max) of probabilities is one, thresholded alike (a
            # voice-activity model averaging its per-frame sigmoid over the chunk).
            found[output.name] = DecisionRule(threshold=True)
        elif ((resized or _LOGITS.search(output.name)) and not (reshaped or pooled)
              and _conv_maps(node, producer, constants)
              and _trailing_dims(output) not in reconstructed):
            # a segmentation's logits brought to the image's size, or named so: a class per
            # pixel
            found[output.name] = DecisionRule(channel_maps=True)
        elif node.op_type == "Add" and not (_linear(node, producer, constants)
                                            or _class_maps(node, producer, constants)
                                            or _sum_of_heads(node, producer, constants)):
            continue  # a residual sum, a normalization's shift: values, not scores
        elif not pooled and _class_maps(node, producer, constants) and not _reads_pooled(
                node, producer):
            continue  # a Conv over a feature map, reshaped: a regression head's coordinates
        elif _trailing_dims(output) in reconstructed:
            continue  # an autoencoder's reconstruction of its input: values, not scores
        elif node.op_type in _SCORE_OPS and not (pooled and not _class_maps(node, producer,
                                                                             constants)):
            axis = _softmax_axis(node, producer, opset, reshaped)
            found[output.name] = DecisionRule(
                softmax_axis=axis, linear=not pooled and _linear(node, producer, constants),
                # over the channels of a map: a segmentation's class probabilities per pixel
                # (before opset 13 a softmax at axis 1 is one distribution per sample)
                channel_maps=axis == 1 and opset >= 13 and not (reshaped or pooled))
    if any(r.threshold or r.softmax_axis is not None for r in found.values()):
        # A model giving its decisions as probabilities (a softmax, a sigmoid) gives a linear
        # layer's raw outputs beside them as values: an MTCNN face stage's box offsets and
        # landmarks beside its face softmax, or the logits of those probabilities themselves.
        found = {name: r for name, r in found.items()
                 if r.threshold or r.softmax_axis is not None or not r.linear}
    return found


def _holds_floats(value: onnx.ValueInfoProto) -> bool:
    element = value.type.tensor_type.elem_type
    return element in FLOAT_TYPES or element == onnx.TensorProto.DOUBLE


# Values per sample from which an output of its input's dimensions is taken for a
# reconstruction: a classifier of as many classes as its input has features is a coincidence of
# small numbers (4 features, 4 classes), an autoencoder's output is its input's size.
_RECONSTRUCTED_VALUES = 64


def _trailing_dims(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    """The dimensions a value states after its first (the batch's), when it states them all;
    else None. A linear layer's output of a float input's dimensions (an autoencoder's
    ``[N, 784]`` pixels of its ``[N, 784]`` input) reconstructs that input: its argmax means
    nothing (read as one decision per row, 87 % agreed at 31 dB)."""
    dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else []
    trailing = tuple(d.dim_value for d in list(dims)[1:])
    if not trailing or min(trailing) < 1 or math.prod(trailing) < _RECONSTRUCTED_VALUES:
        return None
    return trailing


class _Way(NamedTuple):
    """The node whose output reaches an output through ops that keep decisions, and whether
    the way reshaped, pooled, transposed (which keeps each element's yes/no, not the axis an
    argmax reads) or resized it."""

    node: onnx.NodeProto | None
    reshaped: bool = False
    pooled: bool = False
    transposed: bool = False
    resized: bool = False


def _source(value: str, producer: Mapping[str, onnx.NodeProto], positive: set[str]) -> _Way:
    """The way to `value` (`_Way`). Through an If, the branches' own ways, when every branch
    comes from a Sigmoid (a streaming model choosing its path by the sample rate); other ops
    an If returns are read as computed values."""
    node = producer.get(value)
    reshaped = pooled = transposed = resized = scaled = False
    after = ""  # the op on the way after this one
    while node is not None and node.input:
        if node.op_type in _PASS_THROUGH:
            reshaped = reshaped or node.op_type != "Identity"
            value = node.input[0]
        elif node.op_type in _RESIZE_OPS:
            resized = True
            value = node.input[0]
        elif node.op_type == "Transpose":
            transposed = True
            value = node.input[0]
        elif node.op_type == "Split" and after == "Squeeze":
            # one score channel of a head split off and squeezed: a question-answering head's
            # start (or end) logits over the positions, each position a candidate
            reshaped = True
            value = node.input[0]
        elif node.op_type in _CLASS_MAP_OPS:
            pooled = True
            value = node.input[0]
        elif (node.op_type in ("Mul", "Div") and len(node.input) == 2
              and node.input[1] in positive):
            value, scaled = node.input[0], True  # a temperature: the same argmax
        elif node.op_type == "Mul" and len(node.input) == 2 and node.input[0] in positive:
            value, scaled = node.input[1], True
        elif node.op_type == "If":
            index = list(node.output).index(value)
            return _Way(_branches_sigmoid(node, index, producer, positive), True, True,
                        transposed, resized)
        else:
            break
        after = node.op_type
        node = producer.get(value)
    if scaled and node is not None and node.op_type == "Sigmoid":
        # a scaled sigmoid is no probability to hold at 0.5: GLPN's depth is 10 sigmoid(x)
        node = None
    return _Way(node, reshaped, pooled, transposed, resized)


def _branches_sigmoid(node: onnx.NodeProto, index: int,
                      producer: Mapping[str, onnx.NodeProto], positive: set[str],
                      ) -> onnx.NodeProto | None:
    """The Sigmoid of the If's first branch when its every branch's `index`-th output comes
    from one (computed in the branch or in a scope around it); else None."""
    found = []
    for branch in node_subgraphs(node):
        if index >= len(branch.output):
            return None
        inner = {**producer, **{v: n for n in branch.node for v in n.output}}
        source = _source(branch.output[index].name, inner, positive).node
        if source is None or source.op_type != "Sigmoid":
            return None
        found.append(source)
    return found[0] if found else None


def _linear(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
            constants: set[str]) -> bool:
    """A MatMul or Gemm, or a constant added to a MatMul's output (its bias, as exporters that
    split Linear write it)."""
    return node.op_type in ("MatMul", "Gemm") or _bias_of(node, producer, constants, "MatMul")


def _class_maps(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
                constants: set[str]) -> bool:
    """A Conv's output, or its bias added on its own (as paddle2onnx writes it)."""
    return node.op_type == "Conv" or _bias_of(node, producer, constants, "Conv")


def _conv_maps(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
               constants: set[str]) -> bool:
    """A Conv's class maps (`_class_maps`), or an Add of two (LRASPP's two heads)."""
    return _class_maps(node, producer, constants) or _adds_two(
        node, producer, lambda head: _class_maps(head, producer, constants))


def _sum_of_heads(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
                  constants: set[str]) -> bool:
    """An Add of two heads' scores: a linear layer (or Conv) each, as a distilled classifier
    averages its two heads (LeViT, EfficientFormer). A residual connection adds a layer's
    output to what that layer read, a value computed otherwise."""
    return _adds_two(node, producer, lambda head: _linear(head, producer, constants)
                     or _class_maps(head, producer, constants))


def _adds_two(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
              is_head: Callable[[onnx.NodeProto], bool]) -> bool:
    """An Add of two computed values, each written by a node `is_head` accepts."""
    heads = [producer.get(v) for v in node.input] if node.op_type == "Add" else []
    return len(heads) == 2 and all(h is not None and is_head(h) for h in heads)


# Between a global pooling and the Conv that scores its output as a classifier head.
_HEAD_INPUT_OPS = _PASS_THROUGH | {"Dropout", "Relu", "Clip", "HardSwish"}
_GLOBAL_POOLS = _CLASS_MAP_OPS - {"Relu"}


def _reads_pooled(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto]) -> bool:
    """Whether the Conv of `node` (a Conv, or its bias added on its own) scores a globally
    pooled vector, as a classifier's 1x1 Conv head does (Keras MobileNet: pooling, reshape,
    Conv, reshape). A Conv over a feature map whose output is only reshaped is a regression
    head (MediaPipe's landmark models write their coordinates so)."""
    conv = node if node.op_type == "Conv" else next(
        (p for p in (producer.get(v) for v in node.input) if p is not None
         and p.op_type == "Conv"), None)
    source = producer.get(conv.input[0]) if conv is not None and conv.input else None
    while source is not None and source.op_type in _HEAD_INPUT_OPS and source.input:
        source = producer.get(source.input[0])
    return source is not None and source.op_type in _GLOBAL_POOLS


def _bias_of(node: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
             constants: set[str], op_type: str) -> bool:
    """An Add of a constant to the output of an `op_type` node. Not a sum of two computed
    values (a residual connection) nor a normalization's shift (LayerNorm written out, as
    tf2onnx and jax2tf write it, ends in an Add of its beta to a Mul)."""
    if node.op_type != "Add" or len(node.input) != 2:
        return False
    a, b = node.input
    if b in constants:
        a, b = b, a
    computed = producer.get(b)
    return a in constants and computed is not None and computed.op_type == op_type


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
