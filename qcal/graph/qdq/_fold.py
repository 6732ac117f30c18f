"""Divisions folded into a DequantizeLinear scale: the output of a Div by a positive constant
scalar, quantized with its input's parameters and the scale divided by the constant, is the
DequantizeLinear of the input's codes with that scale (``DQ(q, s, z) / c = DQ(q, s / c, z)``),
so the Div goes; so does a Mul by a positive constant scalar (a division by its reciprocal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qcal.graph.files.large import tensor_array
from qcal.graph.qdq._activations import _ActivationWriter, _reads_shape_only
from qcal.graph.qdq._codes import _FLOAT_TYPES, _divided_qparams
from qcal.graph.structure import DEFAULT_DOMAINS, SUBGRAPH_SLOT

if TYPE_CHECKING:
    from qcal.graph.plan import ActivationTarget
    from qcal.graph.qdq._emit import _Scopes


class _DivisionFolder(_ActivationWriter):
    """The folding part of `InsertQDQ` (on top of its activation part, which a division falls
    back to when its source got no pair)."""

    def _folds(self, scopes: _Scopes) -> dict[str, tuple[str, onnx.NodeProto]]:
        """Activation -> (its source, the Div) for the outputs of a Div (or Mul) by a positive
        constant scalar that reads its input quantized, when the output's parameters are the input's
        with the scale divided by the constant: ``DQ(q, s, z) / c = DQ(q, s / c, z)``, so the
        output's DequantizeLinear reads the input's codes and nothing is left to divide."""
        folds: dict[str, tuple[str, onnx.NodeProto]] = {}
        for target in self._activations:
            tensor = target.tensor
            rewrite = scopes.defined.get(tensor)
            producer = None if rewrite is None else rewrite.index.producer.get(tensor)
            if (
                target.same_as is None  # observed: not a division the plan folds (a Mul it
                # quantizes as such may hold its B as codes)
                or rewrite is None
                or producer is None
                or producer.op_type not in ("Div", "Mul")
                or producer.domain not in DEFAULT_DOMAINS
                or len(producer.input) != 2
            ):
                continue
            source = self._planned_inputs.get(producer.name, tuple(producer.input))[0]
            divisor = _positive_scalar(scopes.initializer(producer.input[1]))
            if divisor is not None and producer.op_type == "Mul":
                divisor = 1.0 / divisor
            if (
                divisor is None
                or producer.input[1] in rewrite.index.graph_inputs  # may be fed another value
                or (source, producer.name) not in self._quantized_reads
                or scopes.defined.get(source) is not rewrite
                or rewrite.types.get(source) != rewrite.types.get(tensor)
                or not _divided_qparams(
                    self._activation_qparams[source], self._activation_qparams[tensor], divisor
                )
            ):
                continue
            folds[tensor] = (source, producer)
        return folds

    def _fold_divisions(
        self, scopes: _Scopes, folds: Mapping[str, tuple[str, onnx.NodeProto]]
    ) -> None:
        """Write the folded divisions (`_folds`), sources first."""
        targets = {t.tensor: t for t in self._activations if t.tensor in folds}
        pending = dict(folds)
        while pending:
            ready = sorted(t for t, (source, _) in pending.items() if source not in pending)
            if not ready:  # impossible in a graph without cycles
                raise self._error(f"divisions folded in a cycle: {min(pending)!r}")
            for tensor in ready:
                source, division = pending.pop(tensor)
                self._fold_division(scopes, targets[tensor], source, division)

    def _fold_division(
        self, scopes: _Scopes, target: ActivationTarget, source: str, division: onnx.NodeProto
    ) -> None:
        """One folded division: a DequantizeLinear of `source`'s codes with `target`'s scale,
        read by every reader of `target` (the Div is then removed), or only by its quantized
        readers when the Div must stay (a graph output, a read inside a body)."""
        tensor = target.tensor
        if source not in self._pairs:  # the source got no pair: a pair of its own
            self._quantize_activation(scopes, target)
            return
        rewrite = scopes.definer(tensor)
        everything = list(rewrite.index.uses.get(tensor, ()))
        keeps_division = tensor in rewrite.index.graph_outputs or any(
            use.slot == SUBGRAPH_SLOT for use in everything
        )
        uses = [
            use
            for consumer in target.consumers
            for use in self._uses_by(rewrite, tensor, consumer, "activation")
        ]
        if not keeps_division:
            uses = everything
        if all(_reads_shape_only(use) for use in uses):
            return
        qparams = self._activation_qparams[tensor]
        float_type = self._float_type(rewrite, tensor, "activation")
        scale, zero_point = rewrite.add_qparams(tensor, qparams, float_type)
        codes, source_dequantized = self._pairs[source]
        dequantized = rewrite.add_node(
            "DequantizeLinear", tensor, [codes, scale, zero_point], qparams.axis, after=source
        )
        self._read_pair(rewrite, uses, codes, dequantized)
        self._pairs[tensor] = (codes, dequantized)
        if keeps_division:
            return
        rewrite.remove(division)
        scopes.drop_if_unused(division.input[1])
        if not scopes.is_read(source_dequantized):
            rewrite.remove_producer(source_dequantized)


def _positive_scalar(constant: onnx.TensorProto | None) -> float | None:
    """The value of a one-element float constant if it is finite and positive, else None."""
    if constant is None or constant.data_type not in _FLOAT_TYPES or np.prod(constant.dims) != 1:
        return None
    value = float(tensor_array(constant).reshape(()))
    return value if np.isfinite(value) and value > 0 else None
