"""Loading a model safely: `load_model` reads an ONNX file, checks every external-data
reference stays inside the model's folder (and holds exactly the tensor's bytes) before any of
it is read, keeps large weights in their files, runs onnx.checker and hashes the file."""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import onnx
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from qcal.graph.files import large as _large
from qcal.graph.structure import all_graphs, attribute_graphs, node_subgraphs, subgraph_reads
from qcal.numerics.errors import ModelError, one_line

__all__ = ["LoadedModel", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model read from disk.

    Attributes:
        path: the file it was read from.
        model: the model. Of its external data (from safe paths only), the main graph's
            initializers of at least 1 MiB stay in their files, referred to by absolute path
            (see `qcal.graph.files.large`); the rest is loaded into memory.
        sha256: hex digest of the .onnx file's bytes.
        external_files: the external-data files the weights were read from (resolved, sorted).
        declared_shapes: the values whose shape or type the file states (value_info of any
            graph): the quantized model states those and no more (see
            `qcal.graph.structure.keep_declared_shapes`).
    """

    path: Path
    model: onnx.ModelProto
    sha256: str
    external_files: tuple[Path, ...] = ()
    declared_shapes: frozenset[str] = frozenset()


def load_model(path: Path | str) -> LoadedModel:
    """Read, check and hash the ONNX model at `path`, with its external data.

    External data is read only after every reference has been checked: the location must be a
    relative path that, symlinks resolved, stays inside the model's folder and names a regular
    file holding exactly the tensor's bytes. Large weights are not read at all: they stay in
    their files (a model over 2 GB is then held in memory without its weights). onnx.checker
    runs on the file's bytes (or on the path when data is external, which works for models over
    2 GB without serializing them).

    Raises:
        ModelError: naming the file (and tensor) when the model is missing, empty, not ONNX,
            truncated, fails the checker, or has unsafe, missing or short external data.
    """
    path = Path(path)
    data = _read_file(path)
    digest = hashlib.sha256(data).hexdigest()
    model = _parse(path, data)
    declared = frozenset(v.name for graph in all_graphs(model.graph) for v in graph.value_info)
    external = list(_external_tensors(model))
    # onnxruntime runs a graph whose nodes are out of order (its own float16 converter writes
    # the input Casts last); onnx.checker and qcal's passes want them sorted.
    rewritten = _sort_nodes(model.graph)
    rewritten = _initializers_need_not_be_inputs(model) or rewritten
    if not external:
        if _declare_output_shapes(path, model) or rewritten:
            data = model.SerializeToString()  # the checker reads the model as changed
        _run_checker(path, data)
        return LoadedModel(path=path, model=model, sha256=digest, declared_shapes=declared)
    del data  # the proto holds what it needs; the bytes can go before the weights arrive
    folder = path.parent.resolve()
    files = sorted({_check_external_reference(path, folder, t)[0] for t in external})
    # The file itself, unless rewritten here (the proto holds no weights yet: it is small).
    _run_checker(path, model.SerializeToString() if rewritten else os.fspath(path))
    # Large weights stay in their files: set aside while the rest is read, then referred to by
    # absolute path.
    kept: list[tuple[onnx.TensorProto, tuple[Path, int, int]]] = []
    for tensor in model.graph.initializer:
        if _is_external(tensor):
            span = _check_external_reference(path, folder, tensor)
            if span[2] >= _large.DETACH_MIN_BYTES:
                tensor.ClearField("data_location")
                del tensor.external_data[:]
                kept.append((tensor, span))
    try:
        onnx.external_data_helper.load_external_data_for_model(model, os.fspath(folder))
    except (OSError, ValueError, onnx.checker.ValidationError) as err:
        raise ModelError(f"{path}: cannot read external data: {one_line(err)}") from None
    for tensor in _external_tensors(model):  # onnx loads dense tensors only
        raise ModelError(
            f"{path}: external data of tensor {tensor.name!r} was not loaded "
            "(sparse tensors with external data are not supported)"
        )
    for tensor, span in kept:
        _large.refer_to_file(tensor, *span)
    return LoadedModel(path=path, model=model, sha256=digest, external_files=tuple(files),
                       declared_shapes=declared)


def _read_file(path: Path) -> bytes:
    if not path.exists():
        raise ModelError(f"{path}: model file not found")
    if not path.is_file():
        raise ModelError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelError(f"{path}: cannot read model file ({err.strerror or err})") from None
    if not data:
        raise ModelError(f"{path}: model file is empty")
    return data


def _parse(path: Path, data: bytes) -> onnx.ModelProto:
    try:
        model: onnx.ModelProto = onnx.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        raise ModelError(
            f"{path}: not an ONNX model (cannot parse it; truncated or another format?)"
        ) from None
    # Protobuf accepts many byte strings; a real model always has an IR version and a graph.
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelError(f"{path}: not an ONNX model (no IR version or graph)")
    return model


def _initializers_need_not_be_inputs(model: onnx.ModelProto) -> bool:
    """Raise IR version 3 to 4 where an initializer is not a graph input (whether it did): IR 3
    wants every initializer listed as an input, which onnx.checker holds a model to, while
    onnxruntime runs such a model (Caffe2's and early exporters' files) as IR 4 reads it, the
    initializers constants. Nothing else changed between the two versions."""
    inputs = {v.name for v in model.graph.input}
    if model.ir_version >= 4 or all(t.name in inputs for t in model.graph.initializer):
        return False
    model.ir_version = 4
    return True


def _declare_output_shapes(path: Path, model: onnx.ModelProto) -> bool:
    """Declare the shape of each graph output that declares a tensor type but no shape (not
    even a rank), from onnx's shape inference; whether any was declared.

    onnx.checker requires a shape on the graph's inputs and outputs, onnxruntime does not: a
    model whose output declarations were cleared by hand (to let any shape through) runs, and
    was refused here. An output whose shape inference cannot find, or an input without a
    shape, is still refused, by name. (A model with external data is checked from its file,
    as it stands.)
    """
    def shapeless(value: onnx.ValueInfoProto) -> bool:
        kind = value.type.WhichOneof("value")
        return kind == "tensor_type" and not value.type.tensor_type.HasField("shape")

    for value in model.graph.input:
        if shapeless(value):
            raise ModelError(f"{path}: input {value.name!r} declares no shape (not even a rank); "
                             "onnx.checker requires one: declare it in the model (its rank, "
                             "with a name for each dimension that varies), e.g. with "
                             "onnx.tools.update_model_dims.update_inputs_outputs_dims")
    missing = [v for v in model.graph.output if shapeless(v)]
    if not missing:
        return False
    try:
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        inferred = {}
    for value in missing:
        found = inferred.get(value.name)
        if found is None or shapeless(found) or found.type.WhichOneof("value") != "tensor_type":
            raise ModelError(f"{path}: output {value.name!r} declares no shape (not even a "
                             "rank), and onnx's shape inference cannot find one; onnx.checker "
                             "requires it")
        value.type.tensor_type.shape.CopyFrom(found.type.tensor_type.shape)
    return True


def _run_checker(path: Path, model: bytes | str) -> None:
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as err:
        raise ModelError(f"{path}: fails onnx.checker: {one_line(err)}") from None


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model whose data lives in an external file."""
    graphs = [model.graph]
    for graph in graphs:  # grows as subgraphs are found: a breadth-first walk
        candidates: list[onnx.TensorProto] = list(graph.initializer)
        for sparse in graph.sparse_initializer:
            candidates += [sparse.values, sparse.indices]
        for node in graph.node:
            candidates += _attribute_tensors(node, graphs)
        yield from (t for t in candidates if _is_external(t))
    for function in model.functions:
        for node in function.node:
            yield from (t for t in _attribute_tensors(node, []) if _is_external(t))


