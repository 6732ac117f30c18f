"""Pass: fold BatchNormalization (inference mode) that directly follows a Conv, or a Gemm (a
BatchNorm1d after a Linear), into it.

With ``s = scale / sqrt(var + epsilon)`` per output channel ``m``::

    W'[m] = W[m] * s[m]            b'[m] = (b[m] - mean[m]) * s[m] + B[m]

computed in float64 and rounded once to the weight's type, so the folded Conv matches
Conv followed by BatchNormalization to float rounding. Quantizing the folded weight is what a
deployed model sees; quantizing before folding would misplace the BN scale.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, int_attribute

__all__ = ["FoldBatchNorm"]

_DEFAULT_EPSILON = 1e-5
_FOLDABLE_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
)


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
        _drop_unread_initializers(graph, maybe_unread | constants)
        details = []
        if folded:
            count = len(folded)
            details.append(f"folded {count} BatchNormalization{'s' * (count != 1)} into Conv"
                           + ("/Gemm" if gemms else ""))
        if affines:
            details.append(f"folded {affines} per-channel Mul/Add into Conv/Gemm")
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
    if conv is None or channels is None:
        return None
    for value in bn.input[1:]:
        parameter = index.constant(value)
        if parameter is None or parameter.data_type not in _FOLDABLE_TYPES:
            return None
        if int(np.prod(parameter.dims)) != channels:
            return None
    return conv


def _output_channels(conv: onnx.NodeProto | None, index: UseIndex) -> int | None:
    """The output channels of a Conv or Gemm whose output only one node reads and whose
    weight and bias can take a per-channel scale and shift; None for any other node."""
    if conv is None or conv.op_type not in ("Conv", "Gemm") or conv.domain not in DEFAULT_DOMAINS:
        return None
    if conv.op_type == "Gemm" and (
        _float_attribute(conv, "alpha", 1.0) != 1.0 or _float_attribute(conv, "beta", 1.0) != 1.0
        or int_attribute(conv, "transA", 0)
    ):
        return None
    conv_output = conv.output[0]
    if conv_output in index.graph_outputs or len(index.uses.get(conv_output, ())) != 1:
        return None
    weight = index.constant(conv.input[1]) if len(conv.input) > 1 else None
    if weight is None or weight.data_type not in _FOLDABLE_TYPES or not weight.dims:
        return None
    channels = int(weight.dims[_output_axis(conv)]) if len(weight.dims) > 1 else -1
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    if has_bias:
        bias = index.constant(conv.input[2])
        if bias is None or (conv.op_type == "Gemm" and list(bias.dims) != [channels]):
            return None
    return channels


def _fold_channel_affines(graph: onnx.GraphProto, names: NameAllocator) -> tuple[int, set[str]]:
    """Fold every Mul or Add by one constant per output channel (or one for all) that reads a
    Conv's or Gemm's output, directly or through a Squeeze of spatial axes: Keras writes a
    BatchNormalization after a Conv1D (a Conv between Unsqueeze and Squeeze in ONNX) or a
    Dense as a Mul and an Add. Returns the count and the constants they read."""
    count, constants = 0, set[str]()
    while True:
        index = UseIndex.build(graph)
        found = next(((node, hit) for node in graph.node
                      if (hit := _channel_affine(node, index)) is not None), None)
        if found is None:
            return count, constants
        node, (conv, source, values) = found
        constants.update(v for v in node.input if v != source)
        if node.op_type == "Mul":
            _scale_and_shift(graph, index, names, conv, values, np.zeros_like(values))
        else:
            _scale_and_shift(graph, index, names, conv, np.ones_like(values), values)
        _rename_output(graph, index.producer[source], node.output[0])
        graph.node.remove(node)
        count += 1


def _channel_affine(
    node: onnx.NodeProto, index: UseIndex
) -> tuple[onnx.NodeProto, str, np.ndarray] | None:
    """For a Mul/Add that `_fold_channel_affines` folds: the Conv/Gemm, the value the node
    reads from it, and the node's constant per output channel (float64)."""
    if (node.op_type not in ("Mul", "Add") or node.domain not in DEFAULT_DOMAINS
            or len(node.input) != 2 or len(node.output) != 1):
        return None
    for slot in (0, 1):
        source, constant = node.input[slot], index.constant(node.input[1 - slot])
        if constant is None or constant.data_type not in _FOLDABLE_TYPES:
            continue
        if source in index.graph_outputs or len(index.uses.get(source, ())) != 1:
            continue
        behind = _conv_behind(source, index)
        if behind is None:
            continue
        conv, rank, channels = behind
        dims = [1] * (rank - len(constant.dims)) + [int(d) for d in constant.dims]
        if len(dims) != rank or any(d != 1 for axis, d in enumerate(dims) if axis != 1):
            continue
        if dims[1] not in (1, channels):
            continue
        values = tensor_array(constant).astype(np.float64).reshape(-1)
        return conv, source, np.broadcast_to(values, (channels,)).copy()
    return None


