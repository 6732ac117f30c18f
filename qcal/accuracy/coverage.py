"""How much of a model's compute a quantization plan leaves quantized, in multiply-accumulates.

Conv, ConvTranspose, MatMul and Gemm count: they hold nearly all the arithmetic of the
models qcal quantizes, and they are what onnxruntime's integer kernels speed up. So do the
operators that hold the same products in a fused form, which qcal leaves float: onnxruntime's
FusedConv, FusedGemm, FusedMatMul and Attention (its Q/K/V projection and its two products)
in a model its optimizer already rewrote, and opset 23's Attention (its two products, as the
MatMuls of an attention written out count). A model that hides its products in them is not
"mostly quantized" for want of counting them. A compute node
counts as quantized when it would run as an integer kernel: it is quantized by the plan, every
float input it reads comes through a DequantizeLinear (activations listed with it as consumer,
constants planned as its weights), and, for Conv and ConvTranspose, its output is quantized too,
directly or behind a Relu/Clip that onnxruntime fuses into it (their QDQ fusions need a Q after
the node; MatMul and Gemm also have integer kernels with a float output).

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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.graph.files.large import DETACH_MIN_BYTES, light_copy
from qcal.graph.model import QuantPlan
from qcal.graph.passes.infer_shapes import infer_shapes
from qcal.graph.placement import FUSED_ACTIVATIONS, INTEGER_OUTPUT_ANCHORS, SMALL_PRODUCT
from qcal.graph.shapes import static_shapes
from qcal.graph.structure import (
    COMPUTE_OPS,
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    UseIndex,
    all_graphs,
    computed_from_constants,
    element_types,
    ints_attribute,
)
from qcal.numerics.errors import QcalError

__all__ = [
    "Coverage",
    "CoverageMeter",
    "compute_macs",
    "measure_coverage",
    "shape_probe",
]

logger = logging.getLogger(__name__)


Shapes = Mapping[str, tuple[int, ...]]
ShapeProbe = Callable[[list[str]], Shapes]
"""Measures the shapes of the named tensors with a real run (one sample)."""


@dataclass(frozen=True)
class Coverage:
    """The quantized share of compute.

    Attributes:
        basis: "macs" (multiply-accumulates from shapes) or "nodes" (shapes unknown: a count).
        compute_nodes: Conv/ConvTranspose/MatMul/Gemm nodes in the main graph.
        quantized_nodes: those that run as integer kernels under the plan.
        macs_total: MACs of all compute nodes for one sample (None on the "nodes" basis).
        macs_quantized: MACs of the quantized ones (None on the "nodes" basis).
        note: what the figure leaves out (shapes unknown: it counts nodes; compute inside
            If/Loop/Scan bodies), or None.
        anything_quantized: whether the plan quantizes any node at all.
        mostly_in_bodies: the compute nodes inside If/Loop/Scan bodies hold more weights than
            those of the main graph: the figure is no measure of the model (the coverage
            floor is not checked on it).
        nodes_in_bodies: compute nodes inside If/Loop/Scan bodies, which the figure leaves out.
        small_products: what placement left float as too small for an integer kernel to pay
            (`qcal.graph.placement.SMALL_PRODUCT`), in words, or None: the coverage floor's
            reason when it fails (each node's own reason says it in the report).
    """

    basis: str
    compute_nodes: int
    quantized_nodes: int
    macs_total: int | None
    macs_quantized: int | None
    note: str | None = None
    anything_quantized: bool = True
    mostly_in_bodies: bool = False
    nodes_in_bodies: int = 0
    small_products: str | None = None

    @property
    def fraction(self) -> float:
        """Quantized share of MACs (of compute nodes on the "nodes" basis); with no compute, 1.0
        when something else is quantized and 0.0 when nothing is."""
        if not self.anything_quantized:
            return 0.0
        if self.basis == "macs" and self.macs_total:
            return (self.macs_quantized or 0) / self.macs_total
        if self.compute_nodes:
            return self.quantized_nodes / self.compute_nodes
        return 1.0

    def to_json(self) -> dict[str, object]:
        return {
            "basis": self.basis,
            "macs_quantized_fraction": float(f"{self.fraction:.9g}"),
            "macs_total": self.macs_total,
            "macs_quantized": self.macs_quantized,
            "compute_nodes": self.compute_nodes,
            "quantized_compute_nodes": self.quantized_nodes,
            "compute_nodes_in_bodies": self.nodes_in_bodies,
            "note": self.note,
        }


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
    nodes = [n for n in graph.node if _is_compute(n) and n.name not in once]
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


def measure_coverage(
    model: onnx.ModelProto, plan: QuantPlan, macs: Mapping[str, int | None],
    integer_anyway: Iterable[str] = (),
) -> Coverage:
    """The share of `macs` (from `compute_macs`) that `plan` leaves quantized, or that
    onnxruntime runs in integers anyway (`integer_anyway`: `runnable.quantized_by_onnxruntime`)."""
    return CoverageMeter(model, macs).measure(plan, integer_anyway)


class CoverageMeter:
    """`measure_coverage` of many plans for one model: what the figure needs of the graph alone
    is found once (the accuracy fallback prices every candidate, hundreds of plans, by it)."""

    def __init__(self, model: onnx.ModelProto, macs: Mapping[str, int | None]) -> None:
        graph = model.graph
        self._macs = macs
        self._unknown = sorted(name for name, value in macs.items() if value is None)
        self._total = sum(v for v in macs.values() if v is not None)
        self._index = UseIndex.build(graph)
        types = element_types(graph)
        self._compute = [(node, _float_data_inputs(node, types))
                         for node in graph.node if _is_compute(node)]
        self._mostly_in_bodies = _mostly_in_bodies(model)
        self._in_bodies = [n.name for g in all_graphs(graph) if g is not graph
                           for n in g.node if _is_compute(n)]
        self._recurrent = _recurrent_note(model)

    def quantized(self, plan: QuantPlan) -> set[str]:
        """Names of the compute nodes that run as integer kernels under `plan`."""
        quantized_nodes = {d.node for d in plan.nodes if d.quantized}
        reads = {(t.tensor, c) for t in plan.activations for c in t.consumers}
        outputs = {t.tensor for t in plan.activations}
        weights = {(w.tensor, w.node) for w in plan.weights}
        found: set[str] = set()
        for node, inputs in self._compute:
            if node.name not in quantized_nodes:
                continue
            inputs_ok = all(
                (t, node.name) in (weights if self._index.constant(t) is not None else reads)
                for t in inputs
            )
            if inputs_ok and (node.op_type not in INTEGER_OUTPUT_ANCHORS
                              or _output_quantized(node, self._index, outputs)):
                found.add(node.name)
        return found

    def measure(self, plan: QuantPlan, integer_anyway: Iterable[str] = ()) -> Coverage:
        """The share of the MACs that `plan` leaves quantized (`measure_coverage`)."""
        macs = self._macs
        quantized = self.quantized(plan) | set(integer_anyway)
        anything = any(d.quantized for d in plan.nodes)
        unknown, total = self._unknown, self._total
        in_bodies, mostly_in_bodies = self._in_bodies, self._mostly_in_bodies
        bodies_note = _bodies_note(in_bodies, plan)
        if mostly_in_bodies and bodies_note:
            bodies_note += ("; they hold most of its weights, so the coverage floor is not "
                            "checked on this figure")
        bodies = "; ".join(n for n in (bodies_note, self._recurrent) if n) or None
        if unknown:
            note = (
                f"shapes unknown for {len(unknown)} of {len(macs)} compute nodes "
                f"(first: {unknown[0]!r}); the figure counts nodes, not MACs"
            )
            return Coverage("nodes", len(macs), len(quantized & macs.keys()), None, None,
                            "; ".join(n for n in (note, bodies) if n), anything,
                            mostly_in_bodies, len(in_bodies))
        done = sum(v for name, v in macs.items() if v is not None and name in quantized)
        small = [d.node for d in plan.nodes if not d.quantized and d.node not in quantized
                 and d.reason.startswith(SMALL_PRODUCT)]
        said = None
        if small:
            share = sum(macs.get(name) or 0 for name in small) / total if total else 0.0
            said = (f"{len(small)} of {len(macs)} compute nodes ({share:.1%} of the MACs) left "
                    "float as too small for an integer kernel to pay at the calibration data's "
                    "shapes")
        return Coverage("macs", len(macs), len(quantized & macs.keys()), total, done, bodies,
                        anything_quantized=anything, mostly_in_bodies=mostly_in_bodies,
                        nodes_in_bodies=len(in_bodies), small_products=said)


def _mostly_in_bodies(model: onnx.ModelProto) -> bool:
    """Whether the compute nodes inside If/Loop/Scan bodies hold more weight elements than the
    main graph's (a Loop running a Conv over a sequence, a tiny Conv before it): the main
    graph's share then says little of the model."""
    graphs = list(all_graphs(model.graph))
    # a body reads its weights from an enclosing graph as often as from its own
    constants = {t.name: math.prod(t.dims) for g in graphs for t in g.initializer}

    def weights(graph: onnx.GraphProto) -> int:
        return sum(constants.get(n.input[1], 0) for n in graph.node
                   if _is_compute(n) and len(n.input) > 1)
    inside = sum(weights(g) for g in graphs if g is not model.graph)
    return inside > weights(model.graph)


def _bodies_note(inside: list[str], plan: QuantPlan) -> str | None:
    """What the figure leaves out: compute inside If/Loop/Scan bodies (`inside`, their names),
    whose MACs depend on the branch taken and the number of iterations."""
    if not inside:
        return None
    planned = {d.node for d in plan.nodes if d.quantized}
    count = sum(name in planned for name in inside)
    return (f"{len(inside)} Conv/MatMul/Gemm nodes inside If/Loop/Scan bodies are not counted "
            f"({count} of them quantized): their work depends on the branch taken and the "
            "number of iterations")


def _recurrent_note(model: onnx.ModelProto) -> str | None:
    """What else the figure leaves out: recurrent layers, which run in float (onnxruntime has
    no integer kernel for them after QDQ fusion), however much of the work they hold."""
    found = Counter(n.op_type for g in all_graphs(model.graph) for n in g.node
                    if n.op_type in _RECURRENT_OPS and n.domain in DEFAULT_DOMAINS)
    if not found:
        return None
    named = ", ".join(f"{count} {op}" for op, count in sorted(found.items()))
    return (f"{named} not counted: recurrent layers run in float (onnxruntime has no integer "
            "kernel for them in QDQ form), however much of the work they hold")


_RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})


