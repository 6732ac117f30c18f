"""SmoothQuant's graph side: which MatMul/Gemm inputs can be smoothed, and the rewrite.

SmoothQuant (Xiao et al. 2022) divides input channel j of a layer's activation X by ``s_j`` and
multiplies row j of its constant weight W by ``s_j``: ``(X / s) (s W) = X W``, while the
activation's outlier channels shrink and the weight, easier to quantize, takes them. The scales
come from data (`qcal.numerics.smoothing`); this module finds where they can go and puts them
there.

A target is an activation X all of whose readers are MatMul (X as A, a float32 2-D initializer as
B) or Gemm (X as A, ``transA=0``, a float32 2-D initializer as B) with their own weights: one
scale per channel serves them all (the weights' magnitudes are combined). The division is folded
into what computes X, so no node is added (a Mul inserted before the layers would itself have
its input quantized, outliers and all):

* a LayerNormalization over the last axis with constant scale (and bias): both are divided;
* a chain of Add-by-constant ending in a Mul-by-constant (a decomposed LayerNormalization's
  ``x * gamma + beta``): every constant is divided. The constants must have one value, or one
  per channel along the last axis, and each value on the chain one reader.

Anything else (a graph input, a Relu, GELU, ...) is not a target. All constants changed are
float32 initializers read only by the node that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, int_attribute

__all__ = ["SmoothTarget", "apply_smoothing", "find_smooth_targets"]

_FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class SmoothTarget:
    """One activation to smooth and the layers reading it.

    Attributes:
        activation: the tensor X (its last axis holds the `channels`).
        channels: K, the layers' common input width.
        layers: the reading nodes' names, in graph order.
        weights: their weight initializers, with whether each is stored transposed ((N, K),
            Gemm ``transB=1``) rather than (K, N).
        divided: the initializers that absorb the division (LayerNormalization scale and bias,
            or the chain's constants).
    """

    activation: str
    channels: int
    layers: tuple[str, ...]
    weights: tuple[tuple[str, bool], ...]
    divided: tuple[str, ...]


def find_smooth_targets(model: onnx.ModelProto) -> list[SmoothTarget]:
    """Every activation of the main graph that can be smoothed, in graph order."""
    graph = model.graph
    index = UseIndex.build(graph)
    targets = []
    seen: set[str] = set()
    for node in graph.node:
        if not node.input or node.input[0] in seen or node.op_type not in ("MatMul", "Gemm"):
            continue
        seen.add(node.input[0])
        target = _target(node.input[0], index)
        if target is not None:
            targets.append(target)
    return targets


def apply_smoothing(model: onnx.ModelProto, target: SmoothTarget, scale: np.ndarray) -> None:
    """Divide `target`'s activation by `scale` (float64, one per channel) and multiply its weights'
    rows by it, each constant rounded once to float32."""
    tensors = {t.name: t for t in model.graph.initializer}
    for name, transposed in target.weights:
        weight = tensor_array(tensors[name]).astype(np.float64)
        weight *= scale[None, :] if transposed else scale[:, None]
        _store(tensors[name], weight)
    for name in target.divided:
        constant = tensor_array(tensors[name]).astype(np.float64)
        shape = constant.shape[:-1] + (target.channels,) if constant.ndim else (target.channels,)
        _store(tensors[name], np.broadcast_to(constant, shape) / scale)


def _store(tensor: onnx.TensorProto, array: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array, np.float32), tensor.name))


def _target(activation: str, index: UseIndex) -> SmoothTarget | None:
    if activation in index.graph_outputs or activation in index.initializers:
        return None
    uses = index.uses.get(activation, ())
    if not uses or any(use.slot != 0 for use in uses) or len(index.readers(activation)) != len(uses):
        return None
    weights = []
    channels = None
    for use in uses:
        found = _layer_weight(use.node, index)
        if found is None:
            return None
        name, transposed, width = found
        if channels not in (None, width):
            return None
        channels = width
        weights.append((name, transposed))
    assert channels is not None
    divided = _divided_by(activation, channels, index)
    if divided is None:
        return None
    return SmoothTarget(activation, channels, tuple(u.node.name for u in uses), tuple(weights),
                        divided)


def _layer_weight(node: onnx.NodeProto, index: UseIndex) -> tuple[str, bool, int] | None:
    """(weight name, stored transposed, input width K) of a MatMul/Gemm with its own weight."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
        return None
    if len(node.input) < 2 or not _own_float(node.input[1], index):
        return None
    weight = index.constant(node.input[1])
    assert weight is not None
    if len(weight.dims) != 2:
        return None
    transposed = False
    if node.op_type == "Gemm":
        if int_attribute(node, "transA", 0):
            return None
        transposed = bool(int_attribute(node, "transB", 0))
    return node.input[1], transposed, int(weight.dims[1] if transposed else weight.dims[0])


def _divided_by(activation: str, channels: int, index: UseIndex) -> tuple[str, ...] | None:
    """The constants that absorb the division of `activation`, or None when nothing can."""
    producer = index.producer.get(activation)
    if producer is not None and producer.op_type == "LayerNormalization" \
            and producer.domain in DEFAULT_DOMAINS:
        if int_attribute(producer, "axis", -1) != -1 or any(producer.output[1:]):
            return None
        names = [n for n in producer.input[1:3] if n]
        if not all(_channel_constant(n, channels, index, exact=True) for n in names):
            return None
        return tuple(names)
    divided: list[str] = []
    value = activation
    while producer is not None and producer.domain in DEFAULT_DOMAINS \
            and producer.op_type in ("Add", "Mul") and len(producer.input) == 2:
        constants = [n for n in producer.input if _channel_constant(n, channels, index)]
        if len(constants) != 1:
            return None
        divided.append(constants[0])
        if producer.op_type == "Mul":
            return tuple(divided)
        value = next(n for n in producer.input if n != constants[0])
        if value in index.graph_outputs or len(index.uses.get(value, ())) != 1:
            return None
        producer = index.producer.get(value)
    return None


def _channel_constant(name: str, channels: int, index: UseIndex, *, exact: bool = False) -> bool:
    """A float32 initializer of this node alone with one value, or one per channel along the
    last axis (exactly shape (K,) with `exact`)."""
    if not _own_float(name, index):
        return False
    tensor = index.constant(name)
    assert tensor is not None
    dims = list(tensor.dims)
    if exact:
        return dims == [channels]
    size = int(np.prod(dims)) if dims else 1
    return size == 1 or (dims[-1] == channels and size == channels)


def _own_float(name: str, index: UseIndex) -> bool:
    tensor = index.constant(name)
    return (tensor is not None and tensor.data_type == _FLOAT and name not in index.graph_outputs
            and len(index.uses.get(name, ())) == 1)


