"""Multiply-accumulates per compute node, at the shapes of one sample of real data: the size
of the work the coverage figure weighs and placement "auto" holds small products to.

Conv, ConvTranspose, MatMul and Gemm count, and the operators that hold the same products in a
fused form: onnxruntime's FusedConv, FusedGemm, FusedMatMul and Attention, and opset 23's
Attention.

MACs per node, for one sample of real data:

* Conv: ``prod(Y.shape) * prod(W.shape[1:])`` (every output element sums Cin/group x kernel),
* ConvTranspose: ``prod(X.shape) * prod(W.shape[1:])`` (every input element scatters into
  Cout/group x kernel outputs),
* MatMul: ``prod(Y.shape) * A.shape[-1]``; Gemm: ``prod(Y.shape) * K`` (K = A's inner dim);
  FusedConv, FusedGemm and FusedMatMul as their unfused forms,
* Attention (opset 23): ``prod(Q.shape) * Skv`` for the scores plus as many for the values
  (``Skv`` key positions, V's width per query head); com.microsoft's Attention: its projection
  ``prod(X.shape) * W.shape[1]`` plus ``B * S * S`` times the Q and V widths.

Shapes come from shape inference when every one is a number (symbolic dimensions of the graph
inputs are replaced by those of the first sample, then shape inference runs again with the
sample's input shapes); otherwise from one onnxruntime run of the float model on the first
sample. Nodes whose shapes stay unknown make the whole figure fall back
to counting nodes, and the result says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx

from qcal.graph.files.large import DETACH_MIN_BYTES, light_copy
from qcal.graph.passes.infer_shapes import infer_shapes
from qcal.graph.shapes import static_shapes
from qcal.graph.structure import (
    COMPUTE_OPS,
    DEFAULT_DOMAINS,
    all_graphs,
    computed_from_constants,
    element_types,
    ints_attribute,
)
from qcal.numerics.errors import QcalError

__all__ = ["ShapeProbe", "Shapes", "body_macs", "compute_macs", "is_compute", "shape_probe"]

logger = logging.getLogger(__name__)


Shapes = Mapping[str, tuple[int, ...]]
ShapeProbe = Callable[[list[str]], Shapes]
"""Measures the shapes of the named tensors with a real run (one sample)."""


def compute_macs(
    model: onnx.ModelProto,
    sample: Mapping[str, np.ndarray] | None,
    *,
    run_shapes: ShapeProbe | None = None,
) -> dict[str, int | None]:
    """MACs per compute node of the main graph for `sample` (None where shapes are unknown),
    but those that compute from constants alone (`computed_from_constants`: not work per run).

    Args:
        model: a prepared model (named nodes, value_info from shape inference).
        sample: one model feed whose input shapes replace symbolic input dimensions.
        run_shapes: measures shapes with a real run, used when shape inference leaves some
            unknown (None: do not run).
    """
    graph = model.graph
    once = computed_from_constants(graph)  # onnxruntime computes them when it loads the model
    nodes = [n for n in graph.node if is_compute(n) and n.name not in once]
    needed = sorted({t for n in nodes for t in _shape_tensors(n) if t})
    shapes = static_shapes(graph, sample)
    missing = [t for t in needed if t not in shapes]
    if missing and sample is not None:
        shapes.update(_concrete_shapes(model, sample, missing))
        missing = [t for t in needed if t not in shapes]
    if missing and run_shapes is not None:
        try:
            shapes.update(run_shapes(missing))
        except QcalError:
            pass  # measured shapes are a refinement; the node-count fallback still applies
    return {n.name: _node_macs(n, shapes) for n in nodes}


def is_compute(node: onnx.NodeProto) -> bool:
    if node.domain in DEFAULT_DOMAINS:
        return node.op_type in COMPUTE_OPS or node.op_type == "Attention"
    return node.domain == "com.microsoft" and node.op_type in _FUSED_COMPUTE


# onnxruntime's fused forms of the compute operators (its optimizer writes them), by the
# operator whose MACs each holds.
_FUSED_COMPUTE = {"FusedConv": "Conv", "FusedGemm": "Gemm", "FusedMatMul": "MatMul",
                  "Attention": "Attention"}


def _shape_tensors(node: onnx.NodeProto) -> Iterable[str]:
    """The tensors whose shapes `_node_macs` needs: data input, weight (attention: keys and
    values) and output."""
    yield from node.input[:3] if node.op_type == "Attention" else node.input[:2]
    if node.output:
        yield node.output[0]


def _node_macs(node: onnx.NodeProto, shapes: Shapes) -> int | None:
    data = shapes.get(node.input[0]) if node.input else None
    weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
    out = shapes.get(node.output[0]) if node.output else None
    op = node.op_type if node.domain in DEFAULT_DOMAINS else _FUSED_COMPUTE[node.op_type]
    trans_a = any(a.name == "transA" and a.i for a in node.attribute)
    if op == "Conv" and out is not None and weight is not None:
        return math.prod(out) * math.prod(weight[1:])
    if op == "ConvTranspose" and data is not None and weight is not None:
        return math.prod(data) * math.prod(weight[1:])
    if op == "MatMul" and out is not None and data is not None and data:
        return math.prod(out) * data[-2 if trans_a and len(data) > 1 else -1]
    if op == "Gemm" and out is not None and data is not None and len(data) == 2:
        return math.prod(out) * data[0 if trans_a else 1]
    if op == "Attention" and data is not None and weight is not None:
        values = shapes.get(node.input[2]) if len(node.input) > 2 else None
        if node.domain in DEFAULT_DOMAINS:
            return _attention_products(node, data, weight, values)
        return _fused_attention_macs(node, data, weight)
    return None


def _attention_products(
    node: onnx.NodeProto, query: tuple[int, ...], key: tuple[int, ...],
    value: tuple[int, ...] | None,
) -> int | None:
    """Opset 23's Attention: Q K^T and the weighted sum of V, for Q/K/V of 3 dimensions
    (heads in the last one) or 4 (heads second)."""
    if value is None or len(query) != len(key) or len(query) not in (3, 4):
        return None
    if len(query) == 4:  # [batch, heads, positions, head width]
        return math.prod(query) * key[2] + math.prod(query[:3]) * key[2] * value[3]
    heads: dict[str, int] = {a.name: int(a.i) for a in node.attribute}
    q_heads, kv_heads = heads.get("q_num_heads", 0), heads.get("kv_num_heads", 0)
    if q_heads <= 0 or kv_heads <= 0:
        return None
    # [batch, positions, heads x width]: each query head weighs a value head's width
    return math.prod(query) * key[1] + math.prod(query[:2]) * key[1] * value[2] * q_heads // kv_heads


def _fused_attention_macs(
    node: onnx.NodeProto, data: tuple[int, ...], weight: tuple[int, ...]
) -> int | None:
    """com.microsoft's Attention: X [batch, positions, width] times W [width, Q+K+V widths],
    then the scores (Q width) and the weighted sum (V width) over the positions."""
    if len(data) != 3 or len(weight) != 2:
        return None
    sizes = ints_attribute(node, "qkv_hidden_sizes")
    q_width, _, v_width = sizes if len(sizes) == 3 else [weight[1] // 3] * 3
    batch, positions = data[0], data[1]
    return math.prod(data) * weight[1] + batch * positions * positions * (q_width + v_width)


def body_macs(model: onnx.ModelProto, sample: Mapping[str, np.ndarray] | None) -> dict[str, int]:
    """MACs per call of the compute nodes inside If, Loop and Scan bodies (one branch taken, one
    iteration), where shape inference with the sample's input shapes knows every shape a node's
    count needs; the others are left out. Placement "auto" holds a body's products to the same
    size as the main graph's: an If branch holding copies of the main graph's small Gemms
    (openwakeword's hey_jarvis) had them quantized while their twins stayed float."""
    if sample is None or len(graphs := list(all_graphs(model.graph))) == 1:
        return {}
    inferred = _inferred_at(model, sample)
    if inferred is None:
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    for graph in all_graphs(inferred.graph):  # a body reads the values of the graphs around it
        shapes.update(static_shapes(graph, None))
    return {node.name: count for graph in graphs[1:] for node in graph.node
            if is_compute(node) and (count := _node_macs(node, shapes)) is not None}


def _concrete_shapes(
    model: onnx.ModelProto, sample: Mapping[str, np.ndarray], wanted: list[str]
) -> Shapes:
    """Shapes of `wanted` from shape inference with the sample's input shapes (`_inferred_at`):
    symbols the model's own inference derived (``unk__12``) become numbers without the cost of
    an onnxruntime session."""
    inferred = _inferred_at(model, sample)
    if inferred is None:
        return {}
    found = static_shapes(inferred.graph, None)
    return {t: found[t] for t in wanted if t in found}


def _inferred_at(
    model: onnx.ModelProto, sample: Mapping[str, np.ndarray]
) -> onnx.ModelProto | None:
    """A weightless copy of `model` whose inputs take the sample's shapes, shape-inferred anew
    (every graph's earlier value_info dropped), or None when the inference fails."""
    light = light_copy(model, min_bytes=DETACH_MIN_BYTES)[0]
    for graph in all_graphs(light.graph):
        del graph.value_info[:]
    for value in light.graph.input:
        array = sample.get(value.name)
        if array is None or not value.type.tensor_type.HasField("shape"):
            continue
        shape = value.type.tensor_type.shape
        del shape.dim[:]
        for size in array.shape:
            shape.dim.add().dim_value = int(size)
    try:
        return infer_shapes(light, strict=False)
    except Exception as err:  # noqa: BLE001  the C++ inference raises assorted types
        logger.info("shape inference with the sample's shapes failed: %s", err)
        return None


def shape_probe(
    model: onnx.ModelProto,
    sample: Mapping[str, np.ndarray],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
) -> ShapeProbe:
    """A `ShapeProbe` that runs `model` once on `sample` with the asked tensors as outputs."""
    from qcal.calibration.collect import expose_tensors
    from qcal.calibration.runtime import create_session

    def probe(tensors: list[str]) -> Shapes:
        known = element_types(model.graph)
        wanted = [t for t in tensors if t in known]
        if not wanted:
            return {}
        session = create_session(expose_tensors(model, wanted), providers=providers,
                                 threads=threads, what="shape probe", optimize=False)
        try:
            arrays = session.run(wanted, dict(sample))
        except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
            logger.info("shape probe failed: %s", str(err).strip().splitlines()[:1])
            return {}
        return {name: tuple(np.shape(a)) for name, a in zip(wanted, arrays)}

    return probe
