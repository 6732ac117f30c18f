"""What the passes that fold constants share: nodes replaced by the initializers they compute."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.structure import UseIndex, drop_unread_initializers

__all__ = [
    "FOLDABLE_TYPES",
    "add_bias",
    "along_channels",
    "evaluate_node",
    "fold_into_initializers",
    "store_input",
    "tensor_size",
]

# Weight types a fold computes in float64 and rounds once back to.
FOLDABLE_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
)

# A node's value from the constants it may read (None: the node stays).
ValueOf = Callable[[onnx.NodeProto, dict[str, onnx.TensorProto]], "np.ndarray | None"]


def fold_into_initializers(model: onnx.ModelProto, value_of: ValueOf) -> int:
    """Replace each main-graph node that reads constants alone and whose value `value_of`
    computes by an initializer of its output's name, in graph order: the constants it is given
    (initializers that are not graph inputs) include what folded before it, so chains fold in
    one run. A graph output never
    folds; once something has, the initializers nothing reads any more go. Returns how many
    nodes folded."""
    graph = model.graph
    inputs = {v.name for v in graph.input}
    constants = {t.name: t for t in graph.initializer if t.name not in inputs}
    outputs = {v.name for v in graph.output}
    folded: list[onnx.TensorProto] = []
    kept = []
    for node in graph.node:
        value = None
        if (node.output and node.output[0] not in outputs and node.input
                and all(not v or v in constants for v in node.input)):
            value = value_of(node, constants)
        if value is None:
            kept.append(node)
            continue
        tensor = numpy_helper.from_array(value, node.output[0])
        constants[tensor.name] = tensor
        folded.append(tensor)
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(folded)
        drop_unread_initializers(graph, {t.name for t in graph.initializer})
    return len(folded)


def evaluate_node(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
                  opset: int) -> np.ndarray | None:
    """What `node` computes from `constants` (every input it reads is one), by onnx's reference
    evaluator; None when the reference cannot run it."""
    feeds = {f"in{i}": tensor_array(constants[v]) for i, v in enumerate(node.input) if v}
    single = helper.make_node(
        node.op_type, [f"in{i}" if v else "" for i, v in enumerate(node.input)], ["out"],
        domain=node.domain)
    single.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [single], "fold",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype),
                                       array.shape) for name, array in feeds.items()],
        [helper.make_tensor_value_info("out", onnx.TensorProto.UNDEFINED, None)])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        from onnx.reference import ReferenceEvaluator

        # Quietly, as onnxruntime computes it: a log of 0 or a cast of inf where a Where then
        # takes the other branch (T5's relative-position buckets) is no error; the library
        # never prints.
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results: Any = ReferenceEvaluator(probe).run(None, dict(feeds))  # arrays
        return np.asarray(results[0])
    except Exception:  # noqa: BLE001  an operator the reference cannot run stays as it is
        return None


def tensor_size(tensor: onnx.TensorProto) -> int:
    """How many values `tensor` holds, from its dimensions."""
    return math.prod(int(d) for d in tensor.dims)


def store_input(
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


def add_bias(graph: onnx.GraphProto, names: NameAllocator, conv: onnx.NodeProto,
             values: np.ndarray) -> None:
    """Give a Conv or Gemm that has none the bias `values` (a new initializer, input 2)."""
    name = names.allocate(f"{conv.name or 'conv'}_bias")
    graph.initializer.append(numpy_helper.from_array(values, name))
    while len(conv.input) < 2:
        conv.input.append("")
    conv.input.append(name)


def along_channels(constant: onnx.TensorProto, rank: int, channels: int) -> np.ndarray | None:
    """The constant's value per channel (float64), if it holds one value for all or one per
    channel along axis 1 of a value of `rank` (its dimensions aligned right, as ONNX
    broadcasts)."""
    dims = [int(d) for d in constant.dims]
    dims = [1] * (rank - len(dims)) + dims
    if len(dims) != rank or dims[1] not in (1, channels) or any(
            d != 1 for axis, d in enumerate(dims) if axis != 1):
        return None
    values = tensor_array(constant).astype(np.float64).reshape(-1)
    per_channel: np.ndarray = np.broadcast_to(values, (channels,)).copy()
    return per_channel
