"""Models that draw random numbers when they run (a VITS text-to-speech model adds
`RandomNormalLike` noise to its latent, a diffusion step its own): the same draws on every run of
qcal's.

onnxruntime seeds such a node anew in every process, so calibrating on fresh draws would make
the statistics, and the model qcal writes, differ from one run to the next; and comparing the
quantized model with the float one would measure two different draws, not quantization (a
three-Conv model with noise added read 7 dB against itself). So every session qcal opens runs
a copy of the model in which each random node takes its values from a fixed table of draws of the
same distribution instead: the same values on every run, for the float model and the quantized
one alike, in any order of the data. The draws keep their distribution, so the ranges calibrated
cover the noise the model adds when it is deployed. The model written keeps its random nodes.

A node's values are the first ones of its own stretch of the table (the table repeated where it
needs more), shaped as its output: two samples run together draw other values than each alone
does, so the batch check of `qcal.calibration.batch_check` runs such a model a sample at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.names import first_and_more
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    default_opset,
    float_attribute,
    graph_element_types,
    int_attribute,
    ints_attribute,
    node_subgraphs,
)

__all__ = ["RANDOM_OPS", "kernel_probes", "random_draws_note", "random_nodes", "with_fixed_draws"]

# Operators drawing values at random (Dropout is not one of them at inference; in training
# mode it is refused: `qcal.graph.training_mode`; Multinomial's draws are left as they are).
RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli"})
# Values in each table: 2^18 float32 values (1 MiB), repeated beyond that.
_TABLE_SIZE = 1 << 18
_TABLE_SEED = 20261129
# Where each node's stretch of its table starts: nodes apart by this many values (a prime).
_NODE_STRIDE = 7919
_NORMAL = "qcal_fixed_draws_normal"
_UNIFORM = "qcal_fixed_draws_uniform"


def random_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of `graph` and of the graphs nested in it that draw at random."""
    for node in graph.node:
        if node.op_type in RANDOM_OPS and node.domain in DEFAULT_DOMAINS:
            yield node
        for subgraph in node_subgraphs(node):
            yield from random_nodes(subgraph)


def random_draws_note(graph: onnx.GraphProto) -> str | None:
    """What the report says of a model that draws at random (module docstring), or None."""
    nodes = [n.name or n.output[0] for n in random_nodes(graph)]
    if not nodes:
        return None
    return (f"{first_and_more(nodes)} draws random values on every run: qcal's runs give it the same "
            "fixed draws of its distribution on each run instead (float and quantized alike, so "
            "the statistics and figures do not change from one run to the next, and the "
            "comparison measures quantization, not two draws); the model written draws at "
            "random as the float one does")


