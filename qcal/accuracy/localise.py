"""Where the quantized model's error comes from, in two passes instead of one per tensor.

The float model and the quantized model run side by side on a few samples with every planned
activation of the main graph exposed as an output. Both models compute these tensors (the Q/DQ
writer keeps each producer's output and sends its readers through the pair), so their difference
is the error that has reached that point: `r_t = Σ(q - f)² / Σf²` per tensor. A quantized node
whose output carries much more error than its inputs is where error jumps: its quantized inputs
and weights (what it reads through Q/DQ) take the jump as their harm, and so do the quantized
tensors its inputs are computed from element by element (an Add, Clip, Mul or Softmax between a
Conv's quantized output and a depthwise Conv passes each channel's rounding on unmixed: the jump
appears at the depthwise Conv, but keeping its input float alone leaves that rounding in place).
Measured on data, this
finds the tensors whose error is amplified downstream (denominators, exp and pow inputs,
differences of nearly equal quantities) however an exporter spells them, at the cost of two
passes. The fallback then confirms on the real QDQ model, as with per-tensor sensitivity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from qcal.accuracy.evaluate import COMPARE_THREADS, numeric_outputs
from qcal.accuracy.sensitivity import SensitivityResult, TensorSensitivity
from qcal.calibration.runtime import Feed, create_session
from qcal.graph.integer_kernels import FUSED_ACTIVATIONS
from qcal.graph.model import QuantPlan
from qcal.graph.names import NameAllocator, model_names
from qcal.graph.shapes import static_shapes
from qcal.graph.structure import (
    COMPUTE_OPS,
    UseIndex,
    all_graphs,
    exposing,
    graph_element_types,
    node_subgraphs,
    subgraph_reads,
)
from qcal.numerics.onnx_mapping import ONNX_CODE_LIMITS, qdq_round_trip
from qcal.numerics.sums import inner_product

__all__ = ["localise_error"]


def localise_error(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    plan: QuantPlan,
    batches: Iterable[tuple[Feed, int]],
    *,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> SensitivityResult:
    """Each planned tensor's harm as the error jump at the nodes that read it quantized (module
    docstring), as a `SensitivityResult` the fallback ranks by (`noise_ratio` is the jump)."""
    produced = {v for n in float_model.graph.node for v in n.output if v}
    quant_produced = {v for n in quant_model.graph.node for v in n.output if v}
    outputs = numeric_outputs(float_model)  # not a classifier's ZipMap of dicts, nor strings
    bodies = _body_nodes(float_model.graph)
    types = graph_element_types(float_model.graph)
    # Only float values are compared, and an exposed value must be declared of its own type
    # (an If holding a branch may return int64 indices).
    floats = {v for v, t in types.items() if t == onnx.TensorProto.FLOAT}
    holders = {v for n in float_model.graph.node if n.name in bodies for v in n.output
               if v in floats}
    watched = sorted(({a.tensor for a in plan.activations} | holders) & produced
                     & quant_produced - set(outputs)) + outputs
    branch_nodes = _if_branch_nodes(float_model.graph)
    in_branches = _exposed_branch_values(float_model, quant_model, plan, branch_nodes, floats)
    grids = _activation_grids(quant_model)
    grids.update({name: grids[value] for value, name in in_branches.items() if value in grids})
    # A graph output the plan quantizes (a Conv's, so that it runs in integers) is read by no
    # node, and the quantized model gives it rounded: its own rounding is measured on the
    # float model's value (a UNet's logits, rounded to 8 bits, changed 4 % of its pixels'
    # classes, and were no candidate to keep float).
    grids.update(_quantized_outputs(quant_model, grids))
    ratios, shapes, samples, rounding = _error_ratios(
        _exposing_branches(float_model, in_branches),
        _exposing_branches(quant_model, in_branches),
        watched + list(in_branches.values()), batches, providers, grids)
    for value, name in in_branches.items():
        ratios[value] = ratios.pop(name)
        shapes[value] = shapes.pop(name)
        if name in rounding:
            rounding[value] = rounding.pop(name)

    # A tensor's own rounding is harm too, where it is read: the error it adds, which the
    # jump cannot see where an earlier error already fills the node's input (a spectrum's
    # magnitude, rounded on a grid that its quiet frames fall through, after its audio input).
    harm: dict[str, float] = {t: r for t, r in rounding.items() if r > 0.0}
    nodes = [*float_model.graph.node, *branch_nodes]
    inputs_of = {n.name: [v for v in n.input if v] for n in nodes}
    outputs_of = {n.name: [v for v in n.output if v] for n in nodes}
    quantized = [d.node for d in plan.nodes if d.quantized and d.node in inputs_of]
    reads: dict[str, set[str]] = {}
    for target in plan.activations:
        for consumer in target.consumers:
            reads.setdefault(consumer, set()).add(target.tensor)
    for weight in plan.weights:
        reads.setdefault(weight.node, set()).add(weight.tensor)
    # A Conv whose Relu/Clip onnxruntime fuses writes a float tensor, not watched: its error
    # is read where that activation writes (the activation adds none of its own).
    index = UseIndex.build(float_model.graph)
    through = _through_fused_activations(float_model.graph, index, set(ratios))
    upstream = _ElementwiseSources(index, shapes, reads)
    for node in quantized:
        after = max((ratios.get(through.get(v, v), 0.0) for v in outputs_of[node]), default=0.0)
        before = max((ratios.get(v, 0.0) for v in inputs_of[node]), default=0.0)
        jump = max(0.0, after - before)
        sources = upstream.of(reads.get(node, set())) if jump > 0.0 else set()
        for tensor in reads.get(node, set()) | sources:
            harm[tensor] = max(harm.get(tensor, 0.0), jump)
    # Deeper in (a Loop or Scan body, an If nested in a branch) no value is watched: the jump
    # at the main-graph node that holds it is charged to every tensor read quantized there
    # (values from the outer scope count as its inputs), and the fallback's checks on the real
    # model tell them apart.
    measured = {n.name for n in branch_nodes}
    for holder, inner in bodies.items():
        after = max((ratios.get(v, 0.0) for v in outputs_of[holder]), default=0.0)
        before = max((ratios.get(v, 0.0) for v in inputs_of[holder] + inner.reads), default=0.0)
        jump = max(0.0, after - before)
        unmeasured = inner.nodes - measured
        for tensor in (t for node in unmeasured for t in reads.get(node, ())):
            harm[tensor] = max(harm.get(tensor, 0.0), jump)
    roles = {a.tensor: "activation" for a in plan.activations}
    roles.update({w.tensor: "weight" for w in plan.weights})
    found = [
        TensorSensitivity(tensor, roles.get(tensor, "activation"), None, value, None, None,
                          samples=samples)
        for tensor, value in harm.items()
    ]
    found.sort(key=lambda s: (-s.harm, s.tensor))
    return SensitivityResult(samples, tuple(found), method="error-jump")


class _ElementwiseSources:
    """The quantized tensors a value is computed from element by element.

    A node passes its inputs' rounding on unmixed when each of its inputs, as seen on the data
    (constants as stored), broadcasts to its output's shape: Add, Mul, Clip, Sigmoid, a
    per-channel scale, Softmax. A compute op (Conv, MatMul, Gemm: shapes can line up by
    chance), a pool, a Concat, a Resize or a Reshape mixes or moves elements, and the walk stops
    there; so does it at a value whose shape is not known.
    """

    def __init__(self, index: UseIndex, shapes: Mapping[str, tuple[int, ...]],
                 reads: Mapping[str, set[str]]) -> None:
        self._index = index
        self._shapes = shapes
        self._reads = reads

    def of(self, tensors: set[str]) -> set[str]:
        """Quantized tensors upstream of `tensors` through element-by-element nodes (float
        values between them followed too)."""
        found: set[str] = set()
        seen = set(tensors)
        stack = sorted(tensors)
        while stack:
            node = self._index.producer.get(stack.pop())
            if node is None or not self._elementwise(node):
                continue
            found |= self._reads.get(node.name, set())
            for value in node.input:
                if value and value not in seen and value not in self._index.initializers:
                    seen.add(value)
                    stack.append(value)
        return found

    def _elementwise(self, node: onnx.NodeProto) -> bool:
        outputs = [v for v in node.output if v]
        if node.op_type in COMPUTE_OPS or len(outputs) != 1 or outputs[0] not in self._shapes:
            return False
        out = self._shapes[outputs[0]]
        inputs = [v for v in node.input if v]
        return bool(inputs) and all(
            v in self._shapes and _broadcasts(self._shapes[v], out) for v in inputs)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `to` without changing it (numpy's rule, one way)."""
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def _exposed_branch_values(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, plan: QuantPlan,
    branch_nodes: list[onnx.NodeProto], floats: set[str],
) -> dict[str, str]:
    """Float values (`floats`: known to be) computed in a branch of a main-graph If that the
    planned tensors and the outputs of quantized nodes there are -> the name of the If output
    that exposes each (both models compute them under the same names)."""
    quantized = {d.node for d in plan.nodes if d.quantized}
    planned = {a.tensor for a in plan.activations}
    in_quant = {v for n in _if_branch_nodes(quant_model.graph) for v in n.output}
    values = sorted({v for n in branch_nodes for v in n.output
                     if v and (v in planned or n.name in quantized)} & in_quant & floats)
    names = NameAllocator(model_names(float_model) | model_names(quant_model))
    return {v: names.allocate(f"{v}_localised") for v in values}


