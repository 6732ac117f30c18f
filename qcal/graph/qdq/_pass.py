"""The InsertQDQ pass: checks the plan and parameters against the model, rewrites a copy
(activations, folded divisions, weights, biases, in that order) and checks what it wrote."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import onnx
from onnx import TensorProto

from qcal.graph.files.large import (
    SERIALIZE_LIMIT_BYTES,
    has_external_data,
    light_copy,
    run_detached,
    serialize_within,
)
from qcal.graph.names import NameAllocator
from qcal.graph.qdq._codes import (
    _BYTE_TYPES,
    _HALF_FLOAT_OPSET,
    _PASS_NAME,
    _PER_AXIS_OPSET,
    _QDQ_OPSET,
    _WIDE_TYPE_OPSET,
    QuantizedWeight,
    _check_qparams,
)
from qcal.graph.qdq._emit import _Scopes
from qcal.graph.qdq._fold import _DivisionFolder
from qcal.graph.qdq._integer_forms import write_integer_forms
from qcal.graph.qdq._shared_reads import share_dequantized_reads
from qcal.graph.qdq._weights import _group_by_tensor, _WeightWriter
from qcal.graph.structure import (
    all_graphs,
    check_wiring,
    default_opset,
    graph_element_types,
    keep_declared_shapes,
)

if TYPE_CHECKING:
    from qcal.graph.plan import QuantPlan
    from qcal.numerics.onnx_mapping import OnnxQParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the rewritten model and whether anything changed."""

    model: onnx.ModelProto
    modified: bool