def with_fixed_draws(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` whose random nodes take fixed draws (module docstring); None when it
    has none (the model itself is then what runs)."""
    if next(random_nodes(model.graph), None) is None:
        return None
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    types = graph_element_types(fixed.graph)
    cast_like = (default_opset(fixed) or 0) >= 15
    rng = np.random.default_rng(_TABLE_SEED)
    tables = {_NORMAL: rng.standard_normal(_TABLE_SIZE, dtype=np.float32),
              _UNIFORM: rng.random(_TABLE_SIZE, dtype=np.float32)}
    fixed.graph.initializer.extend(numpy_helper.from_array(t, name) for name, t in tables.items())
    count = [0]
    _replace_in(fixed.graph, fixed.graph, types, cast_like, count)
    return fixed


def kernel_probes(model: onnx.ModelProto) -> list[bytes]:
    """One model of a single node per kind of random node of `model` (its operator, attributes
    and input type, at the model's opsets), serialized: the fixed draws stand
    in for the node in every session, so whether onnxruntime implements it is asked of these
    (opset 22's RandomUniformLike it does not)."""
    types = graph_element_types(model.graph)
    probes: list[bytes] = []
    for node in random_nodes(model.graph):
        inputs = [helper.make_tensor_value_info(v, types.get(v, TensorProto.FLOAT), None)
                  for v in node.input if v]
        alone = helper.make_node(node.op_type, [v.name for v in inputs], ["drawn"],
                                 domain=node.domain)
        alone.attribute.extend(node.attribute)
        probe = helper.make_model(
            helper.make_graph([alone], "probe", inputs, [helper.make_value_info(
                "drawn", onnx.TypeProto())]),
            opset_imports=model.opset_import, ir_version=model.ir_version)
        serialized = probe.SerializeToString(deterministic=True)
        if serialized not in probes:
            probes.append(serialized)
    return probes


def _replace_in(graph: onnx.GraphProto, main: onnx.GraphProto, types: dict[str, int],
                cast_like: bool, count: list[int]) -> None:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for subgraph in node_subgraphs(node):
            _replace_in(subgraph, main, types, cast_like, count)
        if node.op_type in RANDOM_OPS and node.domain in DEFAULT_DOMAINS:
            nodes.extend(_draws(node, main, types, cast_like, count[0]))
            count[0] += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _draws(node: onnx.NodeProto, main: onnx.GraphProto, types: dict[str, int], cast_like: bool,
           index: int) -> list[onnx.NodeProto]:
    """The nodes computing `node`'s output from the tables: its shape, the stretch of the table
    of that many values, scaled to the node's distribution and cast to its type."""
    def name(part: str) -> str:  # the names of this node's values
        return f"qcal_fixed_draws_{index}/{part}"

    offset = (index * _NODE_STRIDE) % _TABLE_SIZE
    op = node.op_type
    nodes: list[onnx.NodeProto] = []
    if op in ("RandomNormal", "RandomUniform"):
        shape = ints_attribute(node, "shape")
        main.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), name("shape")))
    else:
        nodes.append(helper.make_node("Shape", [node.input[0]], [name("shape")], name("Shape")))
    constants = {
        "length": np.array([_TABLE_SIZE], np.int64), "start": np.array([offset], np.int64),
        "spare": np.array([offset + _TABLE_SIZE - 1], np.int64), "axis": np.array([0], np.int64),
    }
    main.initializer.extend(numpy_helper.from_array(v, name(k)) for k, v in constants.items())
    table = _NORMAL if op.startswith("RandomNormal") else _UNIFORM
    nodes += [
        helper.make_node("ReduceProd", [name("shape")], [name("count")], name("ReduceProd"),
                         keepdims=1),
        helper.make_node("Add", [name("count"), name("spare")], [name("needed")], name("Add")),
        helper.make_node("Div", [name("needed"), name("length")], [name("repeats")],
                         name("Div")),
        helper.make_node("Tile", [table, name("repeats")], [name("tiled")], name("Tile")),
        helper.make_node("Add", [name("count"), name("start")], [name("end")], name("End")),
        helper.make_node("Slice", [name("tiled"), name("start"), name("end"), name("axis")],
                         [name("flat")], name("Slice")),
        helper.make_node("Reshape", [name("flat"), name("shape")], [name("unit")],
                         name("Reshape")),
    ]
    if op == "Bernoulli":  # 1 where a uniform draw falls below the probability
        unit, kind = name("unit"), types.get(node.input[0], 0)
        if kind not in (0, TensorProto.FLOAT) or not kind and cast_like:
            unit = name("typed")
            nodes.append(helper.make_node("Cast", [name("unit")], [unit], name("Typed"), to=kind)
                         if kind else
                         helper.make_node("CastLike", [name("unit"), node.input[0]], [unit],
                                          name("Typed")))
        drawn = name("drawn")
        nodes.append(helper.make_node("Less", [unit, node.input[0]], [drawn], name("Less")))
    else:
        if op.startswith("RandomNormal"):  # mean + scale * N(0, 1)
            base = float_attribute(node, "mean", 0.0)
            spread = float_attribute(node, "scale", 1.0)
        else:  # low + (high - low) * U[0, 1)
            base = float_attribute(node, "low", 0.0)
            spread = float_attribute(node, "high", 1.0) - base
        main.initializer.extend([
            numpy_helper.from_array(np.array(spread, np.float32), name("spread")),
            numpy_helper.from_array(np.array(base, np.float32), name("base"))])
        nodes += [
            helper.make_node("Mul", [name("unit"), name("spread")], [name("scaled")], name("Mul")),
            helper.make_node("Add", [name("scaled"), name("base")], [name("drawn")], name("Base")),
        ]
        drawn = name("drawn")
    nodes.append(_cast(node, drawn, types, cast_like, name("Cast")))
    return nodes


def _cast(node: onnx.NodeProto, drawn: str, types: dict[str, int], cast_like: bool,
          name: str) -> onnx.NodeProto:
    """The node writing `node`'s output: the draws cast to its type (its `dtype`, else its
    input's, else float)."""
    dtype = int_attribute(node, "dtype", 0)
    if not dtype and (node.op_type.endswith("Like") or node.op_type == "Bernoulli"):
        dtype = types.get(node.input[0], 0)
        if not dtype and cast_like:
            return helper.make_node("CastLike", [drawn, node.input[0]], [node.output[0]], name)
    return helper.make_node("Cast", [drawn], [node.output[0]], name,
                            to=dtype or TensorProto.FLOAT)

