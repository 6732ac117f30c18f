"""Pass: carry the values of tensors computed inside If, Loop and Scan bodies out to outputs of
the main graph, so that calibration runs can observe them.

Only the calibration model is rewritten this way (it is never written out). Each routed tensor
is flattened to 1-D where it is computed: activations are observed per tensor, so only their
values matter, and 1-D values of any length can be joined. Then, one body at a time, outwards:

* If: the branch that computes the tensor gets it as an extra output, the other branch an empty
  1-D tensor of the same element type, and the If node an extra output. A run that takes the
  other branch yields an empty array, which observers skip: a branch never taken is never
  observed.
* Loop: an extra loop-carried value starts empty and has each iteration's values appended
  (Concat along axis 0), so iterations may differ in size; a Loop that runs no iteration yields
  an empty array.
* Scan: an extra scan output (Scan state cannot change shape between iterations), so the
  tensor must have the same size in every iteration, as Scan bodies' tensors normally do.

A tensor of a body nested in bodies is carried out through each level in turn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.names import NameAllocator
from qcal.graph.structure import DEFAULT_DOMAINS, attribute_graphs, graph_element_types
from qcal.numerics.errors import ModelError

__all__ = ["ExposedTensors", "expose_subgraph_tensors"]

_BODY_OPS = frozenset({"If", "Loop", "Scan"})


@dataclass(frozen=True)
class ExposedTensors:
    """A model whose main graph outputs carry the values of tensors defined in bodies.

    Attributes:
        model: the rewritten copy (or the model itself when no tensor needed routing).
        sources: observed tensor -> the main-graph value carrying its values (the tensor
            itself when the main graph defines it; a 1-D or, from Scan, 2-D tensor otherwise).
    """

    model: onnx.ModelProto
    sources: dict[str, str]


@dataclass
class _Scope:
    """A graph of the model and, for a body, the node holding it and that node's graph."""

    graph: onnx.GraphProto
    parent: _Scope | None = None
    node: onnx.NodeProto | None = None
    attribute: str = ""  # the node's attribute holding the body ("then_branch", "body", ...)


def expose_subgraph_tensors(model: onnx.ModelProto, tensors: Iterable[str]) -> ExposedTensors:
    """Route every tensor of `tensors` defined inside an If/Loop/Scan body to a main output.

    Raises:
        ModelError: a tensor is not defined in the model, sits in the graph of another kind of
            node, or has an unknown element type.
    """
    wanted = sorted(set(tensors))
    scopes = _definitions(model.graph)
    missing = [t for t in wanted if t not in scopes]
    if missing:
        raise ModelError(f"tensor {missing[0]!r} to observe is not defined in the model")
    inner = [t for t in wanted if scopes[t].parent is not None]
    sources = {t: t for t in wanted}
    if not inner:
        return ExposedTensors(model, sources)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    router = _Router(out, graph_element_types(out.graph))
    for tensor, scope in _definitions(out.graph).items():
        if tensor in inner:
            sources[tensor] = router.route(tensor, scope)
    router.finish()
    return ExposedTensors(out, sources)


def _definitions(graph: onnx.GraphProto) -> dict[str, _Scope]:
    """Value name -> the scope defining it, for the main graph and every If/Loop/Scan body."""
    found: dict[str, _Scope] = {}

    def visit(scope: _Scope) -> None:
        g = scope.graph
        for name in [v.name for v in g.input] + [t.name for t in g.initializer]:
            found.setdefault(name, scope)
        for node in g.node:
            for name in node.output:
                if name:
                    found.setdefault(name, scope)
            if node.op_type in _BODY_OPS and node.domain in DEFAULT_DOMAINS:
                for attribute in node.attribute:
                    for body in attribute_graphs(attribute):
                        visit(_Scope(body, scope, node, attribute.name))

    visit(_Scope(graph))
    return found


