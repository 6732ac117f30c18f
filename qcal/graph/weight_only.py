"""Weight-only 4-bit models: which MatMul/Gemm weights qualify, and the model with them written
as onnxruntime's MatMulNBits or as an int4 DequantizeLinear (opset 21 block quantization).

Activations stay float: a MatMul ``A @ W`` becomes ``MatMulNBits(A, packed W, scales, zero
points)`` (com.microsoft), or keeps its MatMul with ``W`` replaced by ``DequantizeLinear`` of
uint4 codes with a scale and zero point per block of inputs. Every other node is left as it is.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcal.graph.names import NameAllocator
from qcal.graph.qdq import integer_tensor
from qcal.graph.structure import all_graphs
from qcal.numerics.blockwise import BITS, BlockQuant, pack_nibbles
from qcal.numerics.errors import ConfigError, ModelError

__all__ = [
    "DEFAULT_BLOCK_SIZE", "FORMATS", "QDQ_OPSET", "WEIGHT_ONLY", "WeightOnlyTarget",
    "check_weight_only_options", "weight_only_targets", "write_weight_only",
]

FORMATS = ("matmulnbits", "qdq")
QDQ_OPSET = 21  # DequantizeLinear with uint4 and block_size
WEIGHT_ONLY = ("int4",)
DEFAULT_BLOCK_SIZE = 32
_MS_DOMAIN = "com.microsoft"


def check_weight_only_options(weight_only: str | None, block_size: int, fmt: str) -> None:
    """ConfigError naming the option when one of the weight-only options has no meaning."""
    if weight_only is not None and weight_only not in WEIGHT_ONLY:
        raise ConfigError(f"weight-only: unknown {weight_only!r}; choose one of "
                          f"{', '.join(WEIGHT_ONLY)}")
    if isinstance(block_size, bool) or block_size < 16 or block_size & (block_size - 1):
        raise ConfigError(f"block-size: {block_size} must be a power of 2, at least 16")
    if fmt not in FORMATS:
        raise ConfigError(f"weight-only-format: unknown {fmt!r}; choose one of "
                          f"{', '.join(FORMATS)}")
    if weight_only is None and (block_size != DEFAULT_BLOCK_SIZE or fmt != FORMATS[0]):
        option = "block-size" if block_size != DEFAULT_BLOCK_SIZE else "weight-only-format"
        raise ConfigError(f"{option}: applies to --weight-only runs alone (add --weight-only int4)")


@dataclass(frozen=True)
class WeightOnlyTarget:
    """A node whose constant 2-D weight goes to 4 bits.

    Attributes:
        node, op_type: the MatMul or Gemm.
        weight: its second input, an initializer.
        transposed: the weight is stored ``(N, K)`` (Gemm with transB), else ``(K, N)``.
        inputs, outputs: K and N.
    """

    node: str
    op_type: str
    weight: str
    transposed: bool
    inputs: int
    outputs: int


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def weight_only_targets(
    model: onnx.ModelProto, *, op_types: Sequence[str] = (), exclude_op_types: Sequence[str] = (),
    exclude_nodes: Sequence[str] = (),
) -> list[WeightOnlyTarget]:
    """The main graph's MatMul nodes whose second input is a constant 2-D float32 weight, and
    its Gemm nodes whose B is one (transA = 0, alpha = 1, beta = 1 or no C), in graph order,
    less those the selection options leave float."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    overridable = {i.name for i in graph.input}  # an initializer fed as input is not constant
    targets = []
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        if (op_types and node.op_type not in op_types) or node.op_type in exclude_op_types:
            continue
        if any(fnmatch.fnmatchcase(node.name, pattern) for pattern in exclude_nodes):
            continue
        weight = initializers.get(node.input[1])
        if (weight is None or node.input[1] in overridable or len(weight.dims) != 2
                or weight.data_type != TensorProto.FLOAT or node.input[0] in initializers):
            continue
        attrs = _attributes(node)
        transposed = False
        if node.op_type == "Gemm":
            has_c = len(node.input) > 2 and node.input[2] != ""
            if (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                    or (has_c and attrs.get("beta", 1.0) != 1.0)):
                continue
            transposed = bool(attrs.get("transB", 0))
        k, n = (weight.dims[1], weight.dims[0]) if transposed else tuple(weight.dims)
        targets.append(WeightOnlyTarget(node.name, node.op_type, node.input[1], transposed,
                                        int(k), int(n)))
    return targets


