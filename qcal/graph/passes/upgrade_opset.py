"""Pass: raise the default-domain opset to what per-channel QDQ needs, with onnx's converter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import ClassVar

import onnx

# onnx's C++ converter itself: it takes and returns serialized models
from onnx.onnx_cpp2py_export import version_converter

from qcal.graph.files.large import run_detached
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import DEFAULT_DOMAINS, attribute_graphs, default_opset
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
        detail = f"opset {current} -> {target}"
        # Old IR versions list every initializer as a graph input too (IR < 4 requires it); the
        # newer IR that the new opset needs does not, and such "inputs" would read as values a
        # caller may override. As onnx's converter leaves both alone, qcal updates them.
        ir_version = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", target)])
        if converted.ir_version < ir_version:
            detail += f", IR {converted.ir_version} -> {ir_version}"
            if converted.ir_version < 4:
                initializers = {t.name for t in converted.graph.initializer}
                kept = [v for v in converted.graph.input if v.name not in initializers]
                if len(kept) < len(converted.graph.input):
                    detail += (f" ({len(converted.graph.input) - len(kept)} initializers no "
                               "longer listed as graph inputs)")
                    del converted.graph.input[:]
                    converted.graph.input.extend(kept)
            converted.ir_version = ir_version
        return StepResult(converted, True, detail)


def _check_signature(
    before: onnx.ModelProto, after: onnx.ModelProto, current: int, target: int
) -> None:
    """The converted model must take the inputs the original takes (same ranks where known)."""
    ranks = {v.name: _rank(v) for v in before.graph.input}
    for value in after.graph.input:
        old, new = ranks.get(value.name), _rank(value)
        if old is not None and new is not None and old != new:
            raise ModelError(
                f"cannot convert opset {current} -> {target} keeping the model's inputs: onnx's "
                f"converter changes input {value.name!r} from rank {old} to rank {new}"
            )


def _rank(value: onnx.ValueInfoProto) -> int | None:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type" or not value.type.tensor_type.HasField("shape"):
        return None
    return len(value.type.tensor_type.shape.dim)


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
