"""Pass: raise the default-domain opset to what per-channel QDQ needs, with onnx's converter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import ClassVar

import onnx
from onnx import version_converter

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

        def convert(light: onnx.ModelProto) -> onnx.ModelProto:
            return version_converter.convert_version(light, target)

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
        return StepResult(converted, True, f"opset {current} -> {target}")


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
