"""Pass: write each two-operand Einsum that is a matrix product as Transpose, Reshape and MatMul.

torch.onnx exports ``torch.einsum`` as an Einsum node, which has no integer kernel in
onnxruntime and no quantization rule: a transformer written with einsum came out with none of
its projections or attention products quantized (0 % of its work in integers, and the run
said nothing). Written as MatMul, each is an anchor like any other, its constant operand a
weight quantized per channel. The float model computes the same products (in another order of
additions, to float32 precision).

An equation is lowered when it has two operands and an explicit output, no index repeated
within an operand and none summed within one operand alone, and no ellipsis but one leading an
operand and the output (``...d,df->...f``: its axes lead the product's). Its indices then fall in
four groups: batch (both operands and the output), contracted (both operands only), left (the
first operand and the output) and right (the second operand and the output). With batch indices
(attention: ``bhqd,bhkd->bhqk``) the other groups must hold one index each; without them
(projections: ``bsd,dhk->bshk``, ``bshk,hkd->bsd``) several left indices stay leading axes of
the product, and several contracted or right indices are merged, the second operand then a
constant (its sizes known). A constant first operand is swapped to the second place. Anything
else stays an Einsum, as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.files.large import tensor_array
from qcal.graph.names import NameAllocator
from qcal.graph.passes._base import IR_INITIALIZERS_WITHOUT_INPUTS, StepResult
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    drop_unread_initializers,
    element_types,
)

__all__ = ["LowerEinsum"]


@dataclass(frozen=True)
class _Groups:
    """An equation's indices by role, each group in the order its operand holds them."""

    batch: str
    contract: str
    left: str
    right: str


class LowerEinsum:
    """Lower the main graph's matrix-product Einsums to MatMul (module docstring)."""

    name: ClassVar[str] = "lower-einsum"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        graph = model.graph
        einsums = [n for n in graph.node if n.op_type == "Einsum" and n.domain in DEFAULT_DOMAINS]
        if not einsums or model.ir_version < IR_INITIALIZERS_WITHOUT_INPUTS:
            return StepResult(model, False)
        inputs = {v.name for v in graph.input}
        constants = {t.name: t for t in graph.initializer if t.name not in inputs}
        types = element_types(graph)
        if any(all(v not in types for v in n.input) for n in einsums):
            inferred = onnx.shape_inference.infer_shapes(model)  # types of computed operands
            types = element_types(inferred.graph)
        names = NameAllocator.from_model(model)
        lowered: dict[str, list[onnx.NodeProto]] = {}
        for node in einsums:
            if all(types.get(v) != TensorProto.FLOAT for v in node.input):
                continue  # float32 only: widen-half made half-precision models so before
            nodes = _lower(node, constants, names, graph)
            if nodes is not None:
                lowered[node.name] = nodes
        if not lowered:
            return StepResult(model, False)
        rewritten: list[onnx.NodeProto] = []
        for node in graph.node:
            rewritten.extend(lowered.get(node.name, [node]) if node.op_type == "Einsum"
                             else [node])
        del graph.node[:]
        graph.node.extend(rewritten)
        # A constant operand now stored as its matrix goes, unless something else reads it
        # (a subgraph included).
        drop_unread_initializers(graph, {v for n in einsums if n.name in lowered for v in n.input})
        count = len(lowered)
        return StepResult(model, True, f"wrote {count} Einsum{'s' * (count != 1)} as MatMul")


def _lower(
    node: onnx.NodeProto,
    constants: dict[str, onnx.TensorProto],
    names: NameAllocator,
    graph: onnx.GraphProto,
) -> list[onnx.NodeProto] | None:
    """The nodes computing `node` with a MatMul, or None when its equation is not lowered."""
    equation = next((helper.get_attribute_value(a) for a in node.attribute
                     if a.name == "equation"), b"")
    terms = _terms(equation.decode() if isinstance(equation, bytes) else str(equation))
    if terms is None or len(node.input) != 2 or len(node.output) != 1:
        return None
    (a, b), out, leading = terms
    first, second = node.input
    if leading == 1 or (leading is None and first in constants and second not in constants):
        (a, b), (first, second) = (b, a), (second, first)
    if first in constants:
        return None  # both constant: onnxruntime folds it; nothing to quantize
    groups = _groups(a, b, out)
    if groups is None:
        return None
    weight = constants.get(second)
    if leading is not None:
        return _lower_leading(node, first, second, weight, (a, b, out), groups, names, graph)
    if groups.batch:
        if not (len(groups.left) == len(groups.contract) == len(groups.right) == 1):
            return None
    elif not groups.left or not groups.contract or not groups.right or (
        weight is None and (len(groups.contract) > 1 or len(groups.right) > 1)
    ):
        return None
    if weight is not None and len(weight.dims) != len(b):
        return None
    built = _Builder(node.name, names, graph)
    lhs = built.transpose(first, a, groups.batch + groups.left + groups.contract)
    if not groups.batch and len(groups.contract) > 1:
        lhs = built.reshape(lhs, [0] * len(groups.left) + [-1])
    product_axes = groups.batch + groups.left + groups.right
    if weight is not None:
        rhs = _store_matrix(weight, b, groups.batch + groups.contract + groups.right,
                            len(groups.contract) if not groups.batch else None, names, graph)
        right_sizes = [int(weight.dims[b.index(c)]) for c in groups.right]
    else:
        rhs = built.transpose(second, b, groups.batch + groups.contract + groups.right)
        right_sizes = []
    target = node.output[0]
    final = "" if len(groups.right) > 1 or product_axes != out else target
    product = built.matmul(lhs, rhs, final or names.allocate(f"{node.name}_product"))
    if len(groups.right) > 1:
        shape_out = "" if product_axes != out else target
        product = built.reshape(product, [0] * len(groups.left) + right_sizes, shape_out)
    if product_axes != out:
        built.transpose(product, product_axes, out, target)
    return built.nodes


