"""How the Q/DQ writer edits graphs: new nodes and initializers under collision-checked names,
placed so that a sorted graph stays sorted, redirected reads, and the read counts that say when
a float initializer or a node can go. One `_Rewrite` per graph, nested bodies included, held
by one `_Scopes` per pass."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.names import NameAllocator
from qcal.graph.qdq._codes import (
    _CLIP_INPUTS_OPSET,
    _PASS_NAME,
    _float_array,
    integer_tensor,
)
from qcal.graph.structure import UseIndex, attribute_graphs, graph_element_types
from qcal.numerics.errors import ModelError

if TYPE_CHECKING:
    from qcal.graph.structure import Use
    from qcal.numerics.onnx_mapping import OnnxQParams


class _Scopes:
    """The edits of one pass over the main graph and every graph nested in it, one `_Rewrite`
    per graph. Value and node names are unique across graphs (NameNodes, and ONNX forbids a
    body from redefining an outer value), so a node name says which graph it sits in."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        names: NameAllocator,
        *,
        opset: int,
        ranks: Mapping[str, int],
    ) -> None:
        self._names, self._opset, self._ranks = names, opset, ranks
        self._types = graph_element_types(graph)
        self.rewrites: list[_Rewrite] = []
        self.reads = _Reads()
        self.defined: dict[str, _Rewrite] = {}  # value -> rewrite of the graph defining it
        self._of_node: dict[str, _Rewrite] = {}
        self._twice: set[str] = set()
        self._owner: dict[str, _Rewrite] = {}  # initializer -> rewrite of the graph holding it
        self._maybe_unread: list[str] = []
        self.main = self._visit(graph, frozenset())

    def _visit(self, graph: onnx.GraphProto, outer: frozenset[str]) -> _Rewrite:
        rewrite = _Rewrite(
            graph, self._names, opset=self._opset, ranks=self._ranks, types=self._types,
            reads=self.reads, outer=outer,
        )
        self.rewrites.append(rewrite)
        for node in graph.node:
            if node.name and self._of_node.setdefault(node.name, rewrite) is not rewrite:
                self._twice.add(node.name)
        for name in rewrite.index.initializers:
            self._owner.setdefault(name, rewrite)
        local = {v.name for v in graph.input} | set(rewrite.index.initializers)
        local.update(rewrite.index.producer)
        for name in local:
            self.defined.setdefault(name, rewrite)
        inner = outer | local
        for node in graph.node:
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    self._visit(subgraph, inner)
        return rewrite

    @property
    def modified(self) -> bool:
        return any(r.modified for r in self.rewrites)

    def by_graph(
        self, nodes: Iterable[str], error: Callable[[str], ModelError]
    ) -> list[tuple[_Rewrite, list[str]]]:
        """`nodes` (names, sorted) grouped by the graph holding them, main graph first."""
        groups: dict[int, list[str]] = defaultdict(list)
        order = {id(r): i for i, r in enumerate(self.rewrites)}
        for node in sorted(set(nodes)):
            if node in self._twice:
                raise error(f"node name {node!r} is not unique")
            rewrite = self._of_node.get(node)
            if rewrite is None:
                raise error(f"node {node!r} is not in the graph")
            groups[order[id(rewrite)]].append(node)
        return [(self.rewrites[i], groups[i]) for i in sorted(groups)]

    def definer(self, value: str) -> _Rewrite:
        """The rewrite of the graph that defines `value`."""
        return self.defined[value]

    def initializer(self, name: str) -> onnx.TensorProto | None:
        owner = self._owner.get(name)
        return None if owner is None else owner.index.initializers[name]

    def drop_if_unused(self, tensor: str) -> None:
        """Drop float initializer `tensor` at the end if nothing reads it any more."""
        self._maybe_unread.append(tensor)

    def is_read(self, value: str) -> bool:
        """Whether a node (one this pass added included, a removed one not) or a graph output of
        any graph reads `value` now."""
        return self.reads.counts(self.rewrites)[value] > 0

    def finish(self) -> None:
        for tensor in self._maybe_unread:
            if not self.is_read(tensor):
                self._owner[tensor].drop(tensor)
        # Innermost graphs first: writing a graph copies its nodes, bodies included.
        for rewrite in reversed(self.rewrites):
            rewrite.finish()


