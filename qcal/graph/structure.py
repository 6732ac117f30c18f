"""Graph helpers shared by the preparation passes and the quantization planner.

A `UseIndex` records, once per pass, who produces each value of one graph and who reads it
(including reads from inside a node's subgraphs), so a rewrite is "replace every use of x with
y" and never a scan of ``graph.node`` by name.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import onnx

__all__ = [
    "COMPUTE_OPS",
    "DEFAULT_DOMAINS",
    "FLOAT_TYPES",
    "NOT_FLOAT",
    "NO_RULE",
    "SHAPE_READERS",
    "SUBGRAPH_SLOT",
    "Use",
    "UseIndex",
    "all_graphs",
    "attribute_graphs",
    "bypass_nodes",
    "check_wiring",
    "computed_from_constants",
    "default_opset",
    "drop_unread_initializers",
    "drop_value_info",
    "element_types",
    "exposing",
    "float_attribute",
    "graph_element_types",
    "insert_after",
    "int_attribute",
    "ints_attribute",
    "keep_declared_shapes",
    "node_subgraphs",
    "string_attribute",
    "subgraph_reads",
]

DEFAULT_DOMAINS = ("", "ai.onnx")
# The operators that hold a model's multiply-accumulates (its weights, its coverage).
COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
# Operators that read only their input's shape (and element count), never its values.
SHAPE_READERS = frozenset({"Shape", "Size"})
_SAME_SHAPE_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
SUBGRAPH_SLOT = -1  # input slot recorded when a node reads a value inside one of its subgraphs
# Element types qcal quantizes (observed in float32). double is left alone: QuantizeLinear
# does not accept it.
FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)
# Why a node whose data input is of another type (double, integer) stays float.
NOT_FLOAT = "no float input to quantize"
# Why a node of an operator qcal has no rule for stays float (an onnxruntime contrib operator).
NO_RULE = "no quantization rule for op"


@dataclass(frozen=True)
class Use:
    """One read of a value: `node` reads it at input `slot` (`SUBGRAPH_SLOT`: in a subgraph)."""

    node: onnx.NodeProto
    slot: int


@dataclass
class UseIndex:
    """Producers and readers of every value of one graph (not of its subgraphs' own values).

    Attributes:
        producer: value name -> the node that writes it.
        uses: value name -> every read, in graph order.
        graph_inputs, graph_outputs: names of the graph's inputs and outputs.
        initializers: initializer name -> tensor (the proto itself, not a copy).
    """

    producer: dict[str, onnx.NodeProto]
    uses: dict[str, list[Use]]
    graph_inputs: frozenset[str]
    graph_outputs: frozenset[str]
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)

    @classmethod
    def build(cls, graph: onnx.GraphProto) -> UseIndex:
        producer: dict[str, onnx.NodeProto] = {}
        uses: dict[str, list[Use]] = {}
        for node in graph.node:
            for value in node.output:
                if value:
                    producer[value] = node
            for slot, value in enumerate(node.input):
                if value:
                    uses.setdefault(value, []).append(Use(node, slot))
            for value in sorted(subgraph_reads(node)):
                uses.setdefault(value, []).append(Use(node, SUBGRAPH_SLOT))
        return cls(
            producer=producer,
            uses=uses,
            graph_inputs=frozenset(v.name for v in graph.input),
            graph_outputs=frozenset(v.name for v in graph.output),
            initializers={t.name: t for t in graph.initializer},
        )

    def readers(self, value: str) -> list[onnx.NodeProto]:
        """Distinct nodes reading `value`, in graph order."""
        seen: dict[int, onnx.NodeProto] = {}
        for use in self.uses.get(value, ()):
            seen.setdefault(id(use.node), use.node)
        return list(seen.values())

    def only_reader(self, value: str) -> onnx.NodeProto | None:
        """The node that reads `value` when it is read once, by that node alone, and is not a
        graph output (a pass may then rewrite the two together); else None."""
        uses = self.uses.get(value, ())
        if len(uses) != 1 or value in self.graph_outputs:
            return None
        return uses[0].node

    def constant(self, value: str) -> onnx.TensorProto | None:
        """The initializer holding `value`, unless a graph input of that name may override it."""
        if value in self.graph_inputs:
            return None
        return self.initializers.get(value)

    def follow(
        self, value: str, through: frozenset[str], until: Container[str] = frozenset()
    ) -> tuple[str, onnx.NodeProto | None]:
        """Where `value` leads through a chain of `through` operators, each its input's only
        reader: the value reached (`value` itself, a graph output or one in `until` at the
        latest) and its only reader past the chain (None: none, several, or it stopped)."""
        while value not in until and value not in self.graph_outputs:
            readers = self.readers(value)
            if len(readers) != 1:
                return value, None
            if readers[0].op_type not in through or len(readers[0].output) != 1:
                return value, readers[0]
            value = readers[0].output[0]
        return value, None

    def upstream(self, values: Iterable[str],
                 through: Callable[[onnx.NodeProto], bool] = lambda node: True) -> frozenset[str]:
        """`values` and every value they are computed from, back through the nodes `through`
        accepts (a node it refuses adds its output, not its inputs)."""
        found: set[str] = set()
        pending = list(values)
        while pending:
            value = pending.pop()
            if value in found:
                continue
            found.add(value)
            node = self.producer.get(value)
            if node is not None and through(node):
                pending.extend(v for v in node.input if v)
        return frozenset(found)

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of `old` (subgraphs included) read `new` instead."""
        for use in self.uses.pop(old, []):
            if use.slot == SUBGRAPH_SLOT:
                for graph in node_subgraphs(use.node):
                    _rename_reads(graph, old, new)
            else:
                use.node.input[use.slot] = new
            self.uses.setdefault(new, []).append(use)


def int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    """`node`'s integer attribute `name`, or `default` when it has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            return int(attribute.i)
    return default


def float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    """`node`'s float attribute `name`, or `default` when it has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            return float(attribute.f)
    return default


def ints_attribute(node: onnx.NodeProto, name: str, default: Iterable[int] = ()) -> list[int]:
    """`node`'s integer-list attribute `name`, or `default` when it has none."""
    return next((list(a.ints) for a in node.attribute if a.name == name), list(default))


def string_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    """`node`'s string attribute `name`, or `default` when it has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            return str(attribute.s.decode())
    return default


def attribute_graphs(attribute: onnx.AttributeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held by one attribute (If branches, Loop/Scan bodies)."""
    if attribute.type == onnx.AttributeProto.GRAPH:
        yield attribute.g
    elif attribute.type == onnx.AttributeProto.GRAPHS:
        yield from attribute.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every graph nested in its nodes' attributes, depth first in graph order."""
    yield graph
    for node in graph.node:
        for subgraph in node_subgraphs(node):
            yield from all_graphs(subgraph)


def keep_declared_shapes(graph: onnx.GraphProto, declared: Container[str]) -> None:
    """Drop the value_info of `graph` and its subgraphs that the user's model did not declare
    (`declared`), but for the values a Shape or Size node reads (and, when it reads codes, the
    float tensor they quantize).

    onnxruntime's graph optimizations depend on the shapes a model states. With every shape
    that onnx shape inference finds (the planner needs them), it fuses an Add before a
    LayerNormalization into SkipLayerNormalization, whose CPU kernel is 3-7x slower than the
    pair: a BERT-like encoder ran 1.3x slower than as exported, the float model too. A value
    whose shape a Shape node reads keeps it: onnxruntime folds the shape arithmetic with it
    (in the exported model it matches the Shape with the Reshape reading the same value, which
    a Q/DQ pair between the two hides).
    """
    for g in all_graphs(graph):
        producer = {v: node for node in g.node for v in node.output}
        shape_read = set()
        for node in g.node:
            if node.op_type in SHAPE_READERS and node.domain in DEFAULT_DOMAINS and node.input:
                value = node.input[0]
                shape_read.add(value)
                while value in producer and producer[value].op_type in _SAME_SHAPE_QDQ:
                    value = producer[value].input[0]  # codes: the float tensor's shape
                    shape_read.add(value)
        kept = [v for v in g.value_info if v.name in declared or v.name in shape_read]
        if len(kept) != len(g.value_info):
            del g.value_info[:]
            g.value_info.extend(kept)


def drop_value_info(graph: onnx.GraphProto, names: Container[str]) -> None:
    """Remove the value_info of `graph` (not of its subgraphs) for `names`: values a pass
    removed or renamed, whose recorded shape and type no longer hold."""
    stale = [v for v in graph.value_info if v.name in names]
    for value_info in stale:
        graph.value_info.remove(value_info)


def bypass_nodes(graph: onnx.GraphProto, positions: Iterable[int]) -> None:
    """Remove the nodes of `graph` at `positions`, each of one input and one output, their
    readers (inside subgraphs too) reading their inputs instead; in graph order, so a chain of
    them resolves to its first input. The callers keep any whose output is a graph output."""
    removed = set(positions)
    if not removed:
        return
    index = UseIndex.build(graph)
    for position in sorted(removed):
        node = graph.node[position]
        index.replace_uses(node.output[0], node.input[0])
    drop_value_info(graph, {graph.node[p].output[0] for p in removed})
    kept = [n for p, n in enumerate(graph.node) if p not in removed]
    del graph.node[:]
    graph.node.extend(kept)


def drop_unread_initializers(graph: onnx.GraphProto, candidates: Container[str]) -> None:
    """Remove the initializers among `candidates` that nothing reads any more (a subgraph
    included) and that are neither graph inputs nor outputs; other initializers stay."""
    index = UseIndex.build(graph)
    kept = index.graph_inputs | index.graph_outputs
    unread = [t for t in graph.initializer
              if t.name in candidates and t.name not in index.uses and t.name not in kept]
    for tensor in unread:
        graph.initializer.remove(tensor)


def node_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs `node` holds (an If's branches, a Loop's or Scan's body), none for most."""
    for attribute in node.attribute:
        yield from attribute_graphs(attribute)


# Operators whose output is not a function of their inputs alone.
_NOT_FUNCTIONS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                            "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


def computed_from_constants(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes of `graph` (in topological order) that compute from its initializers
    alone, through other such nodes: work onnxruntime does once, when it loads the model
    (DeBERTa's projections of its relative-position table, Swin-v2's position-bias MLP)."""
    constant = {t.name for t in graph.initializer}
    found: set[str] = set()
    for node in graph.node:
        inputs = [v for v in node.input if v]
        if (inputs and all(v in constant for v in inputs) and node.domain in DEFAULT_DOMAINS
                and node.op_type not in _NOT_FUNCTIONS and not any(node_subgraphs(node))):
            found.add(node.name)
            constant.update(v for v in node.output if v)
    return found


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Outer-scope values that `node` reads from inside its subgraphs (empty for most nodes)."""
    reads: set[str] = set()
    for graph in node_subgraphs(node):
        reads |= _free_values(graph)
    return reads


def _free_values(graph: onnx.GraphProto) -> set[str]:
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    free: set[str] = set()
    for node in graph.node:
        free.update(v for v in node.input if v and v not in defined)
        free.update(v for v in subgraph_reads(node) if v not in defined)
        defined.update(node.output)
    free.update(v.name for v in graph.output if v.name not in defined)
    return free


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    # ONNX forbids a subgraph from redefining an outer name, so every `old` here is the outer one.
    for node in graph.node:
        for slot, value in enumerate(node.input):
            if value == old:
                node.input[slot] = new
        for subgraph in node_subgraphs(node):
            _rename_reads(subgraph, old, new)
    for output in graph.output:
        if output.name == old:
            output.name = new


def check_wiring(graph: onnx.GraphProto, outer: Iterable[str] = ()) -> str | None:
    """Why `graph` is not a well-formed dataflow graph, or None when it is.

    Checks, recursively into subgraphs, that nodes are topologically sorted, every read value
    is defined before use (outer-scope values count), no value is written twice and every
    graph output is defined. Linear in the graph size.
    """
    defined = set(outer)
    defined.update(v.name for v in graph.input)
    defined.update(t.name for t in graph.initializer)
    for sparse in graph.sparse_initializer:
        defined.add(sparse.values.name)
    for node in graph.node:
        label = node.name or f"({node.op_type})"
        for value in node.input:
            if value and value not in defined:
                return f"node {label} reads {value!r} before anything produces it"
        for subgraph in node_subgraphs(node):
            problem = check_wiring(subgraph, defined)
            if problem is not None:
                return problem
        for value in node.output:
            if value and value in defined:
                return f"node {label} writes {value!r}, which is already defined"
            defined.add(value)
    for output in graph.output:
        if output.name not in defined:
            return f"graph output {output.name!r} is not produced"
    return None


def element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """Known element types of the graph's values (value_info, inputs, outputs, constants)."""
    types: dict[str, int] = {}
    for value_info in (*graph.value_info, *graph.input, *graph.output):
        tensor_type = value_info.type.tensor_type
        if value_info.type.HasField("tensor_type") and tensor_type.elem_type:
            types[value_info.name] = tensor_type.elem_type
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and node.output:
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = attribute.t.data_type
    return types


def exposing(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` with the main-graph tensors `names` added as outputs (those that are
    outputs already stay as they are), typed where the type is known."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    types = element_types(model.graph)
    present = {o.name for o in model.graph.output}
    exposed.graph.output.extend(
        onnx.helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), None)
        for name in names if name not in present
    )
    return exposed


def graph_element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """`element_types` of `graph` and of every graph nested in it (outer scopes win)."""
    types: dict[str, int] = {}
    for node in graph.node:
        for subgraph in node_subgraphs(node):
            types.update(graph_element_types(subgraph))
    types.update(element_types(graph))
    return types


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain (ai.onnx) opset version, None when it imports none."""
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    return max(versions) if versions else None


def insert_after(graph: onnx.GraphProto, after: Mapping[int, list[onnx.NodeProto]]) -> None:
    """Put the new nodes right after the nodes they follow (position -1: before every node)."""
    ordered: list[onnx.NodeProto] = list(after.get(-1, ()))
    for position, node in enumerate(graph.node):
        ordered.append(node)
        ordered.extend(after.get(position, ()))
    ordered.extend(after.get(len(graph.node), ()))
    copies = [onnx.NodeProto() for _ in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