class InsertQDQ(_DivisionFolder, _WeightWriter):
    """Insert Q/DQ pairs on planned activations and store planned weights and biases as integers.

    The pass works on a copy (the input model is never changed), iterates in sorted order and
    takes names from a collision-checked allocator, so identical inputs give a byte-identical
    model. It never changes opsets: a model whose default-domain opset is below what the
    parameters need is a ModelError (model preparation upgrades opsets).

    Names, for a tensor ``t`` (``<name>_<k>`` when taken): ``t_quantized`` (codes),
    ``t_dequantized`` (DQ output), ``t_scale``, ``t_zero_point``, ``t_clipped``,
    ``t_clip_min``/``t_clip_max``, and nodes ``t_QuantizeLinear``, ``t_DequantizeLinear``,
    ``t_Clip`` (``t_Max``/``t_Min`` per axis).
    """

    name: ClassVar[str] = _PASS_NAME

    def __init__(
        self,
        plan: QuantPlan,
        activations: Mapping[str, OnnxQParams],
        weights: Mapping[str, QuantizedWeight],
        *,
        declared_shapes: frozenset[str] | None = None,
    ) -> None:
        """Bind the plan and its parameters.

        Args:
            plan: what to quantize (its activations, weights and biases).
            activations: ONNX parameters per activation tensor; every planned activation needs
                one, other entries are ignored.
            weights: codes and parameters per weight initializer; every planned weight needs one.
            declared_shapes: the values whose value_info the user's model has: the written
                model keeps those (and the shapes Shape nodes read) and drops the rest that
                shape inference added (`keep_declared_shapes`). None keeps every value_info.
        """
        self._declared_shapes = declared_shapes
        self._activations = tuple(sorted(plan.activations, key=lambda t: t.tensor))
        self._weights = tuple(sorted(plan.weights, key=lambda t: (t.tensor, t.node)))
        self._biases = tuple(sorted(plan.biases, key=lambda t: (t.tensor, t.node)))
        # A plan restricted later (fallback, repairs) keeps the names: the quantized ones count.
        self._integer_forms = plan.integer_forms & {d.node for d in plan.nodes if d.quantized}
        self._float_nodes = frozenset(d.node for d in plan.nodes if not d.quantized)
        # This plan's alone: `activations` may hold parameters for more (an earlier plan's).
        self._activation_qparams = {t.tensor: activations[t.tensor] for t in self._activations
                                    if t.tensor in activations}
        self._weight_codes = dict(weights)
        # Who reads what quantized, for the bias rule: (tensor, node) pairs.
        self._quantized_reads = {
            (t.tensor, node) for t in self._activations for node in t.consumers
        }
        self._quantized_weights = {(t.tensor, t.node) for t in self._weights}
        self._originals: dict[str, onnx.TensorProto] = {}  # float data left out of the copy
        self._quantized_biases = {(t.tensor, t.node) for t in self._biases}
        # Add of an int32 bias -> the MatMul it adds to, which onnxruntime fuses into a Gemm
        self._bias_adds = {t.node: t.anchor for t in self._biases if t.anchor and not t.as_float}
        # Node inputs as planned, before this pass redirects them to DequantizeLinear outputs.
        self._planned_inputs: dict[str, tuple[str, ...]] = {}
        # Activation -> (codes, DequantizeLinear output) of the pair written for it.
        self._pairs: dict[str, tuple[str, str]] = {}

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        """Check `model`, rewrite a copy of it and check the result."""
        self.requires(model)
        result = self.call(model)
        self.ensures(result.model)
        return result

    def requires(self, model: onnx.ModelProto) -> None:
        """Precondition: consistent plan, valid parameters, and an opset that allows them."""
        for target in self._activations:
            if target.tensor not in self._activation_qparams:
                raise self._error(f"no quantization parameters for activation {target.tensor!r}")
            _check_qparams(self._activation_qparams[target.tensor], f"activation {target.tensor!r}")
        for tensor in sorted({w.tensor for w in self._weights}):
            if tensor not in self._weight_codes:
                raise self._error(f"no quantized codes for weight {tensor!r}")
            _check_qparams(self._weight_codes[tensor].onnx, f"weight {tensor!r}")
        roles: dict[str, str] = {}
        for role, tensors in (
            ("activation", [t.tensor for t in self._activations]),
            ("weight", [t.tensor for t in self._weights]),
            ("bias", [t.tensor for t in self._biases]),
        ):
            for tensor in tensors:
                if roles.setdefault(tensor, role) != role:
                    raise self._error(f"tensor {tensor!r} is planned as {roles[tensor]} and {role}")
        opset = default_opset(model)
        if opset is None:
            if self._activations or self._weights or self._biases:
                raise self._error("model imports no default-domain opset")
            return  # nothing to quantize (an ai.onnx.ml-only model): nothing needs an opset
        needed, why = self._required_opset(graph_element_types(model.graph))
        if opset < needed:
            raise self._error(
                f"model opset {opset} is below {needed}, needed by {why}; upgrade the opset first"
            )

    def call(self, model: onnx.ModelProto) -> PassResult:
        """Rewrite a copy of `model` (assumes `requires` held)."""
        # The copy leaves out the data of the float weights and biases it replaces: dropped
        # later, they would still hold their memory (protobuf frees a message's fields only
        # with the message). Those still read in float get their data back at the end.
        planned = {t.tensor for t in self._weights} | {t.tensor for t in self._biases}
        out, detached = light_copy(model, min_bytes=0, names=planned)
        self._originals = {t.name: t for t in model.graph.initializer if t.name in detached}
        scopes = _Scopes(
            out.graph,
            NameAllocator.from_model(out),
            opset=default_opset(out) or _QDQ_OPSET,
            ranks=_ranks(model) if self._clips_on_positive_axis() else {},
        )
        self._planned_inputs = {
            node.name: tuple(node.input) for graph in all_graphs(out.graph) for node in graph.node
        }
        self._pairs = {}
        folds = self._folds(scopes)
        for target in self._activations:
            if target.tensor not in folds:
                self._quantize_activation(scopes, target)
        self._fold_divisions(scopes, folds)
        for tensor, targets in _group_by_tensor(self._weights):
            self._quantize_weight(scopes, tensor, targets)
        for bias in self._biases:
            self._quantize_bias(scopes, bias)
        scopes.finish()
        write_integer_forms(out, self._integer_forms)
        share_dequantized_reads(out, self._float_nodes)
        if self._declared_shapes is not None:
            keep_declared_shapes(out.graph, self._declared_shapes)
        for tensor in out.graph.initializer:
            if tensor.name in self._originals:
                tensor.raw_data = self._originals[tensor.name].raw_data
        self._originals = {}
        return PassResult(out, modified=scopes.modified)

    def ensures(self, model: onnx.ModelProto) -> None:
        """Postcondition: the written model is wired in order and passes onnx.checker."""
        problem = check_wiring(model.graph)
        if problem is not None:
            raise self._error(f"wrote a malformed graph: {problem}")
        if has_external_data(model):
            # onnx.checker looks for external data relative to the current directory.
            logger.info("%s: weights kept in files, onnx.checker skipped", self.name)
            return
        data = serialize_within(model, SERIALIZE_LIMIT_BYTES)
        if data is None:
            # onnx.checker takes one serialized protobuf, which cannot exceed 2 GiB.
            logger.warning("%s: model over 2 GiB, onnx.checker skipped", self.name)
            return
        try:
            onnx.checker.check_model(data)
        except onnx.checker.ValidationError as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise self._error(f"wrote a model that fails onnx.checker: {lines[0]}") from None


    def _required_opset(self, types: Mapping[str, int]) -> tuple[int, str]:
        """The lowest default-domain opset the planned nodes need, and what needs it."""
        needed, why = _QDQ_OPSET, "QuantizeLinear"
        named = [
            (t.tensor, f"activation {t.tensor!r}", self._activation_qparams[t.tensor])
            for t in self._activations
        ]
        named += [
            (t, f"weight {t!r}", self._weight_codes[t].onnx)
            for t in sorted({w.tensor for w in self._weights})
        ]
        for tensor, what, qparams in named:
            opset = max(
                qparams.min_opset,
                _PER_AXIS_OPSET if qparams.axis is not None else 0,
                _WIDE_TYPE_OPSET if qparams.dtype not in _BYTE_TYPES else 0,
                _HALF_FLOAT_OPSET
                if types.get(tensor, TensorProto.FLOAT) != TensorProto.FLOAT
                else 0,
            )
            if opset > needed:
                needed, why = opset, what
        for bias in self._biases:
            weight = self._quantized_weight(bias)
            if weight is not None and weight.axis is not None and _PER_AXIS_OPSET > needed:
                needed, why = _PER_AXIS_OPSET, f"per-channel bias {bias.tensor!r}"
        return needed, why

    def _clips_on_positive_axis(self) -> bool:
        """Whether a per-axis clip needs tensor ranks (a negative axis does not)."""
        return any(
            q.axis is not None
            and q.axis >= 0
            and (q.clip_min is not None or q.clip_max is not None)
            for q in (self._activation_qparams[t.tensor] for t in self._activations)
        )


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Ranks of the values known after shape inference (only needed for per-axis clips)."""
    graph = model.graph
    try:
        inferred = run_detached(
            model, onnx.shape_inference.infer_shapes, what="shape inference", reattach=False
        ).graph
    except onnx.shape_inference.InferenceError:
        inferred = graph
    ranks: dict[str, int] = {}
    for value in (*inferred.input, *inferred.output, *inferred.value_info):
        tensor_type = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor_type.HasField("shape"):
            ranks[value.name] = len(tensor_type.shape.dim)
    for tensor in graph.initializer:
        ranks[tensor.name] = len(tensor.dims)
    return ranks
