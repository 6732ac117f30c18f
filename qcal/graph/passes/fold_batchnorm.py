"""Pass: fold BatchNormalization (inference mode) that directly follows a Conv, or a Gemm (a
BatchNorm1d after a Linear), into it.

With ``s = scale / sqrt(var + epsilon)`` per output channel ``m``::

    W'[m] = W[m] * s[m]            b'[m] = (b[m] - mean[m]) * s[m] + B[m]

computed in float64 and rounded once to the weight's type, so the folded Conv matches
Conv followed by BatchNormalization to float rounding. Quantizing the folded weight is what a
deployed model sees; quantizing before folding would misplace the BN scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.passes._folding import FOLDABLE_TYPES, add_bias, along_channels, store_input
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    drop_unread_initializers,
    drop_value_info,
    float_attribute,
    int_attribute,
)

__all__ = ["FoldBatchNorm"]

_DEFAULT_EPSILON = 1e-5


class FoldBatchNorm:
    """Fold each foldable Conv (or Gemm) -> BatchNormalization pair of the main graph.

    A pair folds when: the Conv output is read by the BatchNormalization only (and is not a
    graph output); the Conv weight, its bias (if any) and the four BN parameters are
    initializers no graph input overrides; BN runs in inference mode with one output; the BN
    parameters have one value per Conv output channel. A Gemm folds when alpha and beta are 1,
    A is not transposed and its bias C (if any) holds one value per output channel. A weight or
    bias that other nodes also read is copied under a new name rather than changed in place.
    Then a BatchNormalization spelled as a Mul and an Add by per-channel constants folds the
    same way (`_fold_channel_affines`).
    """

    name: ClassVar[str] = "fold-batchnorm"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        names = NameAllocator.from_model(model)
        folded: set[int] = set()  # positions of the BN nodes removed
        gemms = 0
        maybe_unread: set[str] = set()  # initializers a fold may have left without readers
        for bn_position, bn in enumerate(graph.node):
            conv = _foldable_conv(bn, index)
            if conv is None:
                continue
            maybe_unread.update(bn.input[1:])
            maybe_unread.update(conv.input[1:])
            _fold(graph, index, names, conv, bn)
            folded.add(bn_position)
            gemms += conv.op_type == "Gemm"
        kept = [n for p, n in enumerate(graph.node) if p not in folded]
        del graph.node[:]
        graph.node.extend(kept)
        affines, constants = _fold_channel_affines(graph, names)
        if not folded and not affines:
            return StepResult(model, False)
        drop_unread_initializers(graph, maybe_unread | constants)
        details = []
        if folded:
            count = len(folded)
            details.append(f"folded {count} BatchNormalization{'s' * (count != 1)} into Conv"
                           + ("/Gemm" if gemms else ""))
        if affines:
            details.append(f"folded {affines} per-channel Mul/Add into Conv/Gemm/MatMul")
        return StepResult(model, True, "; ".join(details))


def _foldable_conv(bn: onnx.NodeProto, index: UseIndex) -> onnx.NodeProto | None:
    if bn.op_type != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS:
        return None
    if len(bn.input) != 5 or any(bn.output[1:]) or int_attribute(bn, "training_mode", 0):
        return None
    if not int_attribute(bn, "spatial", 1):  # opset < 9: per-activation statistics
        return None
    conv = index.producer.get(bn.input[0])
    channels = _output_channels(conv, index)
    if conv is None or channels is None or conv.op_type == "MatMul":
        return None
    for value in bn.input[1:]:
        parameter = index.constant(value)
        if parameter is None or parameter.data_type not in FOLDABLE_TYPES:
            return None
        if int(np.prod(parameter.dims)) != channels:
            return None
    return conv


def _output_channels(conv: onnx.NodeProto | None, index: UseIndex) -> int | None:
    """The output channels of a Conv, Gemm or MatMul (by a constant matrix) whose output only
    one node reads and whose weight and bias can take a per-channel scale and shift; None for
    any other node."""
    if (conv is None or conv.op_type not in ("Conv", "Gemm", "MatMul")
            or conv.domain not in DEFAULT_DOMAINS):
        return None
    if conv.op_type == "Gemm" and (
        float_attribute(conv, "alpha", 1.0) != 1.0 or float_attribute(conv, "beta", 1.0) != 1.0
        or int_attribute(conv, "transA", 0)
    ):
        return None
    conv_output = conv.output[0]
    if conv_output in index.graph_outputs or len(index.uses.get(conv_output, ())) != 1:
        return None
    weight = index.constant(conv.input[1]) if len(conv.input) > 1 else None
    if weight is None or weight.data_type not in FOLDABLE_TYPES or not weight.dims:
        return None
    if conv.op_type == "MatMul" and len(weight.dims) != 2:
        return None  # a stack of matrices, or a vector
    channels = int(weight.dims[_output_axis(conv)]) if len(weight.dims) > 1 else -1
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    if has_bias:
        bias = index.constant(conv.input[2])
        if bias is None or (conv.op_type == "Gemm" and list(bias.dims) != [channels]):
            return None
    return channels


@dataclass(frozen=True)
class _Layer:
    """What a per-channel Mul/Add folds into: `node` (Conv, Gemm or MatMul, its weight at input
    1), its output channels, the rank of the value read (None: the channels are its last axis,
    a MatMul's) and where its bias is (None: a Conv's or Gemm's input 2; a MatMul's bias Add)."""

    node: onnx.NodeProto
    channels: int
    rank: int | None
    bias_at: tuple[onnx.NodeProto, int] | None = None


def _fold_channel_affines(graph: onnx.GraphProto, names: NameAllocator) -> tuple[int, set[str]]:
    """Fold every Mul or Add by one constant per output channel (or one for all) that reads a
    Conv's or Gemm's output, directly or through a Squeeze of spatial axes, or a MatMul's by a
    constant matrix (a Mul, or an Add after its bias Add): Keras writes a BatchNormalization
    after a Conv1D (a Conv between Unsqueeze and Squeeze in ONNX) or a Dense as a Mul and an
    Add. Returns the count and the constants they read."""
    count, constants = 0, set[str]()
    while True:
        index = UseIndex.build(graph)
        found = next(((node, hit) for node in graph.node
                      if (hit := _channel_affine(node, index)) is not None), None)
        if found is None:
            return count, constants
        node, (layer, source, values) = found
        constants.update(v for v in node.input if v != source)
        if node.op_type == "Mul":
            _scale_and_shift(graph, index, names, layer.node, values, np.zeros_like(values),
                             bias_at=layer.bias_at)
        else:
            _scale_and_shift(graph, index, names, layer.node, np.ones_like(values), values,
                             bias_at=layer.bias_at)
        _rename_output(graph, index.producer[source], node.output[0])
        graph.node.remove(node)
        count += 1


def _channel_affine(
    node: onnx.NodeProto, index: UseIndex
) -> tuple[_Layer, str, np.ndarray] | None:
    """For a Mul/Add that `_fold_channel_affines` folds: the layer, the value the node reads
    from it, and the node's constant per output channel (float64)."""
    if (node.op_type not in ("Mul", "Add") or node.domain not in DEFAULT_DOMAINS
            or len(node.input) != 2 or len(node.output) != 1):
        return None
    for slot in (0, 1):
        source, constant = node.input[slot], index.constant(node.input[1 - slot])
        if constant is None or constant.data_type not in FOLDABLE_TYPES:
            continue
        if source in index.graph_outputs or len(index.uses.get(source, ())) != 1:
            continue
        layer = _layer_behind(source, index)
        if layer is None or (node.op_type == "Add" and layer.node.op_type == "MatMul"
                             and layer.bias_at is None):
            continue  # an Add right after a MatMul is its bias: nothing to fold it into
        values = _per_channel(constant, layer)
        if values is not None:
            return layer, source, values
    return None


