"""The input that says which positions of a sequence are padding: an attention mask.

A token model is fed sentences of several lengths padded to one length, with a mask of 1 on the
real tokens and 0 on the padding (Hugging Face's `attention_mask`); stacked in one data file,
they must be. The model still computes an output at every padding position, which nothing reads
and which attends to the real tokens only: values without meaning, whose argmax quantization
noise flips as readily as not. Compared there, a small GPT-2's logits kept its LM head float
for disagreements on padding alone. So the comparisons leave out the padding positions
(`qcal.accuracy.padding`), on the outputs that have one row per position.

The mask is found by what it does, whatever its name: a graph input of rank 2 ([batch,
sequence]) from which a chain of elementwise and reshaping operators, with no product or
reduction (a gather only as the data gathered from), reaches the input of a softmax (Softmax,
LogSoftmax, the Exp of a softmax spelled out) or the mask input of an attention operator. That
is how every exporter spells adding a large negative number to the attention scores at the
padding positions (torch.onnx: Cast/Unsqueeze/Sub/Mul; transformers 5: Where on a boolean
mask; tf2onnx: Cast/Sub/Mul/Add). Whether its values are a mask of 0 and 1 is seen in the
data, batch by batch, and which of the two marks padding is measured on the float model
(`qcal.accuracy.padding.measured_mask`). A model with two such inputs (an encoder's and a
decoder's mask) has none: which output follows which is not known.

The outputs it masks are those of one row per position: rank 3 or more ([batch, sequence,
...]), and rank 2 ([batch, sequence]: a span's start scores) where their second axis has the
name of the mask's or its tokens' (a sentence embedding's 384 values are no 384 positions,
whatever the exporter named them); not an output whose second axis is named as another
input's sequence. Exporters name axes per tensor
(torch.onnx's `logits_dynamic_axes_1`, tf2onnx's `unk__825`, dynamo's `s70`), so a name
differing from the mask's says nothing by itself; the runtime check that an output's first
axes are the mask's shape stands (`qcal.accuracy.padding`). A model with a float input of rank
3 along the mask's axis (an encoder's states, which a decoder step's cross-attention masks by
it) has none: its outputs run along the decoder's sequence, which the mask does not cover.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from qcal.graph.shapes import declared_rank
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex

__all__ = ["AttentionMask", "attention_mask"]

# What a mask goes through on its way to the scores: casts, comparisons, arithmetic with
# constants, reshaping, selection by condition. Not products or reductions, and a gather only
# as the data gathered from (transformers 5 indexes the mask by position): an input read by
# those otherwise is data (token ids are a Gather's indices, features a MatMul's input).
_MASK_OPS = frozenset({
    "Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand",
    "Tile", "Slice", "Concat", "Transpose", "Sub", "Add", "Mul", "Div", "Neg", "Not", "And",
    "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Where", "Min",
    "Max", "IsNaN", "IsInf", "Clip", "Abs", "Sign",
})
_GATHERS = frozenset({"Gather", "GatherElements", "GatherND", "Pad"})  # slot 0: the data
_SOFTMAXES = frozenset({"Softmax", "LogSoftmax", "Exp"})
# Attention operators that take the mask themselves (ONNX's opset 23 Attention; onnxruntime's).
_ATTENTION = frozenset({"Attention", "MultiHeadAttention"})
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16})
_MASK_TYPES = frozenset({
    onnx.TensorProto.BOOL, onnx.TensorProto.INT64, onnx.TensorProto.INT32,
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
})


@dataclass(frozen=True)
class AttentionMask:
    """The mask input, the graph outputs of one row per position it masks, and the value that
    marks padding (0 by Hugging Face's convention; 1 where True means padding, as PyTorch's
    `key_padding_mask`: measured, `qcal.accuracy.padding.measured_mask`)."""

    input: str
    outputs: frozenset[str]
    padding: int = 0


def attention_mask(model: onnx.ModelProto) -> AttentionMask | None:
    """The main graph's attention mask and the outputs it masks (module docstring); None when
    the model has none, or more than one."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    uses = UseIndex.build(graph)
    found = [value for value in graph.input if value.name not in initializers
             and declared_rank(value) == 2 and value.type.tensor_type.elem_type in _MASK_TYPES
             and _reaches_scores(value.name, uses)]
    if len(found) != 1:
        return None
    mask = found[0]
    others = [v for v in graph.input if v.name not in initializers and v.name != mask.name]
    if any(_encoder_states(value, mask) for value in others):
        return None
    # the sequence axes of the other inputs, an output along one of which is not along the
    # mask's: where an input shares the mask's axis name (its token ids), every other name
    # (a decoder's ids beside an encoder's); where none does, the exporter named each tensor
    # apart (dynamo's s53 and s70), and the mask's own tokens (ids, token types, positions:
    # rank-2 integers) are not another sequence
    named = _dim_name(mask, 1)
    sequences = [v for v in others if (declared_rank(v) or 0) >= 2]
    alike = bool(named) and any(_dim_name(v, 1) == named for v in sequences)
    apart = {_dim_name(v, 1) for v in sequences if alike or not _companion(v)} - {"", named}
    tokens = ({named} | {_dim_name(v, 1) for v in others if _companion(v)}) - {""}
    outputs = frozenset(o.name for o in graph.output if _has_positions(o, apart, tokens))
    return AttentionMask(mask.name, outputs) if outputs else None