class _Router:
    """The edits of one routing run; new nodes are placed when `finish` is called."""

    def __init__(self, model: onnx.ModelProto, types: dict[str, int]) -> None:
        self._model = model
        self._types = types
        self._names = NameAllocator.from_model(model)
        self._flat: set[str] = set()  # values already 1-D (routed from an inner body)
        # graph id -> node name -> nodes to insert before it (Loop initial values)
        self._before: defaultdict[int, defaultdict[str, list[onnx.NodeProto]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self._graphs: dict[int, tuple[int, onnx.GraphProto]] = {}  # id -> (depth, graph)

    def route(self, tensor: str, scope: _Scope) -> str:
        """Carry `tensor` out of its scope to the main graph; the main-graph value's name."""
        elem_type = self._types.get(tensor)
        if elem_type is None:
            raise ModelError(f"tensor {tensor!r}: its element type is unknown; cannot observe it")
        value = tensor
        while scope.parent is not None:
            assert scope.node is not None
            value = self._out_of(scope, value, tensor, elem_type)
            scope = scope.parent
        self._model.graph.output.append(helper.make_tensor_value_info(value, elem_type, None))
        return value

    def finish(self) -> None:
        """Insert the nodes that must precede their Loop nodes."""
        # Innermost graphs first: rewriting a graph copies its nodes, bodies included.
        for key in sorted(self._before, key=lambda k: -self._graphs[k][0]):
            inserts, graph = self._before[key], self._graphs[key][1]
            ordered: list[onnx.NodeProto] = []
            for node in graph.node:
                ordered += inserts.get(node.name, [])
                ordered.append(node)
            copies = [onnx.NodeProto() for _ in ordered]
            for copy, node in zip(copies, ordered):
                copy.CopyFrom(node)
            del graph.node[:]
            graph.node.extend(copies)

    def _out_of(self, scope: _Scope, value: str, tensor: str, elem_type: int) -> str:
        """Carry `value` of body `scope.graph` out through the node holding the body."""
        node, body = scope.node, scope.graph
        assert node is not None and scope.parent is not None
        flat = self._flatten(body, value, tensor)
        outer = self._names.allocate(f"{tensor}_observed")
        if node.op_type == "If":
            for attribute in node.attribute:
                for branch in attribute_graphs(attribute):
                    if attribute.name == scope.attribute:
                        result = flat
                    else:
                        result = self._empty(branch, tensor, elem_type)
                    branch.output.append(_flat_info(result, elem_type))
            node.output.append(outer)
        elif node.op_type == "Loop":
            carried = len(body.input) - 2  # inputs: iteration number, condition, carried values
            before = self._names.allocate(f"{tensor}_observed_so_far")
            after = self._names.allocate(f"{tensor}_observed_next")
            body.input.append(_flat_info(before, elem_type))
            body.node.append(
                helper.make_node(
                    "Concat",
                    [before, flat],
                    [after],
                    name=self._names.allocate(f"{tensor}_Concat"),
                    axis=0,
                )
            )
            body.output.insert(1 + carried, _flat_info(after, elem_type))
            start = self._names.allocate(f"{tensor}_observed_start")
            self._insert_before(
                scope.parent,
                node,
                _empty_constant(
                    start, elem_type, self._names.allocate(f"{tensor}_observed_start_Constant")
                ),
            )
            while len(node.input) < 2 + carried:
                node.input.append("")
            node.input.append(start)
            node.output.insert(carried, outer)
        else:  # Scan: a scan output; each iteration's values must have the same size
            body.output.append(_flat_info(flat, elem_type))
            node.output.append(outer)
            for attribute in node.attribute:
                if attribute.name in ("scan_output_axes", "scan_output_directions"):
                    attribute.ints.append(0)
        return outer

    def _flatten(self, graph: onnx.GraphProto, value: str, tensor: str) -> str:
        """A 1-D copy of `value` in `graph` (a fresh name: body outputs must be own values)."""
        flat = self._names.allocate(f"{tensor}_flat")
        if value in self._flat:
            graph.node.append(
                helper.make_node(
                    "Identity", [value], [flat], name=self._names.allocate(f"{tensor}_Identity")
                )
            )
        else:
            shape = self._names.allocate(f"{tensor}_flat_shape")
            graph.node.append(
                helper.make_node(
                    "Constant",
                    [],
                    [shape],
                    name=self._names.allocate(f"{tensor}_flat_Constant"),
                    value=numpy_helper.from_array(np.array([-1], np.int64)),
                )
            )
            graph.node.append(
                helper.make_node(
                    "Reshape",
                    [value, shape],
                    [flat],
                    name=self._names.allocate(f"{tensor}_Reshape"),
                )
            )
        self._flat.add(flat)
        return flat

    def _empty(self, graph: onnx.GraphProto, tensor: str, elem_type: int) -> str:
        name = self._names.allocate(f"{tensor}_not_computed")
        graph.node.append(
            _empty_constant(
                name, elem_type, self._names.allocate(f"{tensor}_not_computed_Constant")
            )
        )
        return name

    def _insert_before(self, scope: _Scope, node: onnx.NodeProto, new: onnx.NodeProto) -> None:
        depth, outer = 0, scope.parent
        while outer is not None:
            depth, outer = depth + 1, outer.parent
        self._graphs[id(scope.graph)] = (depth, scope.graph)
        self._before[id(scope.graph)][node.name].append(new)


def _flat_info(name: str, elem_type: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [None])


def _empty_constant(name: str, elem_type: int, node_name: str) -> onnx.NodeProto:
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    return helper.make_node(
        "Constant",
        [],
        [name],
        name=node_name,
        value=numpy_helper.from_array(np.zeros((0,), dtype)),
    )