def _if_branch_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes at the top level of the branches of `graph`'s If nodes."""
    return [n for holder in graph.node if holder.op_type == "If"
            for branch in node_subgraphs(holder) for n in branch.node]


def _exposing_branches(model: onnx.ModelProto, values: Mapping[str, str]) -> onnx.ModelProto:
    """A copy of `model` whose If nodes also return the float branch values in `values` under
    the names given there: the branch that computes one returns it, the other an empty
    tensor."""
    if not values:
        return model
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    for holder in (n for n in exposed.graph.node if n.op_type == "If"):
        branches = list(node_subgraphs(holder))
        computed = [{v for n in g.node for v in n.output} for g in branches]
        mine = sorted(v for v in values if any(v in c for c in computed))
        if not mine:
            continue
        for value in mine:
            for graph, names in zip(branches, computed):
                source = value
                if value not in names:
                    source = f"{values[value]}_{graph.name}_absent"
                    empty = onnx.helper.make_tensor(source, onnx.TensorProto.FLOAT, [0], [])
                    graph.node.append(onnx.helper.make_node("Constant", [], [source],
                                                            value=empty))
                graph.output.append(
                    onnx.helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, None))
            holder.output.append(values[value])
    return exposed


@dataclass(frozen=True)
class _Body:
    nodes: frozenset[str]  # the names of the nodes in its bodies, at any depth
    reads: list[str]  # the outer-scope values they read


