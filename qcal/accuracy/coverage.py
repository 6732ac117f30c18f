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
the node; MatMul and Gemm also have integer kernels with a float output). The MACs per node
come from `qcal.accuracy.macs`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import onnx

from qcal.accuracy.macs import is_compute
from qcal.accuracy.runnable import NO_INTEGER_FORM
from qcal.graph.integer_kernels import FUSED_ACTIVATIONS, INTEGER_OUTPUT_ANCHORS
from qcal.graph.model import QuantPlan
from qcal.graph.narrow_convs import NARROW_CONV
from qcal.graph.parameters import PARAMETER_ONLY
from qcal.graph.placement import PRODUCT_OF_ACTIVATIONS, SMALL_PRODUCT
from qcal.graph.shapes import known_dims
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    NO_RULE,
    NOT_FLOAT,
    UseIndex,
    all_graphs,
    element_types,
)

__all__ = ["Coverage", "CoverageMeter", "measure_coverage"]

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
        float_reasons: what the model's sizes and forms left float (`_FLOAT_WHY`: products
            too small for an integer kernel to pay, forms with no integer kernel, products of
            two activations, narrow convolutions), in words, or None: the coverage floor's
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
    float_reasons: str | None = None
    recurrent_layers: str | None = None  # "3 LSTM": recurrent layers, float and not counted

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
            "recurrent_layers": self.recurrent_layers,
            "note": self.note,
        }



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
                         for node in graph.node if is_compute(node)]
        self._mostly_in_bodies = _mostly_in_bodies(model)
        self._in_bodies = [n.name for g in all_graphs(graph) if g is not graph
                           for n in g.node if is_compute(n)]
        self._layers = _recurrent_layers(model)
        self._recurrent = _recurrent_note(self._layers)
        self._mostly_recurrent = _mostly_recurrent(model)

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
                            mostly_in_bodies, len(in_bodies), recurrent_layers=self._layers)
        done = sum(v for name, v in macs.items() if v is not None and name in quantized)
        # the main graph's: the figure leaves the bodies' out
        left: dict[str | tuple[str, ...], list[str]] = {}  # main-graph compute left float, by reason
        for d in plan.nodes:
            if not d.quantized and d.node not in quantized and d.node in macs:
                # a parameter's reason is a note after the node's own words
                prefix = next((p for p, _ in _FLOAT_WHY if d.reason.startswith(p)
                               or p == PARAMETER_ONLY and p in d.reason), None)
                if prefix is not None:
                    left.setdefault(prefix, []).append(d.node)
        whys = dict(_FLOAT_WHY)
        if self._mostly_recurrent:  # no option quantizes what holds the work
            whys[SMALL_PRODUCT] = _MOSTLY_RECURRENT
        said = [f"{len(nodes)} of {len(macs)} compute nodes "
                f"({sum(macs.get(n) or 0 for n in nodes) / total if total else 0.0:.1%} of the "
                f"MACs) {whys[prefix]}" for prefix, _ in _FLOAT_WHY if (nodes := left.get(prefix))]
        return Coverage("macs", len(macs), len(quantized & macs.keys()), total, done, bodies,
                        anything_quantized=anything, mostly_in_bodies=mostly_in_bodies,
                        nodes_in_bodies=len(in_bodies),
                        float_reasons="; ".join(said) or None, recurrent_layers=self._layers)


# What the coverage gate names of the compute left float: the reasons no option of the run's
# choosing (a selection, an exclusion, the fallback) but the model's sizes and forms give.
_FLOAT_WHY = (
    (SMALL_PRODUCT, ("left float as too small for an integer kernel to pay at the calibration "
                     "data's shapes (if the model will run on larger batches than the data's, "
                     "--min-product-macs 0 quantizes them)")),
    (NO_INTEGER_FORM, ("left float as onnxruntime has no integer kernel for their form (as "
                       "for a ConvTranspose) and ran them in float")),
    (PRODUCT_OF_ACTIVATIONS, ("left float as products of two activations (attention), which "
                              "onnxruntime's integer kernel multiplies slower than its float "
                              "one")),
    (NARROW_CONV, ("left float as convolutions too narrow (few input channels, or few per "
                   "group) for onnxruntime's integer kernel to beat its float one")),
    (NOT_FLOAT, ("left as they are: they compute in another type than float (double, "
                 "integers), and onnxruntime's integer kernels take float32")),
    (PARAMETER_ONLY, ("left float as they compute only what other operators read as exact "
                      "parameters (a comparison's operands, indices, shapes)")),
    (NO_RULE, ("left float as operators qcal has no quantization rule for (onnxruntime's own "
               "fused operators, com.microsoft's: give qcal the model as exported, before "
               "onnxruntime optimised it)")),
)


