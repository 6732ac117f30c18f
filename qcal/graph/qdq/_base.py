"""What every part of the Q/DQ writer shares: the plan and parameters `InsertQDQ` binds, and
the helpers that find a node's reads of a tensor, check its float type and word errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import onnx
from onnx import TensorProto

from qcal.graph.qdq._codes import _FLOAT_TYPES
from qcal.graph.structure import SUBGRAPH_SLOT
from qcal.numerics.errors import ModelError

if TYPE_CHECKING:
    from qcal.graph.plan import ActivationTarget, BiasTarget, WeightTarget
    from qcal.graph.qdq._codes import QuantizedWeight
    from qcal.graph.qdq._emit import _Rewrite
    from qcal.graph.structure import Use
    from qcal.numerics.onnx_mapping import OnnxQParams


class _Writer:
    """The state of one `InsertQDQ` (set by its constructor and `call`) and the helpers its
    parts share; the parts are mixins: `_ActivationWriter`, `_DivisionFolder`, `_WeightWriter`."""

    name: ClassVar[str]
    _activations: tuple[ActivationTarget, ...]
    _weights: tuple[WeightTarget, ...]
    _biases: tuple[BiasTarget, ...]
    _activation_qparams: dict[str, OnnxQParams]
    _weight_codes: dict[str, QuantizedWeight]
    _quantized_reads: set[tuple[str, str]]
    _quantized_weights: set[tuple[str, str]]
    _originals: dict[str, onnx.TensorProto]
    _quantized_biases: set[tuple[str, str]]
    _bias_adds: dict[str, str]
    _planned_inputs: dict[str, tuple[str, ...]]
    _pairs: dict[str, tuple[str, str]]

    def _uses_by(self, rewrite: _Rewrite, tensor: str, node: str, role: str) -> list[Use]:
        """The inputs of node `node` that read `tensor` directly."""
        if node in rewrite.duplicate_node_names:
            raise self._error(f"node name {node!r} is not unique; cannot place {role} {tensor!r}")
        found = rewrite.nodes_by_name.get(node)
        if found is None:
            raise self._error(f"{role} {tensor!r}: consumer node {node!r} is not in the graph")
        uses = [
            use
            for use in rewrite.index.uses.get(tensor, ())
            if use.node is found and use.slot != SUBGRAPH_SLOT
        ]
        if not uses:
            raise self._error(f"{role} {tensor!r}: node {node!r} does not read it")
        return uses

    def _float_type(self, rewrite: _Rewrite, tensor: str, role: str) -> int:
        float_type = rewrite.types.get(tensor, TensorProto.FLOAT)
        if float_type not in _FLOAT_TYPES:
            type_name = TensorProto.DataType.Name(float_type)
            raise self._error(f"{role} {tensor!r} is {type_name}; only float tensors quantize")
        return float_type

    def _error(self, message: str) -> ModelError:
        return ModelError(f"{self.name}: {message}")