def _lower_leading(
    node: onnx.NodeProto, first: str, second: str, weight: onnx.TensorProto | None,
    terms: tuple[str, str, str], groups: _Groups, names: NameAllocator, graph: onnx.GraphProto,
) -> list[onnx.NodeProto] | None:
    """`...ld,dr->...lr` (the first operand's axes after the ellipsis already in the order of
    a product, one index contracted and one kept from a 2-D second operand): one MatMul, whose
    leading axes carry the ellipsis. None for any other form."""
    a, b, out = terms
    if (groups.batch or len(groups.contract) != 1 or len(groups.right) != 1
            or a != groups.left + groups.contract or out != groups.left + groups.right):
        return None
    rhs = second
    if weight is not None:
        if len(weight.dims) != 2:
            return None
        rhs = _store_matrix(weight, b, groups.contract + groups.right, None, names, graph)
    elif b != groups.contract + groups.right:
        return None
    return [helper.make_node("MatMul", [first, rhs], [node.output[0]], name=node.name)]


def _store_matrix(
    weight: onnx.TensorProto, axes: str, order: str, merge: int | None,
    names: NameAllocator, graph: onnx.GraphProto,
) -> str:
    """A new initializer holding constant operand `weight` (indices `axes`) with its axes in
    `order`, the first `merge` of them merged into one and the rest into another; its name."""
    values = np.transpose(tensor_array(weight), [axes.index(c) for c in order])
    if merge is not None:
        values = values.reshape(math.prod(values.shape[:merge]), -1)
    name = names.allocate(f"{weight.name}_matrix")
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(values), name))
    return name


def _terms(equation: str) -> tuple[tuple[str, str], str, int | None] | None:
    """(first operand, second operand), output of an explicit two-operand equation, and which
    operand leads with an ellipsis that leads the output too (stripped from both), if one does."""
    text = equation.replace(" ", "")
    if "->" not in text:
        return None
    operands, out = text.split("->")
    parts = operands.split(",")
    if len(parts) != 2:
        return None
    leading = None
    if "." in text:  # only `...` leading one operand and the output: leading axes of a product
        dotted = [i for i, p in enumerate(parts) if "." in p]
        if len(dotted) != 1 or not out.startswith("...") or not parts[dotted[0]].startswith("..."):
            return None
        leading = dotted[0]
        parts[leading], out = parts[leading][3:], out[3:]
    if not all(p.isalpha() for p in (*parts, out) if p):
        return None
    return (parts[0], parts[1]), out, leading


def _groups(a: str, b: str, out: str) -> _Groups | None:
    """The equation's index groups (module docstring), or None when it is not a plain product:
    an index repeated in a term, summed within one operand, or in the output alone."""
    if any(len(set(t)) != len(t) for t in (a, b, out)) or not set(out) <= set(a) | set(b):
        return None
    if (set(a) ^ set(b)) - set(out):
        return None  # an index of one operand summed away: not a matrix product
    return _Groups(
        batch="".join(c for c in out if c in a and c in b),
        contract="".join(c for c in a if c in b and c not in out),
        left="".join(c for c in a if c not in b),
        right="".join(c for c in b if c not in a),
    )


class _Builder:
    """The nodes of one lowering, named after the Einsum (its MatMul keeps its name)."""

    def __init__(self, base: str, names: NameAllocator, graph: onnx.GraphProto) -> None:
        self.base = base
        self.names = names
        self.graph = graph  # where the shapes of its Reshapes go, as initializers
        self.nodes: list[onnx.NodeProto] = []

    def transpose(self, value: str, axes: str, order: str, output: str = "") -> str:
        perm = [axes.index(c) for c in order]
        if perm == list(range(len(perm))) and not output:
            return value
        output = output or self.names.allocate(f"{value}_transposed")
        self.nodes.append(helper.make_node(
            "Transpose", [value], [output], name=self.names.allocate(f"{self.base}/transpose"),
            perm=perm))
        return output

    def reshape(self, value: str, shape: Sequence[int], output: str = "") -> str:
        dims = self.names.allocate(f"{self.base}/shape")
        output = output or self.names.allocate(f"{value}_reshaped")
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(shape, np.int64), dims))
        self.nodes.append(helper.make_node(
            "Reshape", [value, dims], [output], name=self.names.allocate(f"{self.base}/reshape")))
        return output

    def matmul(self, lhs: str, rhs: str, output: str) -> str:
        self.nodes.append(helper.make_node("MatMul", [lhs, rhs], [output], name=self.base))
        return output
