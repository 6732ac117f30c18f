"""Pass: raise the default-domain opset to what per-channel QDQ needs, with onnx's converter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import onnx

# onnx's C++ converter itself: it takes and returns serialized models
from onnx.onnx_cpp2py_export import version_converter

from qcal.graph.files.large import run_detached
from qcal.graph.passes._base import StepResult
from qcal.graph.shapes import declared_rank
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    all_graphs,
    attribute_graphs,
    default_opset,
    float_attribute,
    int_attribute,
    string_attribute,
)
from qcal.numerics.errors import ConfigError, ModelError

__all__ = ["UpgradeOpset"]


class UpgradeOpset:
    """Convert a model whose ai.onnx opset is below `min_opset` to exactly `min_opset`.

    Per-axis QuantizeLinear/DequantizeLinear need opset 13; int4/int16 types need 21. Models
    already at or above `min_opset` are left alone (never downgraded).

    Raises:
        ModelError: naming the operator when the conversion fails.
        ConfigError: when `min_opset` is newer than the installed onnx knows.
    """

    name: ClassVar[str] = "upgrade-opset"

    def __init__(self, min_opset: int) -> None:
        newest = onnx.defs.onnx_opset_version()
        if not 1 <= min_opset <= newest:
            raise ConfigError(
                f"min_opset {min_opset}: onnx {onnx.__version__} knows opsets 1..{newest}"
            )
        self._min_opset = min_opset

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        current = default_opset(model)
        if current is None or current >= self._min_opset:
            return StepResult(model, False)
        op_types = sorted(set(_default_domain_ops(model.graph)))
        for op_type in op_types:
            if not onnx.defs.has(op_type):
                raise ModelError(
                    f"cannot convert opset {current} -> {self._min_opset}: "
                    f"operator {op_type} is not an ONNX operator"
                )
        target = self._min_opset
        if current < 9:  # BatchNormalization's `spatial` is gone from opset 9 on
            model = _per_activation_batchnorms_as_affine(model)

        def convert(model: onnx.ModelProto | bytes) -> onnx.ModelProto:
            # onnx's convert_version, minus serializing a model that comes serialized
            data = model if isinstance(model, bytes) else model.SerializeToString()
            return onnx.load_from_string(version_converter.convert_version(data, target))

        try:
            converted = run_detached(model, convert, what="opset conversion")
        except (RuntimeError, ValueError, onnx.checker.ValidationError) as err:
            culprit = _named_op(str(err), op_types)
            first_line = (
                str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            )
            which = f"operator {culprit}" if culprit else "the model"
            raise ModelError(
                f"cannot convert opset {current} -> {target}: onnx's converter failed on "
                f"{which} ({first_line})"
            ) from None
        _check_signature(model, converted, current, target)
        if current < 11 <= target:
            _keep_old_resize_coordinates(converted)
        detail = f"opset {current} -> {target}"
        ir_version = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", target)])
        if converted.ir_version < ir_version:
            detail += f", IR {converted.ir_version} -> {ir_version}"
            converted.ir_version = ir_version
        return StepResult(converted, True, detail)


def _per_activation_batchnorms_as_affine(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each inference BatchNormalization of `spatial=0` (opsets 7-8: scale, B,
    mean and var per activation, [C, D1, ...]) whose statistics are constants written as the
    Mul and Add it computes, x * a + b, a = scale / sqrt(var + epsilon), b = B - mean * a; onnx's
    converter refuses the attribute (an assertion), while onnxruntime runs it. A copy where there
    is one; the model itself where there is none."""
    names = {t.name for t in model.graph.initializer}
    if not any(_per_activation(node, names) for node in model.graph.node):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    constants = {t.name: t for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not _per_activation(node, names):
            nodes.append(node)
            continue
        scale, bias, mean, var = (onnx.numpy_helper.to_array(constants[v]).astype(np.float64)
                                  for v in node.input[1:5])
        a = scale / np.sqrt(var + float_attribute(node, "epsilon", 1e-5))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(constants[node.input[1]].data_type)
        stem, name = node.output[0], node.name or node.output[0]
        graph.initializer.extend([
            onnx.numpy_helper.from_array(a.astype(dtype), f"{stem}_bn_a"),
            onnx.numpy_helper.from_array((bias - mean * a).astype(dtype), f"{stem}_bn_b")])
        nodes += [onnx.helper.make_node("Mul", [node.input[0], f"{stem}_bn_a"],
                                        [f"{stem}_bn_scaled"], name=f"{name}_bn_mul"),
                  onnx.helper.make_node("Add", [f"{stem}_bn_scaled", f"{stem}_bn_b"], [stem],
                                        name=f"{name}_bn_add")]
    del graph.node[:]
    graph.node.extend(nodes)
    return copy


def _per_activation(node: onnx.NodeProto, constants: set[str]) -> bool:
    """A BatchNormalization of `spatial=0` in inference (one output), its statistics among
    `constants`."""
    return (node.op_type == "BatchNormalization" and node.domain in DEFAULT_DOMAINS
            and int_attribute(node, "spatial", 1) == 0
            and len([v for v in node.output if v]) == 1
            and all(v in constants for v in node.input[1:5]))


def _check_signature(
    before: onnx.ModelProto, after: onnx.ModelProto, current: int, target: int
) -> None:
    """The converted model must take the inputs the original takes (same ranks where known)."""
    ranks = {v.name: declared_rank(v) for v in before.graph.input}
    for value in after.graph.input:
        old, new = ranks.get(value.name), declared_rank(value)
        if old is not None and new is not None and old != new:
            raise ModelError(
                f"cannot convert opset {current} -> {target} keeping the model's inputs: onnx's "
                f"converter changes input {value.name!r} from rank {old} to rank {new}"
            )


def _keep_old_resize_coordinates(after: onnx.ModelProto) -> None:
    """Upsample and Resize before opset 11 map output to input coordinates as `x / scale`
    (asymmetric) and, in nearest mode, take the index below (above when downsampling), as
    onnxruntime runs them; onnx's converter writes the Resize of opset 11 without saying so,
    whose defaults are half-pixel coordinates and rounding to the nearest index (a model's
    linear Upsample then computed 29 dB off the original). Every Resize of the converted model
    comes from such an operator (the model was below opset 11), and states the old rule; a
    nearest Resize that samples up along one axis and down along another, which no single
    rounding of opset 11 describes, or whose scales are not constant, keeps its rounding."""
    for graph in all_graphs(after.graph):
        constants = {t.name: t for t in graph.initializer}
        constants.update((node.output[0], a.t) for node in graph.node
                         if node.op_type == "Constant" and node.output
                         for a in node.attribute if a.name == "value")
        for node in graph.node:
            if node.op_type != "Resize" or node.domain not in DEFAULT_DOMAINS:
                continue
            attributes = {a.name: a for a in node.attribute}
            if "coordinate_transformation_mode" not in attributes:
                node.attribute.append(onnx.helper.make_attribute(
                    "coordinate_transformation_mode", "asymmetric"))
            scales = constants.get(node.input[2]) if len(node.input) > 2 else None
            if (string_attribute(node, "mode", "nearest") != "nearest"
                    or "nearest_mode" in attributes or scales is None):
                continue
            resized = [float(v) for v in onnx.numpy_helper.to_array(scales).ravel() if v != 1.0]
            if all(v > 1.0 for v in resized):
                node.attribute.append(onnx.helper.make_attribute("nearest_mode", "floor"))
            elif all(v < 1.0 for v in resized):
                node.attribute.append(onnx.helper.make_attribute("nearest_mode", "ceil"))


def _default_domain_ops(graph: onnx.GraphProto) -> Iterator[str]:
    for node in graph.node:
        if node.domain in DEFAULT_DOMAINS:
            yield node.op_type
        for attribute in node.attribute:
            for subgraph in attribute_graphs(attribute):
                yield from _default_domain_ops(subgraph)


def _named_op(message: str, op_types: list[str]) -> str | None:
    """The model's operator the converter's message names (the longest match), if any."""
    named = [op for op in op_types if re.search(rf"(?<![A-Za-z]){re.escape(op)}(?![a-z])", message)]
    return max(named, key=len) if named else None