# ------------------------------------------------------------------------------------ helpers


def _is_compute(node: onnx.NodeProto) -> bool:
    if node.domain in DEFAULT_DOMAINS:
        return node.op_type in COMPUTE_OPS or node.op_type == "Attention"
    return node.domain == "com.microsoft" and node.op_type in _FUSED_COMPUTE


# onnxruntime's fused forms of the compute operators (its optimizer writes them), by the
# operator whose MACs each holds.
_FUSED_COMPUTE = {"FusedConv": "Conv", "FusedGemm": "Gemm", "FusedMatMul": "MatMul",
                  "Attention": "Attention"}


def _float_data_inputs(node: onnx.NodeProto, types: Mapping[str, int]) -> list[str]:
    # The inputs an integer kernel reads quantized: A/B or X/W (a bias is int32 or float alike).
    return [t for t in node.input[:2] if t and types.get(t) in FLOAT_TYPES]


def _output_quantized(node: onnx.NodeProto, index: UseIndex, quantized: set[str]) -> bool:
    if not node.output or not node.output[0]:
        return False
    tensor = node.output[0]
    if tensor in quantized:
        return True
    readers = index.readers(tensor)
    return (
        len(readers) == 1
        and readers[0].op_type in FUSED_ACTIVATIONS
        and bool(readers[0].output)
        and readers[0].output[0] in quantized
    )


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


def _concrete_shapes(
    model: onnx.ModelProto, sample: Mapping[str, np.ndarray], wanted: list[str]
) -> Shapes:
    """Shapes of `wanted` from shape inference on a weightless copy whose inputs take the
    sample's shapes: symbols the model's own inference derived (``unk__12``) become numbers
    without the cost of an onnxruntime session."""

    light = light_copy(model, min_bytes=DETACH_MIN_BYTES)[0]
    del light.graph.value_info[:]
    for value in light.graph.input:
        array = sample.get(value.name)
        if array is None or not value.type.tensor_type.HasField("shape"):
            continue
        shape = value.type.tensor_type.shape
        del shape.dim[:]
        for size in array.shape:
            shape.dim.add().dim_value = int(size)
    try:
        inferred = infer_shapes(light, strict=False)
    except Exception as err:  # noqa: BLE001  the C++ inference raises assorted types
        logger.info("shape inference with the sample's shapes failed: %s", err)
        return {}
    found = static_shapes(inferred.graph, None)
    return {t: found[t] for t in wanted if t in found}


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