def _body_nodes(graph: onnx.GraphProto) -> dict[str, _Body]:
    """Main-graph node holding subgraphs -> what its bodies hold and read."""
    found = {}
    for node in graph.node:
        nested = list(node_subgraphs(node))
        if nested:
            names = frozenset(n.name for g in nested for inner in all_graphs(g)
                              for n in inner.node)
            found[node.name] = _Body(names, sorted(subgraph_reads(node)))
    return found


def _through_fused_activations(graph: onnx.GraphProto, index: UseIndex,
                                watched: set[str]) -> dict[str, str]:
    """Unwatched tensor -> the watched output of the Relu/Clip that alone reads it (through a
    chain of them); `index` is the graph's."""
    found: dict[str, str] = {}
    for value in (v for node in graph.node for v in node.output if v and v not in watched):
        end, _ = index.follow(value, FUSED_ACTIVATIONS, until=watched)
        if end in watched:
            found[value] = end
    return found


def _noise_ratio(f: np.ndarray, q: np.ndarray) -> float:
    """Noise energy over signal energy of `q` against `f` over the elements both compute
    finite, at most 1 (noise as large as the signal: nothing left); 0 where the shapes differ
    (a branch not taken) or nothing is wrong."""
    f64 = np.asarray(f, dtype=np.float64).ravel()
    q64 = np.asarray(q, dtype=np.float64).ravel()
    if f64.shape != q64.shape:
        return 0.0
    error = q64 - f64  # not finite where either is not
    if not np.isfinite(error).all():
        both = np.isfinite(f64) & np.isfinite(q64)
        f64, error = f64[both], error[both]
    noise = inner_product(error, error)
    if noise == 0.0:
        return 0.0
    signal = inner_product(f64, f64)
    return 1.0 if noise >= signal else noise / signal