# The small products' reason where recurrent layers hold most of the weights: no option
# quantizes those (a speaker encoder of three LSTMs and a Linear of 65 k multiply-adds, told to
# quantize its small products, came out "100 % quantized" and exactly as fast as its float model).
_MOSTLY_RECURRENT = ("left float as too small for an integer kernel to pay; the model's recurrent "
                     "layers hold most of its weights and run in float whatever the options "
                     "(onnxruntime has no integer kernel for them in QDQ form), so quantizing "
                     "it gains little")


def _mostly_recurrent(model: onnx.ModelProto) -> bool:
    """Whether the LSTM, GRU and RNN layers hold more weights than the compute nodes (their
    W and R inputs' sizes, from the initializers or the shapes inferred: torch.onnx's dynamo
    exporter computes them from the initializers when the model loads)."""
    graphs = list(all_graphs(model.graph))
    sizes = _initializer_sizes(graphs)
    for graph in graphs:
        for value in graph.value_info:
            dims = known_dims(value)
            if dims is not None and None not in dims:
                sizes.setdefault(value.name, math.prod(d or 0 for d in dims))
    recurrent = sum(sizes.get(v, 0) for g in graphs for n in g.node
                    if n.op_type in _RECURRENT_OPS and n.domain in DEFAULT_DOMAINS
                    for v in n.input[1:3])
    return recurrent > sum(_compute_weights(g, sizes) for g in graphs)


def _mostly_in_bodies(model: onnx.ModelProto) -> bool:
    """Whether the compute nodes inside If/Loop/Scan bodies hold more weight elements than the
    main graph's (a Loop running a Conv over a sequence, a tiny Conv before it): the main
    graph's share then says little of the model."""
    graphs = list(all_graphs(model.graph))
    # a body reads its weights from an enclosing graph as often as from its own
    sizes = _initializer_sizes(graphs)
    inside = sum(_compute_weights(g, sizes) for g in graphs if g is not model.graph)
    return inside > _compute_weights(model.graph, sizes)


def _initializer_sizes(graphs: Iterable[onnx.GraphProto]) -> dict[str, int]:
    """Elements of every initializer of `graphs`, by name."""
    return {t.name: int(math.prod(t.dims)) for g in graphs for t in g.initializer}


def _compute_weights(graph: onnx.GraphProto, sizes: Mapping[str, int]) -> int:
    """Elements of the weights (second inputs) the compute nodes of `graph` read, by `sizes`."""
    return sum(sizes.get(n.input[1], 0) for n in graph.node
               if is_compute(n) and len(n.input) > 1)


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


def _recurrent_layers(model: onnx.ModelProto) -> str | None:
    """The model's recurrent layers by kind ("3 LSTM, 1 GRU"), or None."""
    found = Counter(n.op_type for g in all_graphs(model.graph) for n in g.node
                    if n.op_type in _RECURRENT_OPS and n.domain in DEFAULT_DOMAINS)
    return ", ".join(f"{count} {op}" for op, count in sorted(found.items())) or None


def _recurrent_note(layers: str | None) -> str | None:
    """What else the figure leaves out: recurrent layers, which run in float (onnxruntime has
    no integer kernel for them after QDQ fusion), however much of the work they hold."""
    if layers is None:
        return None
    return (f"{layers} not counted: recurrent layers run in float (onnxruntime has no integer "
            "kernel for them in QDQ form), however much of the work they hold")


_RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})


# ------------------------------------------------------------------------------------ helpers


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
