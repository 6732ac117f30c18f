"""Pass: fold a constant affine map that only a Conv reads into that Conv.

Some backbones put a learned affine map ``y = s x + b`` (a Mul by one scale, then an Add of
one value or one per channel) after an activation, just before the next Conv: PP-LCNetV3's
"learnable affine blocks" after each hardswish (PP-OCRv5's detector and recognizer have 23 to
25 of them). FoldBatchNorm folds those that follow a Conv into it; one that follows an
activation folds into the Conv after it instead:

* ``Conv(W, x + b)`` with ``b`` per input channel (or one for all) and no padding is
  ``Conv(W, x)`` plus ``sum W b`` per output channel: the Add goes into the bias;
* ``Conv(W, s x + b)`` with one scale ``s`` is ``Conv(s W, x + b / s)``: the Mul goes into the
  weight, and the Add (``b / s``) into the bias when the Conv does not pad, else it stays (a
  padded Conv pads ``s x + b`` with zeros, which is ``s (x + b / s)`` padded with zeros, not
  ``x`` padded).

Computed in float64 and rounded once to the weight's type, so the Conv matches the nodes it
replaces to float rounding. Quantized, those nodes would be integer Muls and Adds, each
rounding to an 8-bit grid of its own between two integer Convs, or float nodes between a
DequantizeLinear and a QuantizeLinear: PP-OCRv5's detector ran 0.53x float with them and
0.48x without (its recognizer 0.55x and 0.49x), with the same accuracy or better. A Mul alone
stays (the 0.5 that ends a GELU written out: onnxruntime fuses the GELU only with it), and so
does a scale per channel (it would make the weight's input channels unequal, which per-channel
weight quantization, per output channel, does not undo).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.passes._folding import (
    FOLDABLE_TYPES,
    add_bias,
    along_channels,
    store_input,
    tensor_size,
)
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    drop_unread_initializers,
    int_attribute,
    ints_attribute,
)

__all__ = ["FoldInputAffine"]


class FoldInputAffine:
    """Fold each Add of constants before a Conv that does not pad, and each Mul by one scale
    followed by such an Add, into the Conv (module docstring). Main graph only; the Conv's
    weight and bias must be initializers (copied under a new name when another node reads them
    too); the Mul's and the Add's outputs are read by the next node only, never graph outputs;
    an Add of one value per channel needs the declared shape of what it adds to (so that it
    cannot widen it)."""

    name: ClassVar[str] = "fold-input-affine"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        names = NameAllocator.from_model(model)
        shapes = _declared_shapes(graph)
        into_bias = kept_adds = 0
        constants: set[str] = set()
        index = UseIndex.build(graph)
        for conv in [n for n in graph.node if n.op_type == "Conv"]:
            while (found := _affine_before(conv, index, shapes)) is not None:
                add, mul = found[0], found[2]
                constants.update(v for node in (add, mul) if node is not None for v in node.input)
                removed = _fold(graph, index, names, conv, *found)
                for node in removed:
                    graph.node.remove(node)
                if _unpadded(conv):
                    into_bias += 1
                else:
                    kept_adds += 1
                index = UseIndex.build(graph)
        if not into_bias and not kept_adds:
            return StepResult(model, False)
        drop_unread_initializers(graph, constants)
        details = []
        if into_bias:
            details.append(f"folded {into_bias} Add{'s' * (into_bias != 1)} of constants "
                           "(after a Mul by one scale or not) into the Conv after it")
        if kept_adds:
            details.append(f"folded the scale of {kept_adds} Mul+Add into the padded Conv after "
                           "it (the Add stays)")
        return StepResult(model, True, "; ".join(details))


def _declared_shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Value -> its dimensions (None where not fixed), as the model declares them."""
    shapes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None
                                  for d in tensor.shape.dim]
    return shapes


def _affine_before(
    conv: onnx.NodeProto, index: UseIndex, shapes: dict[str, list[int | None]],
) -> tuple[onnx.NodeProto, np.ndarray, onnx.NodeProto | None, float] | None:
    """(the Add before `conv`, its constant per input channel, the Mul before the Add or None,
    the Mul's scale or 1) when they fold (`FoldInputAffine`), else None."""
    weight = index.constant(conv.input[1]) if len(conv.input) > 1 else None
    if (conv.domain not in DEFAULT_DOMAINS or weight is None
            or weight.data_type not in FOLDABLE_TYPES or len(weight.dims) < 3):
        return None
    if len(conv.input) > 2 and conv.input[2] and index.constant(conv.input[2]) is None:
        return None
    groups = int_attribute(conv, "group", 1)
    if groups < 1 or int(weight.dims[0]) % groups:
        return None  # not a Conv onnxruntime would run: nothing to fold into
    rank, channels = len(weight.dims), int(weight.dims[1]) * groups
    add = _only_reader_producer(conv.input[0], conv, index)
    added = _constant_operand(add, "Add", index)
    if add is None or added is None:
        return None
    source, constant = added
    shift = _per_channel(constant, rank, channels, shapes.get(source) or _shape_behind(
        source, index, rank))
    if shift is None:
        return None
    mul = _only_reader_producer(source, add, index)
    scaled = _constant_operand(mul, "Mul", index)
    if mul is not None and scaled is not None and tensor_size(scaled[1]) == 1 and (
            len(scaled[1].dims) <= 1):
        scale = float(tensor_array(scaled[1]).reshape(-1)[0])
        if scale != 0.0 and np.isfinite(scale):
            return add, shift, mul, scale
    return (add, shift, None, 1.0) if _unpadded(conv) else None