def _attribute_tensors(
    node: onnx.NodeProto, graphs: list[onnx.GraphProto]
) -> list[onnx.TensorProto]:
    tensors: list[onnx.TensorProto] = []
    for attribute in node.attribute:
        if attribute.HasField("t"):
            tensors.append(attribute.t)
        tensors.extend(attribute.tensors)
        if attribute.HasField("sparse_tensor"):
            tensors += [attribute.sparse_tensor.values, attribute.sparse_tensor.indices]
        graphs.extend(attribute_graphs(attribute))
    return tensors


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL


def _check_external_reference(
    path: Path, folder: Path, tensor: onnx.TensorProto
) -> tuple[Path, int, int]:
    """The file holding `tensor`'s data, resolved, and the data's offset and length in it;
    refuses an entry that is unsafe, missing or short."""
    where = f"{path}: external data of tensor {tensor.name!r}"
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = entries.get("location", "")
    if not location or "\x00" in location:
        raise ModelError(f"{where}: missing or invalid location")
    if (
        PurePosixPath(location).is_absolute()
        or PureWindowsPath(location).is_absolute()
        or PureWindowsPath(location).drive
        or location.startswith(("/", "\\"))
    ):
        raise ModelError(f"{where}: location {location!r} is an absolute path")
    resolved: Path = (folder / location).resolve()  # follows symlinks and `..`
    if not resolved.is_relative_to(folder):
        raise ModelError(f"{where}: location {location!r} points outside the model's folder")
    if (folder / location).is_symlink():  # onnx refuses these too, even pointing inside
        raise ModelError(f"{where}: {location!r} is a symbolic link")
    if not resolved.exists():
        raise ModelError(f"{where}: file {location!r} not found")
    if not resolved.is_file():
        raise ModelError(f"{where}: {location!r} is not a regular file")
    offset = _non_negative(entries.get("offset", "0"), where, "offset")
    size = resolved.stat().st_size
    available = size - offset
    length = _non_negative(entries["length"], where, "length") if "length" in entries else available
    needed = _tensor_nbytes(tensor)
    if offset > size or length > available:
        raise ModelError(
            f"{where}: {location!r} is truncated ({size} bytes; the tensor needs {offset + length})"
        )
    if needed is not None and length != needed:
        raise ModelError(
            f"{where}: {location!r} holds {length} bytes for it, its shape and type need {needed}"
        )
    return resolved, offset, length