def _array(name: str, values: np.ndarray) -> TensorProto:
    return onnx.numpy_helper.from_array(np.ascontiguousarray(values), name)


def write_weight_only(
    model: onnx.ModelProto, targets: Sequence[WeightOnlyTarget], quants: Mapping[str, BlockQuant],
    fmt: str,
) -> onnx.ModelProto:
    """A copy of `model` with each target (keyed by node in `quants`) reading its 4-bit weight
    in format `fmt` ("matmulnbits" or "qdq"); weights nobody reads any more are dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = NameAllocator.from_model(out)
    by_node = {t.node: t for t in targets if t.node in quants}
    if fmt == "qdq":
        opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < QDQ_OPSET:
            raise ModelError(f"weight-only qdq needs opset {QDQ_OPSET} (the model has {opset})")
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        target = by_node.get(node.name)
        if target is None:
            new_nodes.append(node)
        elif fmt == "matmulnbits":
            new_nodes += _matmulnbits(node, target, quants[node.name], graph, names)
        else:
            new_nodes += _dequantized(node, target, quants[node.name], graph, names)
    del graph.node[:]
    graph.node.extend(new_nodes)
    if fmt == "matmulnbits" and by_node and not any(o.domain == _MS_DOMAIN
                                                   for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    read = {name for g in all_graphs(graph) for n in g.node for name in n.input}
    read |= {o.name for o in graph.output}
    kept = [i for i in graph.initializer
            if i.name in read or i.name not in {t.weight for t in by_node.values()}]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return out


def _matmulnbits(
    node: onnx.NodeProto, target: WeightOnlyTarget, quant: BlockQuant, graph: onnx.GraphProto,
    names: NameAllocator,
) -> list[onnx.NodeProto]:
    base = target.weight
    packed = _array(names.allocate(f"{base}_MatMul_{BITS}bits"), pack_nibbles(quant.codes))
    scales = _array(names.allocate(f"{base}_MatMul_{BITS}bits_scale"), quant.scales.reshape(-1))
    zeros = _array(names.allocate(f"{base}_MatMul_{BITS}bits_zp"),
                   pack_nibbles(quant.zero_points).reshape(-1))
    graph.initializer.extend([packed, scales, zeros])
    has_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] != ""
    product = names.allocate(f"{node.output[0]}_product") if has_bias else node.output[0]
    matmul = helper.make_node(
        "MatMulNBits", [node.input[0], packed.name, scales.name, zeros.name], [product],
        name=node.name, domain=_MS_DOMAIN, K=target.inputs, N=target.outputs, bits=BITS,
        block_size=quant.block_size)
    if not has_bias:
        return [matmul]
    add = helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                           name=names.allocate(f"{node.name}_bias"))
    return [matmul, add]


def _dequantized(
    node: onnx.NodeProto, target: WeightOnlyTarget, quant: BlockQuant, graph: onnx.GraphProto,
    names: NameAllocator,
) -> list[onnx.NodeProto]:
    rows = quant.codes.shape[0]
    codes = quant.codes.reshape(rows, -1)[:, : quant.inputs]  # (N, K)
    scales, zeros = quant.scales, quant.zero_points  # (N, blocks)
    axis = 1
    if not target.transposed:  # the weight is (K, N): blocks run down its rows
        codes, scales, zeros, axis = codes.T, scales.T, zeros.T, 0
    base = target.weight
    quantized = integer_tensor(names.allocate(f"{base}_quantized"), np.ascontiguousarray(codes),
                               TensorProto.UINT4)
    scale = _array(names.allocate(f"{base}_scale"), scales)
    zero = integer_tensor(names.allocate(f"{base}_zero_point"), np.ascontiguousarray(zeros),
                          TensorProto.UINT4)
    graph.initializer.extend([quantized, scale, zero])
    dequantized = names.allocate(f"{base}_dequantized")
    dq = helper.make_node("DequantizeLinear", [quantized.name, scale.name, zero.name],
                          [dequantized], name=names.allocate(f"{base}_DequantizeLinear"),
                          axis=axis, block_size=quant.block_size)
    rewired = onnx.NodeProto()
    rewired.CopyFrom(node)
    rewired.input[1] = dequantized
    return [dq, rewired]