class _Reads:
    """How many times each value of the graphs of a pass is read now: as an input of a node (one
    the pass added included, a removed one not) or as a graph output. Counted over every graph
    when first asked, then kept up to date by the edits (`_Rewrite.add_node`, `redirect` and
    `remove`), so each question after the first costs a lookup, not a walk of the graphs.
    It holds no reference to the rewrites, which hold it: a cycle would keep their new
    initializers (the quantized weights) alive after the pass until the garbage collector runs."""

    def __init__(self) -> None:
        self._count: Counter[str] | None = None
        self._removed: set[int] = set()  # ids of the nodes removed, in every graph

    def counts(self, rewrites: Sequence[_Rewrite]) -> Counter[str]:
        if self._count is None:
            self._count = Counter()
            for rewrite in rewrites:
                rewrite.count_reads(self._count)
        return self._count

    def added(self, node: onnx.NodeProto) -> None:
        if self._count is not None:
            self._count.update(node.input)

    def redirected(self, node: onnx.NodeProto, old: str, new: str) -> None:
        if self._count is not None and id(node) not in self._removed:
            self._count[old] -= 1
            self._count[new] += 1

    def removed(self, node: onnx.NodeProto) -> None:
        if id(node) in self._removed:
            return
        self._removed.add(id(node))
        if self._count is not None:
            self._count.subtract(node.input)


