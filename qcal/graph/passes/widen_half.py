"""Pass: compute a float16/bfloat16 model in float32 inside, its inputs and outputs unchanged.

onnxruntime's CPU provider has integer kernels for float32 graphs only: behind a float16
DequantizeLinear it casts to float32 and runs the float kernel, so a half-precision model
quantized as it stands gains nothing and runs slower. Widened, its Convs and MatMuls fuse into
QLinearConv/MatMulInteger like any float32 model's. The model's interface stays as it was: each
half-precision graph input is cast to float32 where it enters, each half-precision output is
cast back where it leaves, so callers feed and read the same types.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.passes._inference import infer_shapes
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    all_graphs,
    bypass_nodes,
    drop_value_info,
    element_types,
)

__all__ = ["HALF_TYPES", "WidenHalf", "half_precision_types"]

HALF_TYPES = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
# Attributes that name the element type an operator makes (Cast's "to"; "dtype" of EyeLike,
# RandomNormal and the like).
_TYPE_ATTRIBUTES = ("to", "dtype")
# Attributes that hold a tensor the operator outputs (Constant's value, ConstantOfShape's).
_TENSOR_ATTRIBUTES = ("value",)


class WidenHalf:
    """Turn every float16/bfloat16 tensor, type and cast of the model (subgraphs included) into
    float32, with a Cast at each half-precision graph input and output."""

    name: ClassVar[str] = "widen-half"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        found = half_precision_types(model.graph)
        if not found:
            return StepResult(model, False)
        graph = model.graph
        names = NameAllocator.from_model(model)
        parameters = {t.name for t in graph.initializer}
        between_floats = _casts_between_floats(model)
        for g in all_graphs(graph):
            _widen_initializers(g)
            for node in g.node:
                _widen_attributes(node)
            interface = [] if g is graph else [*g.input, *g.output]
            for value in (*g.value_info, *interface):
                _widen_value(value)
        for value in graph.input:  # an initializer listed as an input is a parameter: widened
            if value.name in parameters:
                _widen_value(value)
        dropped = _drop_casts(graph, between_floats)
        entry = _cast_inputs(graph, names, parameters)
        exit_ = _cast_outputs(graph, names)
        edges = {c.input[0] for c in entry} | {c.output[0] for c in exit_}
        # their types are the interface's, set by the graph's inputs/outputs
        drop_value_info(graph, edges)
        nodes = [*entry, *graph.node, *exit_]
        del graph.node[:]
        graph.node.extend(nodes)
        casts = f"; {dropped} Cast{'s' * (dropped != 1)} between them dropped" if dropped else ""
        return StepResult(model, True, f"{' and '.join(found)} computed in float32 "
                                       f"(inputs and outputs keep their types){casts}")


_FLOATS = frozenset({TensorProto.FLOAT, *HALF_TYPES})


def _casts_between_floats(model: onnx.ModelProto) -> set[int]:
    """Positions of the main graph's Casts from one float type (float32, float16, bfloat16) to
    another: widened, each is a Cast from float32 to float32. Left in, it sits between a
    DequantizeLinear and the operator reading it, which onnxruntime then runs in float (a
    converted ResNet's residual Adds), and a bias read through one is no constant to quantize."""
    graph = model.graph
    candidates = {p for p, n in enumerate(graph.node)
                  if n.op_type == "Cast" and n.domain in DEFAULT_DOMAINS and n.input
                  and any(a.name == "to" and a.i in _FLOATS for a in n.attribute)}
    if not candidates:
        return set()
    types = element_types(graph)
    if any(graph.node[p].input[0] not in types for p in candidates):
        try:  # the types of values no value_info declares
            types = {**element_types(infer_shapes(model, strict=False).graph), **types}
        except (onnx.shape_inference.InferenceError, RuntimeError, ValueError):
            pass
    return {p for p in candidates if types.get(graph.node[p].input[0]) in _FLOATS}


def _drop_casts(graph: onnx.GraphProto, positions: set[int]) -> int:
    """Remove the Casts at `positions` (`_casts_between_floats`), their readers reading their
    inputs; one whose output is a graph output stays (its name is the interface's). Their count."""
    outputs = {v.name for v in graph.output}
    dropped = {p for p in positions if graph.node[p].output[0] not in outputs}
    bypass_nodes(graph, dropped)
    return len(dropped)


def half_precision_types(graph: onnx.GraphProto) -> list[str]:
    """The half-precision float types among the model's typed values, e.g. ["float16"]."""
    found: set[int] = set()
    for g in all_graphs(graph):
        found.update(t.data_type for t in g.initializer)
        for value in (*g.input, *g.output, *g.value_info):
            found.add(value.type.tensor_type.elem_type)
        for node in g.node:
            if node.domain in DEFAULT_DOMAINS:
                found.update(a.i for a in node.attribute if a.name in _TYPE_ATTRIBUTES)
                found.update(a.t.data_type for a in node.attribute
                             if a.name in _TENSOR_ATTRIBUTES and a.type == a.TENSOR)
    return [name for dtype, name in HALF_TYPES.items() if dtype in found]


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(tensor_array(tensor).astype(np.float32), tensor.name)


def _widen_initializers(graph: onnx.GraphProto) -> None:
    for position, tensor in enumerate(graph.initializer):
        if tensor.data_type in HALF_TYPES:
            graph.initializer[position].CopyFrom(_widened(tensor))


def _widen_attributes(node: onnx.NodeProto) -> None:
    if node.domain not in DEFAULT_DOMAINS:
        return
    for attribute in node.attribute:
        if attribute.name in _TYPE_ATTRIBUTES and attribute.type == attribute.INT:
            if attribute.i in HALF_TYPES:
                attribute.i = TensorProto.FLOAT
        elif (attribute.name in _TENSOR_ATTRIBUTES and attribute.type == attribute.TENSOR
              and attribute.t.data_type in HALF_TYPES):
            attribute.t.CopyFrom(_widened(attribute.t))


def _widen_value(value: onnx.ValueInfoProto) -> None:
    tensor_type = value.type.tensor_type
    if tensor_type.elem_type in HALF_TYPES:
        tensor_type.elem_type = TensorProto.FLOAT


def _cast_inputs(graph: onnx.GraphProto, names: NameAllocator,
                 parameters: set[str]) -> list[onnx.NodeProto]:
    """A Cast to float32 after each half-precision graph input; its readers read the Cast."""
    index = UseIndex.build(graph)
    casts = []
    for value in graph.input:
        if value.name in parameters or value.type.tensor_type.elem_type not in HALF_TYPES:
            continue
        wide = names.allocate(f"{value.name}_float32")
        index.replace_uses(value.name, wide)
        casts.append(helper.make_node("Cast", [value.name], [wide], to=TensorProto.FLOAT,
                                      name=names.allocate(f"{value.name}_to_float32")))
    return casts


def _cast_outputs(graph: onnx.GraphProto, names: NameAllocator) -> list[onnx.NodeProto]:
    """A Cast back to its type before each half-precision graph output a node computes."""
    index = UseIndex.build(graph)
    casts = []
    for value in graph.output:
        half = value.type.tensor_type.elem_type
        producer = index.producer.get(value.name)
        if half not in HALF_TYPES or producer is None:  # a graph input passed through stays
            continue
        wide = names.allocate(f"{value.name}_float32")
        index.replace_uses(value.name, wide)
        for slot, name in enumerate(producer.output):
            if name == value.name:
                producer.output[slot] = wide
        casts.append(helper.make_node("Cast", [wide], [value.name], to=half,
                                      name=names.allocate(f"{value.name}_to_{HALF_TYPES[half]}")))
    return casts
