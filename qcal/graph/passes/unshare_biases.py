"""Pass: give each Conv/Gemm (and each Add after a MatMul) its own copy of a bias constant that
other nodes read too.

Exporters store identical constants once: torch.onnx shares one zero vector among every
convolution whose folded BatchNormalization left it a zero bias. A bias is stored as int32 at
its node's input scale x weight scale, so a shared one cannot be quantized for each reader, and
stays float; onnxruntime then runs its Conv in float on dequantized weights. With a copy of its
own, each node's bias is quantized at its own scale. The first reader keeps the original name,
unless other nodes read it too (torch.onnx shares a zero vector between a Conv's bias and a
LayerNormalization's): then every reader that takes it as a bias gets a copy.
"""

from __future__ import annotations

from typing import ClassVar

import onnx
from onnx import numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex

__all__ = ["UnshareBiases"]


class UnshareBiases:
    """Copy each shared bias initializer of the main graph for every reader after the first."""

    name: ClassVar[str] = "unshare-biases"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        index = UseIndex.build(graph)
        names = NameAllocator.from_model(model)
        first_reader: dict[str, str] = {}
        copies = 0
        slots = {id(node): _bias_slot(node, index) for node in graph.node}
        for node in graph.node:
            slot = slots[id(node)]
            if slot is None:
                continue
            bias = node.input[slot]
            tensor = index.constant(bias)
            if tensor is None or bias in index.graph_outputs or len(index.readers(bias)) < 2:
                continue
            only_biases = all(u.slot == slots[id(u.node)] for u in index.uses[bias])
            if only_biases and first_reader.setdefault(bias, node.name) == node.name:
                continue
            copy = names.allocate(f"{bias}_{node.name}")
            graph.initializer.append(numpy_helper.from_array(tensor_array(tensor), copy))
            node.input[slot] = copy
            copies += 1
        if not copies:
            return StepResult(model, False)
        return StepResult(model, True, f"gave {copies} node{'s' * (copies != 1)} "
                                       "a bias of their own")


def _bias_slot(node: onnx.NodeProto, index: UseIndex) -> int | None:
    """The input position of `node`'s bias: 2 of a Conv/Gemm; of an Add that is the only
    reader of a MatMul's output, its other input."""
    if node.domain not in DEFAULT_DOMAINS:
        return None
    if node.op_type in ("Conv", "Gemm"):
        return 2 if len(node.input) > 2 and node.input[2] else None
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    for slot, value in enumerate(node.input):
        producer = index.producer.get(value)
        if (producer is not None and producer.op_type == "MatMul"
                and len(index.uses.get(value, ())) == 1):
            return 1 - slot
    return None