def _conv_behind(source: str, index: UseIndex) -> tuple[onnx.NodeProto, int, int] | None:
    """The Conv/Gemm writing `source` (or a Squeeze of only its spatial axes that does), the
    rank of `source` and the output channels."""
    producer = index.producer.get(source)
    if producer is None:
        return None
    if producer.op_type == "Squeeze" and producer.domain in DEFAULT_DOMAINS:
        axes = index.constant(producer.input[1]) if len(producer.input) == 2 else None
        conv = index.producer.get(producer.input[0])
        channels = _output_channels(conv, index)
        if axes is None or conv is None or conv.op_type != "Conv" or channels is None:
            return None
        weight = index.constant(conv.input[1])
        assert weight is not None
        rank = len(weight.dims)
        squeezed = {int(a) % rank for a in tensor_array(axes).reshape(-1)}
        if not squeezed or min(squeezed) < 2:
            return None
        return conv, rank - len(squeezed), channels
    channels = _output_channels(producer, index)
    if channels is None:
        return None
    weight = index.constant(producer.input[1])
    assert weight is not None
    return producer, len(weight.dims) if producer.op_type == "Conv" else 2, channels


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
    factor = scale / np.sqrt(var + _float_attribute(bn, "epsilon", _DEFAULT_EPSILON))
    _scale_and_shift(graph, index, names, conv, factor, shift, before=-mean)
    _rename_output(graph, conv, bn.output[0])


def _scale_and_shift(
    graph: onnx.GraphProto, index: UseIndex, names: NameAllocator, conv: onnx.NodeProto,
    factor: np.ndarray, shift: np.ndarray, *, before: np.ndarray | None = None,
) -> None:
    """Make the Conv (Gemm) compute (its output + `before`) x `factor` + `shift` per output
    channel: weight and bias scaled in float64 and rounded once to their type (a bias written
    when the node had none and the new one is not zero)."""
    weight_tensor = index.constant(conv.input[1])
    assert weight_tensor is not None
    weight = tensor_array(weight_tensor)
    dtype = weight.dtype
    channel_shape = [1] * weight.ndim
    channel_shape[_output_axis(conv)] = -1
    new_weight = (weight.astype(np.float64) * factor.reshape(channel_shape)).astype(dtype)
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    bias = np.zeros_like(factor)
    if has_bias:
        bias_tensor = index.constant(conv.input[2])
        assert bias_tensor is not None
        bias = tensor_array(bias_tensor).astype(np.float64).reshape(-1)
    if before is not None:
        bias = bias + before
    new_bias = (bias * factor + shift).astype(dtype)

    _store(graph, index, names, conv, 1, new_weight, base=f"{conv.input[1]}_folded")
    if has_bias:
        _store(graph, index, names, conv, 2, new_bias, base=f"{conv.input[2]}_folded")
    elif np.any(new_bias != 0):
        name = names.allocate(f"{conv.name or 'conv'}_bias")
        graph.initializer.append(numpy_helper.from_array(new_bias, name))
        while len(conv.input) < 2:
            conv.input.append("")
        conv.input.append(name)


def _rename_output(graph: onnx.GraphProto, node: onnx.NodeProto, name: str) -> None:
    """`node` writes `name` (the value of the node folded into it) instead of its output."""
    old_output = node.output[0]
    node.output[0] = name
    stale = [v for v in graph.value_info if v.name == old_output]
    for value_info in stale:
        graph.value_info.remove(value_info)


def _output_axis(node: onnx.NodeProto) -> int:
    """The weight axis of the output channels: 0 for a Conv, by transB for a Gemm."""
    if node.op_type == "Gemm":
        return 0 if int_attribute(node, "transB", 0) else 1
    return 0


def _store(
    graph: onnx.GraphProto,
    index: UseIndex,
    names: NameAllocator,
    conv: onnx.NodeProto,
    slot: int,
    array: np.ndarray,
    *,
    base: str,
) -> None:
    """Write `array` as the Conv's input `slot`: in place when only this Conv reads it."""
    current = conv.input[slot]
    tensor = index.constant(current)
    assert tensor is not None
    if len(index.readers(current)) == 1 and current not in index.graph_outputs:
        tensor.CopyFrom(numpy_helper.from_array(array, current))
        return
    name = names.allocate(base)
    graph.initializer.append(numpy_helper.from_array(array, name))
    conv.input[slot] = name


def _drop_unread_initializers(graph: onnx.GraphProto, candidates: set[str]) -> None:
    """Remove the `candidates` nothing reads any more (other initializers are never touched)."""
    index = UseIndex.build(graph)
    unread = [
        t
        for t in graph.initializer
        if t.name in candidates and t.name not in index.uses and t.name not in index.graph_outputs
    ]
    for tensor in unread:
        graph.initializer.remove(tensor)


def _float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    for attribute in node.attribute:
        if attribute.name == name:
            return float(attribute.f)
    return default
