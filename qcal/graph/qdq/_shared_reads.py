"""One value for the float nodes that read a dequantized activation.

onnxruntime gives every reader of a DequantizeLinear a copy of its own
(``EnsureUniqueDQForNodeUnit``: each QDQ node unit needs its own), float readers included.
Where the readers are a float chain that reads one value twice, its fusions then no longer see
one value: a GELU written out after an integer Conv (``x * (1 + erf(x / sqrt 2)) / 2``, x read
by the Div and the Mul) ran as two DequantizeLinear, Div, Erf, Add, Mul and Mul instead of one
fused Gelu: 0.93 ms against 0.59 ms on a [1, 64, 120, 120] tensor at one thread, the same
codes out. So when two or more readers of an activation's DequantizeLinear are nodes the plan
keeps float, they read ``Clip(x, -FLT_MAX)`` instead: exact for every value a DequantizeLinear
writes (finite), one elementwise pass where their copies cost one each, and one value for
onnxruntime's fusions (Gelu, QuickGelu, LayerNormalization written out). A Clip, not a Min:
onnxruntime's Clip splits its pass over the threads, its Min with a broadcast constant does not
(a PP-OCRv6 text detector's 17 of them, 2.6 ms as Min and 1.6 ms as Clip at one thread, 3.1 and
1.5 ms at two). Readers that the plan quantizes read the DequantizeLinear itself, as
onnxruntime's integer kernels need.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qcal.graph.names import NameAllocator
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, all_graphs, default_opset

__all__ = ["share_dequantized_reads"]

_FLOAT_MAX = np.finfo(np.float32).max


def share_dequantized_reads(model: onnx.ModelProto, float_nodes: frozenset[str]) -> int:
    """Put a ``Clip(x, -FLT_MAX)`` between each activation's DequantizeLinear (float32 output)
    and its readers in `float_nodes` when there are two or more (module docstring), in every
    graph; returns how many."""
    names = NameAllocator.from_model(model)
    opset = default_opset(model) or 13
    lowest = ""
    count = 0
    for graph in all_graphs(model.graph):
        index = UseIndex.build(graph)
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            nodes.append(node)
            value = node.output[0] if node.output else ""
            if (node.op_type != "DequantizeLinear" or node.domain not in DEFAULT_DOMAINS
                    or index.constant(node.input[0]) is not None or _output_type(node, index)
                    != onnx.TensorProto.FLOAT or value in index.graph_outputs):
                continue
            readers = [r for r in index.readers(value) if r.name in float_nodes]
            if len(readers) < 2:
                continue
            shared = names.allocate(f"{value}_shared")
            clip_name = names.allocate(f"{node.name}_shared")
            if opset < 11:  # the bound as an attribute before opset 11
                clip = helper.make_node("Clip", [value], [shared], name=clip_name,
                                        min=-_FLOAT_MAX)
            else:
                if not lowest:  # one constant for all, in the main graph (outer scope)
                    lowest = names.allocate("float_lowest")
                    model.graph.initializer.append(
                        numpy_helper.from_array(np.array(-_FLOAT_MAX, np.float32), lowest))
                clip = helper.make_node("Clip", [value, lowest], [shared], name=clip_name)
            nodes.append(clip)
            for reader in readers:
                for slot, name in enumerate(reader.input):
                    if name == value:
                        reader.input[slot] = shared
            count += 1
        if len(nodes) != len(graph.node):
            del graph.node[:]
            graph.node.extend(nodes)
    return count


def _output_type(node: onnx.NodeProto, index: UseIndex) -> int:
    """The element type a DequantizeLinear writes: its scale's (float32 unless given)."""
    scale = index.constant(node.input[1]) if len(node.input) > 1 else None
    return scale.data_type if scale is not None else onnx.TensorProto.FLOAT