def _reaches_scores(value: str, uses: UseIndex) -> bool:
    pending, seen = [value], {value}
    while pending:
        for use in uses.uses.get(pending.pop(), ()):
            node = use.node
            if node.domain not in (*DEFAULT_DOMAINS, "com.microsoft"):
                continue
            if node.op_type in _SOFTMAXES or (node.op_type in _ATTENTION and use.slot > 0):
                return True
            if node.op_type in _MASK_OPS or (node.op_type in _GATHERS and use.slot == 0):
                for out in node.output:
                    if out and out not in seen:
                        seen.add(out)
                        pending.append(out)
    return False


def _has_positions(output: onnx.ValueInfoProto, apart: set[str], tokens: set[str]) -> bool:
    """One row per position: rank 3 or more, that axis not named as another sequence's, or
    rank 2 whose second axis has the name of the mask's or its tokens' (torch.onnx names a
    sentence embedding's 384 values `Divsentence_embedding_dim_1` when it loses their count)."""
    rank = declared_rank(output)
    if rank is None or rank < 2 or _dim_name(output, 1) in apart:
        return False
    return rank > 2 or _dim_name(output, 1) in tokens


def _companion(value: onnx.ValueInfoProto) -> bool:
    """A rank-2 integer input: token ids, token types or positions beside the mask."""
    return declared_rank(value) == 2 and value.type.tensor_type.elem_type in _INTEGER_TYPES


def _encoder_states(value: onnx.ValueInfoProto, mask: onnx.ValueInfoProto) -> bool:
    """A float input of rank 3 whose second axis may be the mask's: an encoder's states,
    which a decoder's cross-attention masks by it; the decoder's outputs run along another
    sequence, of the same length or not (a decoder step exported with static shapes)."""
    if declared_rank(value) != 3 or value.type.tensor_type.elem_type not in _FLOAT_TYPES:
        return False
    ours, theirs = value.type.tensor_type.shape.dim[1], mask.type.tensor_type.shape.dim[1]
    if ours.HasField("dim_value") and theirs.HasField("dim_value"):
        return bool(ours.dim_value == theirs.dim_value)
    return True


def _dim_name(value: onnx.ValueInfoProto, axis: int) -> str:
    dim = value.type.tensor_type.shape.dim[axis]
    return dim.dim_param if dim.HasField("dim_param") else ""