# Operators whose output has the shape of their first input when the others are constants of
# one value each.
_SHAPE_KEEPING = frozenset({
    "Relu", "LeakyRelu", "HardSwish", "HardSigmoid", "Sigmoid", "Tanh", "Clip", "Elu", "Selu",
    "Softplus", "Gelu", "Erf", "Abs", "Neg", "Mul", "Add", "Sub", "Div",
})


def _shape_behind(value: str, index: UseIndex, rank: int) -> list[int | None] | None:
    """[None, channels, None...] of `value` when it is a Conv's output of `rank`, or that
    output through operators that keep its shape (a model without declared shapes)."""
    for _ in range(16):
        producer = index.producer.get(value)
        if producer is None or producer.domain not in DEFAULT_DOMAINS:
            return None
        weight = index.constant(producer.input[1]) if len(producer.input) > 1 else None
        if producer.op_type == "Conv":
            if weight is None or len(weight.dims) != rank:
                return None
            return [None, int(weight.dims[0])] + [None] * (rank - 2)
        computed = [v for v in producer.input if v and index.constant(v) is None]
        if producer.op_type not in _SHAPE_KEEPING or len(computed) != 1 or any(
                tensor_size(c) != 1 for v in producer.input
                if v and (c := index.constant(v)) is not None):
            return None
        value = computed[0]
    return None


def _only_reader_producer(
    value: str, reader: onnx.NodeProto, index: UseIndex,
) -> onnx.NodeProto | None:
    """The node writing `value` when `reader` is all that reads it and it is not a graph
    output."""
    producer = index.producer.get(value)
    if (producer is None or value in index.graph_outputs
            or [id(n) for n in index.readers(value)] != [id(reader)]):
        return None
    return producer


def _constant_operand(
    node: onnx.NodeProto | None, op_type: str, index: UseIndex,
) -> tuple[str, onnx.TensorProto] | None:
    """(the value `node` computes on, its float constant) for a two-input `op_type` node of the
    default domain with one constant operand."""
    if (node is None or node.op_type != op_type or node.domain not in DEFAULT_DOMAINS
            or len(node.input) != 2 or len(node.output) != 1):
        return None
    for slot in (0, 1):
        constant = index.constant(node.input[1 - slot])
        if (constant is not None and constant.data_type in FOLDABLE_TYPES
                and index.constant(node.input[slot]) is None):
            return node.input[slot], constant
    return None


def _per_channel(
    constant: onnx.TensorProto, rank: int, channels: int, source: list[int | None] | None,
) -> np.ndarray | None:
    """The constant per input channel of a Conv of `rank` (float64), if it holds one value for
    all, or one per channel along axis 1 and what it is added to (`source`, its declared
    dimensions) is of that rank with those channels: an Add must not widen what it adds to."""
    one_value = tensor_size(constant) == 1 and len(constant.dims) <= 1
    if not one_value and (source is None or len(source) != rank or source[1] != channels):
        return None
    return along_channels(constant, rank, channels)


def _unpadded(conv: onnx.NodeProto) -> bool:
    auto_pad = next((a.s for a in conv.attribute if a.name == "auto_pad"), b"NOTSET")
    pads = ints_attribute(conv, "pads")
    return auto_pad in (b"NOTSET", b"VALID") and not any(pads)


def _fold(
    graph: onnx.GraphProto, index: UseIndex, names: NameAllocator, conv: onnx.NodeProto,
    add: onnx.NodeProto, shift: np.ndarray, mul: onnx.NodeProto | None, scale: float,
) -> list[onnx.NodeProto]:
    """Fold (module docstring); the nodes that go. `shift` is the Add's constant per channel,
    `scale` the Mul's (1 without one)."""
    weight_tensor = index.constant(conv.input[1])
    assert weight_tensor is not None
    stored = tensor_array(weight_tensor)
    weight, dtype = stored.astype(np.float64) * scale, stored.dtype
    removed = []
    source = next(v for v in add.input if index.constant(v) is None)
    shift = shift / scale
    if mul is not None:
        store_input(graph, index, names, conv, 1, weight.astype(dtype),
                    base=f"{conv.input[1]}_folded")
        source = next(v for v in mul.input if index.constant(v) is None)
        removed.append(mul)
    if not _unpadded(conv):  # the Add stays, of b / s, before the Conv
        slot = next(i for i, v in enumerate(add.input) if index.constant(v) is not None)
        constant = index.constant(add.input[slot])
        assert constant is not None
        values = shift if tensor_size(constant) > 1 else shift[:1]
        name = names.allocate(f"{add.input[slot]}_scaled")
        graph.initializer.append(numpy_helper.from_array(
            values.astype(tensor_array(constant).dtype).reshape([int(d) for d in constant.dims]),
            name))
        add.input[slot] = name
        add.input[1 - slot] = source
        return removed
    # into the bias: each output channel adds its weights times the shift of their inputs
    groups = int_attribute(conv, "group", 1)
    outputs, per_group = weight.shape[0], weight.shape[1]
    shifts = shift.reshape(groups, per_group)[np.arange(outputs) // (outputs // groups)]
    added = (weight * shifts.reshape(shifts.shape + (1,) * (weight.ndim - 2))).sum(
        axis=tuple(range(1, weight.ndim)))
    if len(conv.input) > 2 and conv.input[2]:
        bias_tensor = index.constant(conv.input[2])
        assert bias_tensor is not None
        bias = tensor_array(bias_tensor).astype(np.float64).reshape(-1) + added
        store_input(graph, index, names, conv, 2,
                    bias.astype(dtype).reshape([int(d) for d in bias_tensor.dims]),
                    base=f"{conv.input[2]}_folded")
    else:
        add_bias(graph, names, conv, added.astype(dtype))
    conv.input[0] = source
    return removed + [add]