def _per_channel(constant: onnx.TensorProto, layer: _Layer) -> np.ndarray | None:
    """The constant's value per output channel (float64), if it holds one per channel or one
    for all, along the layer's channel axis."""
    if layer.rank is not None:
        return along_channels(constant, layer.rank, layer.channels)
    # the last axis; no more axes than a matrix, or it would broadcast
    dims = [int(d) for d in constant.dims]
    if len(dims) > 2 or any(d != 1 for d in dims[:-1]):
        return None
    if (dims[-1] if dims else 1) not in (1, layer.channels):
        return None
    values = tensor_array(constant).astype(np.float64).reshape(-1)
    per_channel: np.ndarray = np.broadcast_to(values, (layer.channels,)).copy()
    return per_channel


def _layer_behind(source: str, index: UseIndex) -> _Layer | None:
    """The layer writing `source`: a Conv or Gemm, a Squeeze of only a Conv's spatial axes,
    a MatMul by a constant matrix, or the bias Add after such a MatMul."""
    producer = index.producer.get(source)
    if producer is None or producer.domain not in DEFAULT_DOMAINS:
        return None
    if producer.op_type == "Squeeze":
        axes = index.constant(producer.input[1]) if len(producer.input) == 2 else None
        conv = index.producer.get(producer.input[0])
        channels = _output_channels(conv, index)
        if axes is None or conv is None or conv.op_type != "Conv" or channels is None:
            return None
        rank = len(_weight(conv, index).dims)
        squeezed = {int(a) % rank for a in tensor_array(axes).reshape(-1)}
        if not squeezed or min(squeezed) < 2:
            return None
        return _Layer(conv, channels, rank - len(squeezed))
    if producer.op_type == "Add" and len(producer.input) == 2:
        for slot in (0, 1):
            matmul = index.producer.get(producer.input[1 - slot])
            bias = index.constant(producer.input[slot])
            channels = _output_channels(matmul, index)
            if (matmul is None or matmul.op_type != "MatMul" or channels is None
                    or bias is None or bias.data_type not in FOLDABLE_TYPES):
                continue
            dims = [int(d) for d in bias.dims]
            if len(dims) <= 2 and dims[-1:] == [channels] and all(d == 1 for d in dims[:-1]):
                # a bias with one value per channel, stored as the Add's constant
                return _Layer(matmul, channels, None, (producer, slot))
        return None
    channels = _output_channels(producer, index)
    if channels is None:
        return None
    if producer.op_type == "MatMul":
        return _Layer(producer, channels, None)
    return _Layer(producer, channels, len(_weight(producer, index).dims)
                  if producer.op_type == "Conv" else 2)