def _error_ratios(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, names: list[str],
    batches: Iterable[tuple[Feed, int]], providers: tuple[str, ...],
    grids: Mapping[str, _Grid],
) -> tuple[dict[str, float], dict[str, tuple[int, ...]], int, dict[str, float]]:
    """Tensor -> the mean over the batches (one sample each) of the quantized value's noise
    energy over its signal energy (`_noise_ratio`); tensor -> its shape in the first run (the
    watched ones as computed, the others as declared); and the number of samples. Each sample
    weighs the same: pooled energies would let the loud samples hide the error of the quiet
    ones (a voice-activity model's silent chunks, where its decisions are made, carried 80
    times the relative error of its speech). Last, tensor -> the mean ratio of the rounding
    its grid in `grids` makes of the quantized model's value (the error it adds itself), or of
    the float model's for a grid `of_float` (graph outputs the quantized model gives
    rounded)."""
    float_session = create_session(exposing(float_model, names), providers=providers,
                                   threads=COMPARE_THREADS, what="float model")
    quant_session = create_session(exposing(quant_model, names), providers=providers,
                                   threads=COMPARE_THREADS, what="quantized model")
    totals = dict.fromkeys(names, 0.0)
    rounded = {name: 0.0 for name in names if name in grids}
    samples = runs = 0
    shapes: dict[str, tuple[int, ...]] = {}
    for feed, n in batches:
        if samples == 0:
            shapes.update(static_shapes(float_model.graph, feed))
        floats = float_session.run(names, dict(feed))
        quants = quant_session.run(names, dict(feed))
        for name, f, q in zip(names, floats, quants):
            if samples == 0:
                shapes[name] = tuple(np.shape(f))
            totals[name] += _noise_ratio(f, q)
            if name in rounded:
                value = f if grids[name].of_float else q
                rounded[name] += _noise_ratio(value, grids[name].round(value))
        samples += n
        runs += 1
    ratios = {name: totals[name] / max(runs, 1) for name in names}
    return ratios, shapes, samples, {name: r / max(runs, 1) for name, r in rounded.items()}


@dataclass(frozen=True)
class _Grid:
    """The values a QuantizeLinear -> DequantizeLinear pair of one scale can give."""

    scale: float
    zero_point: int
    low: int
    high: int
    # Rounds the float model's value: a graph output the quantized model gives rounded, whose
    # quantized value is on the grid already (`_quantized_outputs`).
    of_float: bool = False

    def round(self, x: np.ndarray) -> np.ndarray:
        return qdq_round_trip(x, self.scale, self.zero_point, self.low, self.high)


def _quantized_outputs(quant_model: onnx.ModelProto, grids: Mapping[str, _Grid],
                       ) -> dict[str, _Grid]:
    """Graph outputs a DequantizeLinear writes from a QuantizeLinear of a gridded value, each
    with that grid, rounding the float model's value (`_Grid.of_float`)."""
    producer = UseIndex.build(quant_model.graph).producer
    found = {}
    for output in quant_model.graph.output:
        dq = producer.get(output.name)
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" \
            else None
        if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in grids:
            found[output.name] = replace(grids[q.input[0]], of_float=True)
    return found


def _activation_grids(quant_model: onnx.ModelProto) -> dict[str, _Grid]:
    """Tensor -> the grid of the QuantizeLinear that reads it with a constant scalar scale and
    integer zero point (in any graph of the model)."""
    found: dict[str, _Grid] = {}
    for graph in all_graphs(quant_model.graph):
        constants = {t.name: t for t in graph.initializer}
        for node in graph.node:
            if node.op_type != "QuantizeLinear" or len(node.input) < 3:
                continue
            scale, zero = (constants.get(v) for v in node.input[1:3])
            if scale is None or zero is None or np.prod(scale.dims) != 1:
                continue
            step = float(numpy_helper.to_array(scale).ravel()[0])
            zero_point = numpy_helper.to_array(zero)
            if not (np.isfinite(step) and step > 0.0):
                continue
            if zero.data_type not in ONNX_CODE_LIMITS:
                continue
            low, high = ONNX_CODE_LIMITS[zero.data_type]
            found[node.input[0]] = _Grid(step, int(zero_point.ravel()[0]), low, high)
    return found