class _Rewrite:
    """The edits of one pass over one graph: new nodes and initializers, redirected inputs.

    Nodes go right after the producer of the value they are named after (at the front for
    graph inputs, initializers and values of enclosing graphs), so a topologically sorted
    graph stays sorted.
    """

    def __init__(
        self,
        graph: onnx.GraphProto,
        names: NameAllocator,
        *,
        opset: int,
        ranks: Mapping[str, int],
        types: Mapping[str, int],
        reads: _Reads,
        outer: frozenset[str] = frozenset(),
    ) -> None:
        self.graph, self.names, self.opset, self._ranks = graph, names, opset, ranks
        self._reads = reads
        self.index = UseIndex.build(graph)
        self.types = types
        self._outer = outer
        self.nodes_by_name: dict[str, onnx.NodeProto] = {}
        duplicates: set[str] = set()
        self._position: dict[int, int] = {}
        for position, node in enumerate(graph.node):
            self._position[id(node)] = position
            if node.name and self.nodes_by_name.setdefault(node.name, node) is not node:
                duplicates.add(node.name)
        self.duplicate_node_names = frozenset(duplicates)
        self.modified = False
        self._front: list[onnx.NodeProto] = []
        self._after: defaultdict[int, list[onnx.NodeProto]] = defaultdict(list)
        self._new_producer: dict[str, onnx.NodeProto] = {}  # output (a fresh name) -> new node
        self._initializers: list[onnx.TensorProto] = []
        self._redirected: set[tuple[int, int]] = set()
        self._dropped: set[str] = set()
        self._removed: set[int] = set()  # ids of nodes (old or new) left out when written

    def is_value(self, name: str) -> bool:
        index = self.index
        return (
            name in index.producer
            or name in index.graph_inputs
            or name in index.initializers
            or name in self._outer
        )

    def add_qparams(self, tensor: str, qparams: OnnxQParams, float_type: int) -> tuple[str, str]:
        """Scale (in `float_type`) and zero-point initializers for `tensor`."""
        stored = _float_array(qparams.scale, float_type)
        if not (np.all(np.isfinite(stored)) and np.all(stored > 0)):
            type_name = TensorProto.DataType.Name(float_type)
            raise ModelError(f"{_PASS_NAME}: scale of {tensor!r} does not fit {type_name}")
        scale = self.add_constant(f"{tensor}_scale", stored)
        zero_point = self.add_integer_initializer(
            f"{tensor}_zero_point", np.asarray(qparams.zero_point), qparams.dtype
        )
        return scale, zero_point

    def add_clip(self, tensor: str, qparams: OnnxQParams, float_type: int) -> str:
        """Clip `tensor` to ``[clip_min, clip_max]`` before it is quantized; returns the output."""
        bounds = [
            (kind, None if bound is None else _float_array(bound, float_type))
            for kind, bound in (("min", qparams.clip_min), ("max", qparams.clip_max))
        ]
        if qparams.axis is None:
            return self._add_tensor_clip(tensor, bounds)
        shape = self._broadcast_shape(tensor, qparams)
        clipped = tensor
        for kind, bound in bounds:
            if bound is not None:
                constant = self.add_constant(f"{tensor}_clip_{kind}", bound.reshape(shape))
                op_type = "Max" if kind == "min" else "Min"
                clipped = self.add_node(
                    op_type,
                    tensor,
                    [clipped, constant],
                    None,
                    after=tensor,
                    output_suffix="clipped",
                )
        return clipped

    def _add_tensor_clip(self, tensor: str, bounds: list[tuple[str, np.ndarray | None]]) -> str:
        if self.opset < _CLIP_INPUTS_OPSET:
            attributes = {kind: float(bound) for kind, bound in bounds if bound is not None}
            return self.add_node(
                "Clip",
                tensor,
                [tensor],
                None,
                after=tensor,
                output_suffix="clipped",
                attributes=attributes,
            )
        inputs = [tensor] + [
            "" if bound is None else self.add_constant(f"{tensor}_clip_{kind}", bound)
            for kind, bound in bounds
        ]
        while inputs[-1] == "":
            inputs.pop()
        return self.add_node("Clip", tensor, inputs, None, after=tensor, output_suffix="clipped")

    def add_node(
        self,
        op_type: str,
        tensor: str,
        inputs: Sequence[str],
        axis: int | None,
        *,
        after: str | None,
        output_suffix: str | None = None,
        attributes: Mapping[str, float] | None = None,
        output: str | None = None,
    ) -> str:
        """Add an `op_type` node named after `tensor`, placed after the producer of `after`;
        it writes `output` when given (a graph output's name, `rename_output` having moved its
        writer's value away), else a name of its own."""
        suffix = output_suffix or {"QuantizeLinear": "quantized"}.get(op_type, "dequantized")
        output = output or self.names.allocate(f"{tensor}_{suffix}")
        node = helper.make_node(
            op_type, list(inputs), [output], name=self.names.allocate(f"{tensor}_{op_type}")
        )
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        for key, value in sorted((attributes or {}).items()):
            node.attribute.append(helper.make_attribute(key, value))
        producer = None if after is None else self.index.producer.get(after)
        if producer is None:
            self._front.append(node)
        else:
            self._after[self._position[id(producer)]].append(node)
        self._new_producer[output] = node
        self._reads.added(node)
        self.modified = True
        return output

    def rename_output(self, value: str) -> str:
        """Have the node writing `value` write a new name instead, returned, so that another
        node can write `value` (a graph output) from it. Its producer stays findable under
        `value` in the index, for placing nodes after it."""
        producer = self.index.producer[value]
        renamed = self.names.allocate(f"{value}_before_quantize")
        producer.output[list(producer.output).index(value)] = renamed
        self.modified = True
        return renamed

    def add_constant(self, base: str, value: np.ndarray) -> str:
        name = self.names.allocate(base)
        self._initializers.append(numpy_helper.from_array(value, name))
        return name

    def add_integer_initializer(self, base: str, codes: np.ndarray, dtype: int) -> str:
        name = self.names.allocate(base)
        self._initializers.append(integer_tensor(name, codes, dtype))
        return name

    def redirect(self, uses: Sequence[Use], value: str) -> None:
        """Make each use read `value` instead of what it read."""
        for use in uses:
            old = use.node.input[use.slot]
            use.node.input[use.slot] = value
            self._reads.redirected(use.node, old, value)
            self._redirected.add((id(use.node), use.slot))
        self.modified = True

    def count_reads(self, count: Counter[str]) -> None:
        """Count every read of a value by this graph's nodes (new ones included) and outputs."""
        for node in (*self.graph.node, *self._new_nodes()):
            if id(node) not in self._removed:
                count.update(node.input)
        count.update(v.name for v in self.graph.output)

    def remove(self, node: onnx.NodeProto) -> None:
        """Leave `node` (of this graph, or added by this pass) out when the graph is written."""
        self._reads.removed(node)
        self._removed.add(id(node))
        self.modified = True

    def remove_producer(self, value: str) -> None:
        """Leave out the node this pass added that writes `value`."""
        node = self._new_producer.get(value)
        if node is not None:
            self.remove(node)

    def _new_nodes(self) -> Iterator[onnx.NodeProto]:
        yield from self._front
        for nodes in self._after.values():
            yield from nodes

    def drop(self, tensor: str) -> None:
        """Remove initializer `tensor` when the graph is written."""
        self._dropped.add(tensor)

    def finish(self) -> None:
        """Write nodes in topological order, add the new initializers, remove dropped floats."""
        if self._front or self._after:
            ordered: list[onnx.NodeProto] = list(self._front)
            for position, node in enumerate(self.graph.node):
                ordered.append(node)
                ordered.extend(self._after.get(position, ()))
            ordered = [node for node in ordered if id(node) not in self._removed]
            copies = [onnx.NodeProto() for _ in ordered]
            for copy, node in zip(copies, ordered):
                copy.CopyFrom(node)
            del self.graph.node[:]
            self.graph.node.extend(copies)
        for values in (self.graph.initializer, self.graph.input, self.graph.value_info):
            for i in reversed(range(len(values))):
                if values[i].name in self._dropped:
                    del values[i]
        self.graph.initializer.extend(self._initializers)

    def _broadcast_shape(self, tensor: str, qparams: OnnxQParams) -> tuple[int, ...]:
        """Shape ``(C, 1, ..., 1)`` that lines per-axis clip bounds up with `qparams.axis`."""
        assert qparams.axis is not None
        axis, channels = qparams.axis, int(np.asarray(qparams.scale).size)
        if axis < 0:
            return (channels,) + (1,) * (-axis - 1)
        rank = self._ranks.get(tensor)
        if rank is None:
            raise ModelError(
                f"{_PASS_NAME}: rank of activation {tensor!r} is unknown; "
                f"cannot clip it on axis {axis}"
            )
        return (channels,) + (1,) * (rank - axis - 1)