def _weight(node: onnx.NodeProto, index: UseIndex) -> onnx.TensorProto:
    weight = index.constant(node.input[1])
    assert weight is not None  # checked by _output_channels
    return weight


def _fold(
    graph: onnx.GraphProto,
    index: UseIndex,
    names: NameAllocator,
    conv: onnx.NodeProto,
    bn: onnx.NodeProto,
) -> None:
    def values(name: str) -> np.ndarray:
        tensor = index.constant(name)
        assert tensor is not None  # checked by _foldable_conv
        return tensor_array(tensor).astype(np.float64).reshape(-1)

    scale, shift, mean, var = (values(v) for v in bn.input[1:])
    factor = scale / np.sqrt(var + float_attribute(bn, "epsilon", _DEFAULT_EPSILON))
    _scale_and_shift(graph, index, names, conv, factor, shift, before=-mean)
    _rename_output(graph, conv, bn.output[0])


def _scale_and_shift(
    graph: onnx.GraphProto, index: UseIndex, names: NameAllocator, conv: onnx.NodeProto,
    factor: np.ndarray, shift: np.ndarray, *, before: np.ndarray | None = None,
    bias_at: tuple[onnx.NodeProto, int] | None = None,
) -> None:
    """Make the Conv (Gemm, MatMul) compute (its output + `before`) x `factor` + `shift` per
    output channel: weight and bias scaled in float64 and rounded once to their type (a bias
    written when the node had none and the new one is not zero). The bias is `bias_at` (node,
    input) when given (a MatMul's bias Add), the node's input 2 otherwise."""
    bias_node, bias_slot = bias_at or (conv, 2)
    weight_tensor = index.constant(conv.input[1])
    assert weight_tensor is not None
    weight = tensor_array(weight_tensor)
    dtype = weight.dtype
    channel_shape = [1] * weight.ndim
    channel_shape[_output_axis(conv)] = -1
    new_weight = (weight.astype(np.float64) * factor.reshape(channel_shape)).astype(dtype)
    has_bias = len(bias_node.input) > bias_slot and bool(bias_node.input[bias_slot])
    bias, bias_shape = np.zeros_like(factor), [-1]
    if has_bias:
        bias_tensor = index.constant(bias_node.input[bias_slot])
        assert bias_tensor is not None
        bias_shape = [int(d) for d in bias_tensor.dims]
        bias = np.broadcast_to(tensor_array(bias_tensor).astype(np.float64).reshape(-1),
                               factor.shape)
    if before is not None:
        bias = bias + before
    new_bias = (bias * factor + shift).astype(dtype)

    store_input(graph, index, names, conv, 1, new_weight, base=f"{conv.input[1]}_folded")
    if has_bias:
        store_input(graph, index, names, bias_node, bias_slot, new_bias.reshape(bias_shape),
               base=f"{bias_node.input[bias_slot]}_folded")
    elif np.any(new_bias != 0):
        assert bias_node is conv  # a MatMul's Add is folded only into its bias
        add_bias(graph, names, conv, new_bias)


def _rename_output(graph: onnx.GraphProto, node: onnx.NodeProto, name: str) -> None:
    """`node` writes `name` (the value of the node folded into it) instead of its output."""
    old_output = node.output[0]
    node.output[0] = name
    drop_value_info(graph, {old_output})


def _output_axis(node: onnx.NodeProto) -> int:
    """The weight axis of the output channels: 0 for a Conv, by transB for a Gemm, 1 for a
    MatMul's matrix."""
    if node.op_type == "Gemm":
        return 0 if int_attribute(node, "transB", 0) else 1
    return 1 if node.op_type == "MatMul" else 0