def _non_negative(text: str, where: str, key: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ModelError(f"{where}: {key} {text!r} is not an integer") from None
    if value < 0:
        raise ModelError(f"{where}: {key} {value} is negative")
    return value


_SUB_BYTE_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
)


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    """Bytes of the tensor's raw data, None when its type has no fixed size."""
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if tensor.data_type in _SUB_BYTE_TYPES:
        bits = (
            2
            if tensor.data_type in {getattr(onnx.TensorProto, n, -1) for n in ("INT2", "UINT2")}
            else 4
        )
        return (count * bits + 7) // 8
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except (KeyError, ValueError, TypeError):
        return None
    if dtype.kind in "OSU":
        return None
    return count * dtype.itemsize


def _sort_nodes(graph: onnx.GraphProto) -> bool:
    """Put `graph`'s nodes, and those of its subgraphs, in topological order; whether any moved.

    Stable: nodes already in order keep it, and a node waits only for the nodes of the same
    graph that write what it reads (inside its subgraphs too). onnxruntime runs an unsorted
    graph (onnxruntime's own float16 converter writes the input Casts last), onnx.checker
    refuses it. A graph with a cycle keeps its order, for the checker to name.
    """
    moved = False
    for body in (body for node in graph.node for body in node_subgraphs(node)):
        moved = _sort_nodes(body) or moved  # every body sorted, none skipped
    nodes = list(graph.node)
    writer = {value: position for position, node in enumerate(nodes)
              for value in node.output if value}
    waits_for = [{writer[v] for v in (*node.input, *subgraph_reads(node)) if v in writer}
                 - {position} for position, node in enumerate(nodes)]
    if all(w < position for position, waits in enumerate(waits_for) for w in waits):
        return moved
    readers: list[list[int]] = [[] for _ in nodes]
    for position, waits in enumerate(waits_for):
        for w in waits:
            readers[w].append(position)
    pending = [len(waits) for waits in waits_for]
    ready = [position for position, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        position = heapq.heappop(ready)
        order.append(position)
        for reader in readers[position]:
            pending[reader] -= 1
            if pending[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) < len(nodes):
        return moved
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, position in zip(copies, order):
        copy.CopyFrom(nodes[position])
    del graph.node[:]
    graph.node.extend(copies)
    return True
