"""The InsertQDQ pass: write a QDQ model from a quantization plan and its ONNX parameters.

Layout, chosen so that onnxruntime's CPU provider fuses each quantized Conv/MatMul/Gemm/Add/
Concat with the Q/DQ nodes around it into one integer kernel (QLinearConv, QLinearMatMul or
MatMulIntegerToFloat, QGemm, QLinearAdd, QLinearConcat) and drops Q/DQ around data movement
(MaxPool, Flatten, Reshape, ...) when both sides carry the same parameters:

* activation ``t``: ``t -> [Clip] -> QuantizeLinear -> t_quantized -> DequantizeLinear ->
  t_dequantized``, one pair per tensor, read by the quantized consumers the plan lists. Other
  consumers, subgraphs and graph outputs keep reading the float ``t``.
* weight ``w``: integer codes ``w_quantized`` (an initializer) and a DequantizeLinear; the float
  initializer is dropped unless something not quantized still reads it.
* bias ``b`` of a node whose input activation and weight are both quantized: int32 codes with
  ``scale = f32(input_scale * weight_scale)`` (per channel when the weight is), zero point 0 and
  codes ``saturate_int32(rne(b / scale))``, then a DequantizeLinear. That is the bias QLinearConv
  and QGemm add in their integer accumulator.

ONNX semantics (SEMANTICS.md §7): ``QuantizeLinear(x) = saturate(rne(x / scale) + zero_point)``,
``DequantizeLinear(q) = (q - zero_point) * scale``. Where the preset's integer range is narrower
than the ONNX type, the float input is first clipped to ``[clip_min, clip_max]`` (Clip per
tensor; Max then Min against constants shaped for the axis per axis), which gives the same codes
as clamping the integers.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.files.large import (
    SERIALIZE_LIMIT_BYTES,
    has_external_data,
    light_copy,
    run_detached,
    serialized_size,
    tensor_array,
)
from qcal.graph.names import NameAllocator
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    SUBGRAPH_SLOT,
    Use,
    UseIndex,
    all_graphs,
    attribute_graphs,
    check_wiring,
    default_opset,
    graph_element_types,
)
from qcal.numerics.errors import ModelError

if TYPE_CHECKING:
    from qcal.graph.model import ActivationTarget, BiasTarget, QuantPlan, WeightTarget
    from qcal.numerics.onnx_mapping import OnnxQParams

__all__ = ["InsertQDQ", "PassResult", "QuantizedWeight"]

logger = logging.getLogger(__name__)

# ONNX integer type -> (numpy storage dtype, lowest code, highest code). 4-bit codes are held in
# int8/uint8 arrays and packed two per byte when written.
_INTEGER_TYPES: dict[int, tuple[type[np.integer], int, int]] = {
    TensorProto.INT8: (np.int8, -128, 127),
    TensorProto.UINT8: (np.uint8, 0, 255),
    TensorProto.INT16: (np.int16, -32768, 32767),
    TensorProto.UINT16: (np.uint16, 0, 65535),
    TensorProto.INT4: (np.int8, -8, 7),
    TensorProto.UINT4: (np.uint8, 0, 15),
}
_FOUR_BIT_TYPES = frozenset({TensorProto.INT4, TensorProto.UINT4})
_BYTE_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# Float types a QDQ pair can carry; the scale takes the tensor's type (from opset 19 it must).
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})

# Operators onnxruntime's CPU provider runs as one integer kernel when these inputs (None: all)
# come from DequantizeLinear and the output goes to a QuantizeLinear (QLinearConv, QGemm,
# QLinearMatMul, QLinearAdd, QLinearMul, QLinearConcat, QLinearAveragePool, ...). A Conv or
# Gemm bias (input 2) must then be quantized too.
_INTEGER_KERNEL_INPUTS: dict[str, tuple[int, ...] | None] = {
    "Conv": (0, 1),
    "Gemm": (0, 1),
    "MatMul": (0, 1),
    "Add": (0, 1),
    "Mul": (0, 1),
    "Concat": None,
    "AveragePool": (0,),
    "GlobalAveragePool": (0,),
    "Sigmoid": (0,),
    "LeakyRelu": (0,),
    "Softmax": (0,),
}

# Operators that only move or select values, which onnxruntime's CPU provider runs on the
# integers when the DequantizeLinear before and the QuantizeLinear after carry the same
# parameters (it drops the pair; Resize only in "nearest" mode). Their output's
# DequantizeLinear then holds exactly the float values, so float readers read it too.
_INTEGER_DATA_OPS = frozenset(
    {
        "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather",
        "DepthToSpace", "MaxPool", "Resize",
    }
)
# Relative tolerance between a folded division's scale and the source scale divided by the
# constant: float32 rounding of the two ways of computing it.
_FOLD_SCALE_RTOL = 1e-6

_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist from opset 10
_CLIP_INPUTS_OPSET = 11  # Clip takes min/max as inputs (before: attributes)
_PER_AXIS_OPSET = 13  # the `axis` attribute of QuantizeLinear/DequantizeLinear
_HALF_FLOAT_OPSET = 19  # float16/bfloat16 inputs and scales of QuantizeLinear
_WIDE_TYPE_OPSET = 21  # int16/uint16/int4/uint4 codes


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight's integer codes and the parameters that dequantize them.

    Attributes:
        codes: integer codes, same shape as the float weight; ``(codes - zp) * scale``
            approximates it (int4/uint4 codes are held as int8/uint8).
        onnx: the DequantizeLinear parameters (``axis`` set for per-channel weights).
    """

    codes: np.ndarray
    onnx: OnnxQParams


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the rewritten model and whether anything changed."""

    model: onnx.ModelProto
    modified: bool


class InsertQDQ:
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

    name: ClassVar[str] = "InsertQDQ"

    def __init__(
        self,
        plan: QuantPlan,
        activations: Mapping[str, OnnxQParams],
        weights: Mapping[str, QuantizedWeight],
    ) -> None:
        """Bind the plan and its parameters.

        Args:
            plan: what to quantize (its activations, weights and biases).
            activations: ONNX parameters per activation tensor; every planned activation needs
                one, other entries are ignored.
            weights: codes and parameters per weight initializer; every planned weight needs one.
        """
        self._activations = tuple(sorted(plan.activations, key=lambda t: t.tensor))
        self._weights = tuple(sorted(plan.weights, key=lambda t: (t.tensor, t.node)))
        self._biases = tuple(sorted(plan.biases, key=lambda t: (t.tensor, t.node)))
        self._activation_qparams = dict(activations)
        self._weight_codes = dict(weights)
        # Who reads what quantized, for the bias rule: (tensor, node) pairs.
        self._quantized_reads = {
            (t.tensor, node) for t in self._activations for node in t.consumers
        }
        self._quantized_weights = {(t.tensor, t.node) for t in self._weights}
        self._originals: dict[str, onnx.TensorProto] = {}  # float data left out of the copy
        self._quantized_biases = {(t.tensor, t.node) for t in self._biases}
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
            raise self._error("model imports no default-domain opset")
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
        if serialized_size(model) > SERIALIZE_LIMIT_BYTES:
            # onnx.checker takes one serialized protobuf, which cannot exceed 2 GiB.
            logger.warning("%s: model over 2 GiB, onnx.checker skipped", self.name)
            return
        if has_external_data(model):
            # onnx.checker looks for external data relative to the current directory.
            logger.info("%s: weights kept in files, onnx.checker skipped", self.name)
            return
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise self._error(f"wrote a model that fails onnx.checker: {lines[0]}") from None

    # -- activations --------------------------------------------------------------------------

    def _quantize_activation(self, scopes: _Scopes, target: ActivationTarget) -> None:
        tensor = target.tensor
        if tensor not in scopes.defined:
            raise self._error(f"activation {tensor!r} is not a tensor of the model")
        # One pair, in the graph defining the tensor; consumers inside If/Loop/Scan bodies read
        # its DequantizeLinear from the outer scope. (A QuantizeLinear inside a body reading an
        # outer value that a node produces crashes onnxruntime's QDQ propagation.)
        owner = scopes.definer(tensor)
        uses: list[Use] = []
        for rewrite, consumers in scopes.by_graph(target.consumers, self._error):
            if not rewrite.is_value(tensor):
                raise self._error(f"activation {tensor!r} is not visible where {consumers[0]!r} is")
            uses += [
                use
                for consumer in consumers
                for use in self._uses_by(rewrite, tensor, consumer, "activation")
            ]
        uses += self._float_reads_of_integer_output(owner, tensor, uses)
        if not uses:
            # Nothing would read the pair: a dangling Q/DQ only costs time and blocks fusion.
            logger.debug("activation %r has no quantized consumer; left in float", tensor)
            return
        self._insert_pair(owner, tensor, uses)

    def _float_reads_of_integer_output(
        self, rewrite: _Rewrite, tensor: str, quantized: Sequence[Use]
    ) -> list[Use]:
        """The float reads of `tensor` that must go through its pair for onnxruntime to compute
        the producer in integers.

        onnxruntime fuses DequantizeLinear -> Conv (Add, Mul, ...) -> QuantizeLinear into one
        integer kernel only when the QuantizeLinear is the producer's only reader. So when every
        input of the producer is quantized, float readers (a HardSigmoid, a Div) read the
        DequantizeLinear too, as onnxruntime's own quantizer arranges it. Not for graph outputs
        or tensors read inside bodies: those keep the float value. Likewise for the output of
        a data-movement operator whose input is read with the same parameters
        (`_INTEGER_DATA_OPS`): onnxruntime runs it on the integers only when the QuantizeLinear
        is its only reader, and the DequantizeLinear gives back exactly the float values.
        """
        producer = rewrite.index.producer.get(tensor)
        if (
            producer is None
            or producer.domain not in DEFAULT_DOMAINS
            or tensor in rewrite.index.graph_outputs
        ):
            return []
        if self._integer_data_op(producer, tensor):
            return self._other_float_reads(rewrite, tensor, quantized)
        if producer.op_type not in _INTEGER_KERNEL_INPUTS:
            return []
        slots = _INTEGER_KERNEL_INPUTS[producer.op_type]
        for slot, value in enumerate(self._planned_inputs.get(producer.name, producer.input)):
            read = (value, producer.name)
            if not value:
                continue
            if slots is None or slot in slots:
                if read not in self._quantized_reads and read not in self._quantized_weights:
                    return []
            elif (
                slot == 2
                and producer.op_type in ("Conv", "Gemm")
                and read not in self._quantized_biases
            ):
                return []  # a float bias keeps the node float
        return self._other_float_reads(rewrite, tensor, quantized)

    @staticmethod
    def _other_float_reads(rewrite: _Rewrite, tensor: str, quantized: Sequence[Use]) -> list[Use]:
        """The reads of `tensor` not in `quantized`; none when one is inside a body."""
        taken = {(id(use.node), use.slot) for use in quantized}
        others = [u for u in rewrite.index.uses.get(tensor, ()) if (id(u.node), u.slot) not in taken]
        if any(use.slot == SUBGRAPH_SLOT for use in others):
            return []
        return others

    def _integer_data_op(self, producer: onnx.NodeProto, tensor: str) -> bool:
        """Whether `producer` moves the values of an input it reads quantized with the
        parameters of its output `tensor`, so that onnxruntime runs it on the integers."""
        if producer.op_type not in _INTEGER_DATA_OPS or tensor != producer.output[0]:
            return False
        if producer.op_type == "Resize" and _string_attribute(producer, "mode") not in (
            "", "nearest"  # the default
        ):
            return False
        planned = self._planned_inputs.get(producer.name, tuple(producer.input))
        source = planned[0] if planned else ""
        if (source, producer.name) not in self._quantized_reads:
            return False
        return _same_qparams(self._activation_qparams[source], self._activation_qparams[tensor])

    # -- divisions folded into a DequantizeLinear scale ----------------------------------------

    def _folds(self, scopes: _Scopes) -> dict[str, tuple[str, onnx.NodeProto]]:
        """Activation -> (its source, the Div) for the outputs of a Div by a positive constant
        scalar that reads its input quantized, when the output's parameters are the input's
        with the scale divided by the constant: ``DQ(q, s, z) / c = DQ(q, s / c, z)``, so the
        output's DequantizeLinear reads the input's codes and nothing is left to divide."""
        folds: dict[str, tuple[str, onnx.NodeProto]] = {}
        for target in self._activations:
            tensor = target.tensor
            rewrite = scopes.defined.get(tensor)
            producer = None if rewrite is None else rewrite.index.producer.get(tensor)
            if (
                rewrite is None
                or producer is None
                or producer.op_type != "Div"
                or producer.domain not in DEFAULT_DOMAINS
                or len(producer.input) != 2
            ):
                continue
            source = self._planned_inputs.get(producer.name, tuple(producer.input))[0]
            divisor = _positive_scalar(scopes.initializer(producer.input[1]))
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
        if not uses:
            return
        qparams = self._activation_qparams[tensor]
        float_type = self._float_type(rewrite, tensor, "activation")
        scale, zero_point = rewrite.add_qparams(tensor, qparams, float_type)
        codes, source_dequantized = self._pairs[source]
        dequantized = rewrite.add_node(
            "DequantizeLinear", tensor, [codes, scale, zero_point], qparams.axis, after=source
        )
        rewrite.redirect(uses, dequantized)
        self._pairs[tensor] = (codes, dequantized)
        if keeps_division:
            return
        rewrite.remove(division)
        scopes.drop_if_unused(division.input[1])
        if not scopes.is_read(source_dequantized):
            rewrite.remove_producer(source_dequantized)

    def _insert_pair(self, rewrite: _Rewrite, tensor: str, uses: Sequence[Use]) -> None:
        qparams = self._activation_qparams[tensor]
        float_type = self._float_type(rewrite, tensor, "activation")
        source = tensor
        if qparams.clip_min is not None or qparams.clip_max is not None:
            source = rewrite.add_clip(tensor, qparams, float_type)
        scale, zero_point = rewrite.add_qparams(tensor, qparams, float_type)
        quantized = rewrite.add_node(
            "QuantizeLinear", tensor, [source, scale, zero_point], qparams.axis, after=tensor
        )
        dequantized = rewrite.add_node(
            "DequantizeLinear", tensor, [quantized, scale, zero_point], qparams.axis, after=tensor
        )
        rewrite.redirect(uses, dequantized)
        self._pairs[tensor] = (quantized, dequantized)

    # -- weights ------------------------------------------------------------------------------

    def _quantize_weight(
        self, scopes: _Scopes, tensor: str, targets: Sequence[WeightTarget]
    ) -> None:
        quantized = self._weight_codes[tensor]
        qparams = quantized.onnx
        initializer = scopes.initializer(tensor)
        if initializer is None:
            raise self._error(f"weight {tensor!r} is not an initializer")
        shape = tuple(initializer.dims)
        codes = _checked_codes(quantized.codes, qparams.dtype, shape, f"weight {tensor!r}")
        if qparams.axis is not None:
            _check_axis_length(qparams, shape, f"weight {tensor!r}")
            for target in targets:
                if target.axis is not None and (target.axis - qparams.axis) % len(shape):
                    raise self._error(
                        f"weight {tensor!r} of node {target.node!r} is quantized on axis "
                        f"{qparams.axis}, planned on axis {target.axis}"
                    )
        for rewrite, nodes in scopes.by_graph([t.node for t in targets], self._error):
            float_type = self._float_type(rewrite, tensor, "weight")
            uses = [use for node in nodes for use in self._uses_by(rewrite, tensor, node, "weight")]
            codes_name = rewrite.add_integer_initializer(
                f"{tensor}_quantized", codes, qparams.dtype
            )
            scale, zero_point = rewrite.add_qparams(tensor, qparams, float_type)
            dequantized = rewrite.add_node(
                "DequantizeLinear", tensor, [codes_name, scale, zero_point], qparams.axis,
                after=None,
            )
            rewrite.redirect(uses, dequantized)
        scopes.drop_if_unused(tensor)

    # -- biases -------------------------------------------------------------------------------

    def _quantize_bias(self, scopes: _Scopes, bias: BiasTarget) -> None:
        input_qparams = self._quantized_input(bias)
        weight_qparams = self._quantized_weight(bias)
        if input_qparams is None or weight_qparams is None:
            logger.debug(
                "bias %r of %r stays float: its input or weight is not quantized",
                bias.tensor,
                bias.node,
            )
            return
        if input_qparams.axis is not None:
            logger.warning(
                "bias %r of %r stays float: input %r is quantized per axis",
                bias.tensor,
                bias.node,
                bias.input_tensor,
            )
            return
        initializer = scopes.initializer(bias.tensor)
        if initializer is None:
            raise self._error(f"bias {bias.tensor!r} of node {bias.node!r} is not an initializer")
        ((rewrite, _),) = scopes.by_graph([bias.node], self._error)
        float_type = self._float_type(rewrite, bias.tensor, "bias")
        values = tensor_array(self._originals.get(bias.tensor, initializer))
        values = values.astype(np.float32)
        scale, axis = self._bias_scale(bias, values.shape, input_qparams, weight_qparams)
        stored_scale = scale.astype(_numpy_float(float_type))
        if not (np.all(np.isfinite(stored_scale)) and np.all(stored_scale > 0)):
            raise self._error(
                f"bias {bias.tensor!r}: input scale x weight scale is not a positive "
                f"{TensorProto.DataType.Name(float_type)}"
            )
        codes = _quantize_bias_codes(values, stored_scale.astype(np.float32), axis)
        uses = self._uses_by(rewrite, bias.tensor, bias.node, "bias")
        codes_name = rewrite.add_integer_initializer(
            f"{bias.tensor}_quantized", codes, TensorProto.INT32
        )
        scale_name = rewrite.add_constant(f"{bias.tensor}_scale", stored_scale)
        zero_point = rewrite.add_constant(
            f"{bias.tensor}_zero_point", np.zeros(scale.shape, np.int32)
        )
        dequantized = rewrite.add_node(
            "DequantizeLinear", bias.tensor, [codes_name, scale_name, zero_point], axis, after=None
        )
        rewrite.redirect(uses, dequantized)
        scopes.drop_if_unused(bias.tensor)

    def _quantized_input(self, bias: BiasTarget) -> OnnxQParams | None:
        """The parameters of the bias node's input activation, if the node reads it quantized."""
        if (bias.input_tensor, bias.node) in self._quantized_reads:
            return self._activation_qparams[bias.input_tensor]
        return None

    def _quantized_weight(self, bias: BiasTarget) -> OnnxQParams | None:
        """The parameters of the bias node's weight, if the plan quantizes it for that node."""
        if (bias.weight_tensor, bias.node) in self._quantized_weights:
            return self._weight_codes[bias.weight_tensor].onnx
        return None

    def _bias_scale(
        self,
        bias: BiasTarget,
        shape: tuple[int, ...],
        input_qparams: OnnxQParams,
        weight_qparams: OnnxQParams,
    ) -> tuple[np.ndarray, int | None]:
        """Bias scale ``f32(input_scale * weight_scale)`` and its DequantizeLinear axis."""
        input_scale = np.float32(np.asarray(input_qparams.scale, dtype=np.float32))
        # numpy's float32 product is the correctly rounded one, the value QLinearConv and QGemm
        # compute for their int32 bias.
        scale = np.asarray(input_scale * np.asarray(weight_qparams.scale, dtype=np.float32))
        if weight_qparams.axis is None:
            return scale.astype(np.float32).reshape(()), None
        channels = int(np.prod(shape))
        if shape and scale.size and channels != scale.size and channels % scale.size == 0:
            # ConvTranspose with groups: the weight's axis-1 channels repeat once per group.
            scale = np.tile(scale, channels // scale.size)
        if not shape or channels != scale.size or sum(d != 1 for d in shape) > 1:
            raise self._error(
                f"bias {bias.tensor!r} of shape {list(shape)} does not match the "
                f"{np.asarray(weight_qparams.scale).size} channels of weight {bias.weight_tensor!r}"
            )
        axis = next((i for i, d in enumerate(shape) if d == channels), 0)
        return scale.astype(np.float32), axis

    # -- shared -------------------------------------------------------------------------------

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

    def _error(self, message: str) -> ModelError:
        return ModelError(f"{self.name}: {message}")


class _Scopes:
    """The edits of one pass over the main graph and every graph nested in it, one `_Rewrite`
    per graph. Value and node names are unique across graphs (NameNodes, and ONNX forbids a
    body from redefining an outer value), so a node name says which graph it sits in."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        names: NameAllocator,
        *,
        opset: int,
        ranks: Mapping[str, int],
    ) -> None:
        self._names, self._opset, self._ranks = names, opset, ranks
        self._types = graph_element_types(graph)
        self.rewrites: list[_Rewrite] = []
        self.reads = _Reads()
        self.defined: dict[str, _Rewrite] = {}  # value -> rewrite of the graph defining it
        self._of_node: dict[str, _Rewrite] = {}
        self._twice: set[str] = set()
        self._owner: dict[str, _Rewrite] = {}  # initializer -> rewrite of the graph holding it
        self._maybe_unread: list[str] = []
        self.main = self._visit(graph, frozenset())

    def _visit(self, graph: onnx.GraphProto, outer: frozenset[str]) -> _Rewrite:
        rewrite = _Rewrite(
            graph, self._names, opset=self._opset, ranks=self._ranks, types=self._types,
            reads=self.reads, outer=outer,
        )
        self.rewrites.append(rewrite)
        for node in graph.node:
            if node.name and self._of_node.setdefault(node.name, rewrite) is not rewrite:
                self._twice.add(node.name)
        for name in rewrite.index.initializers:
            self._owner.setdefault(name, rewrite)
        local = {v.name for v in graph.input} | set(rewrite.index.initializers)
        local.update(rewrite.index.producer)
        for name in local:
            self.defined.setdefault(name, rewrite)
        inner = outer | local
        for node in graph.node:
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    self._visit(subgraph, inner)
        return rewrite

    @property
    def modified(self) -> bool:
        return any(r.modified for r in self.rewrites)

    def by_graph(
        self, nodes: Iterable[str], error: Callable[[str], ModelError]
    ) -> list[tuple[_Rewrite, list[str]]]:
        """`nodes` (names, sorted) grouped by the graph holding them, main graph first."""
        groups: dict[int, list[str]] = defaultdict(list)
        order = {id(r): i for i, r in enumerate(self.rewrites)}
        for node in sorted(set(nodes)):
            if node in self._twice:
                raise error(f"node name {node!r} is not unique")
            rewrite = self._of_node.get(node)
            if rewrite is None:
                raise error(f"node {node!r} is not in the graph")
            groups[order[id(rewrite)]].append(node)
        return [(self.rewrites[i], groups[i]) for i in sorted(groups)]

    def definer(self, value: str) -> _Rewrite:
        """The rewrite of the graph that defines `value`."""
        return self.defined[value]

    def initializer(self, name: str) -> onnx.TensorProto | None:
        owner = self._owner.get(name)
        return None if owner is None else owner.index.initializers[name]

    def drop_if_unused(self, tensor: str) -> None:
        """Drop float initializer `tensor` at the end if nothing reads it any more."""
        self._maybe_unread.append(tensor)

    def is_read(self, value: str) -> bool:
        """Whether a node (one this pass added included, a removed one not) or a graph output of
        any graph reads `value` now."""
        return self.reads.counts(self.rewrites)[value] > 0

    def finish(self) -> None:
        for tensor in self._maybe_unread:
            if not self.is_read(tensor):
                self._owner[tensor].drop(tensor)
        # Innermost graphs first: writing a graph copies its nodes, bodies included.
        for rewrite in reversed(self.rewrites):
            rewrite.finish()


class _Reads:
    """How many times each value of the graphs of a pass is read now: as an input of a node (one
    the pass added included, a removed one not) or as a graph output. Counted over every graph
    when first asked, then kept up to date by the edits (`_Rewrite.add_node`, `redirect` and
    `remove`), so each question after the first costs a lookup, not a walk of the graphs.
    It holds no reference to the rewrites, which hold it: a cycle would keep their new
    initializers (the quantized weights) alive after the pass until the garbage collector runs."""

    def __init__(self) -> None:
        self._count: Counter[str] | None = None
        self._removed: set[int] = set()  # ids of the nodes removed, in every graph

    def counts(self, rewrites: Sequence[_Rewrite]) -> Counter[str]:
        if self._count is None:
            self._count = Counter()
            for rewrite in rewrites:
                rewrite.count_reads(self._count)
        return self._count

    def added(self, node: onnx.NodeProto) -> None:
        if self._count is not None:
            self._count.update(node.input)

    def redirected(self, node: onnx.NodeProto, old: str, new: str) -> None:
        if self._count is not None and id(node) not in self._removed:
            self._count[old] -= 1
            self._count[new] += 1

    def removed(self, node: onnx.NodeProto) -> None:
        if id(node) in self._removed:
            return
        self._removed.add(id(node))
        if self._count is not None:
            self._count.subtract(node.input)


class _Rewrite:
    """The edits of one pass over one graph: new nodes and initializers, redirected inputs.

    Nodes go right after the producer of the value they are named after (at the front for
    graph inputs, initializers and values of enclosing graphs), so a topologically sorted
    graph stays sorted.
    """

    def __init__(
        self,
        graph: onnx.GraphProto,
        names: NameAllocator,
        *,
        opset: int,
        ranks: Mapping[str, int],
        types: Mapping[str, int],
        reads: _Reads,
        outer: frozenset[str] = frozenset(),
    ) -> None:
        self.graph, self.names, self.opset, self._ranks = graph, names, opset, ranks
        self._reads = reads
        self.index = UseIndex.build(graph)
        self.types = types
        self._outer = outer
        self.nodes_by_name: dict[str, onnx.NodeProto] = {}
        duplicates: set[str] = set()
        self._position: dict[int, int] = {}
        for position, node in enumerate(graph.node):
            self._position[id(node)] = position
            if node.name and self.nodes_by_name.setdefault(node.name, node) is not node:
                duplicates.add(node.name)
        self.duplicate_node_names = frozenset(duplicates)
        self.modified = False
        self._front: list[onnx.NodeProto] = []
        self._after: defaultdict[int, list[onnx.NodeProto]] = defaultdict(list)
        self._new_producer: dict[str, onnx.NodeProto] = {}  # output (a fresh name) -> new node
        self._initializers: list[onnx.TensorProto] = []
        self._redirected: set[tuple[int, int]] = set()
        self._dropped: set[str] = set()
        self._removed: set[int] = set()  # ids of nodes (old or new) left out when written

    def is_value(self, name: str) -> bool:
        index = self.index
        return (
            name in index.producer
            or name in index.graph_inputs
            or name in index.initializers
            or name in self._outer
        )

    def add_qparams(self, tensor: str, qparams: OnnxQParams, float_type: int) -> tuple[str, str]:
        """Scale (in `float_type`) and zero-point initializers for `tensor`."""
        stored = _float_array(qparams.scale, float_type)
        if not (np.all(np.isfinite(stored)) and np.all(stored > 0)):
            type_name = TensorProto.DataType.Name(float_type)
            raise ModelError(f"{InsertQDQ.name}: scale of {tensor!r} does not fit {type_name}")
        scale = self.add_constant(f"{tensor}_scale", stored)
        zero_point = self.add_integer_initializer(
            f"{tensor}_zero_point", np.asarray(qparams.zero_point), qparams.dtype
        )
        return scale, zero_point

    def add_clip(self, tensor: str, qparams: OnnxQParams, float_type: int) -> str:
        """Clip `tensor` to ``[clip_min, clip_max]`` before it is quantized; returns the output."""
        bounds = [
            (kind, None if bound is None else _float_array(bound, float_type))
            for kind, bound in (("min", qparams.clip_min), ("max", qparams.clip_max))
        ]
        if qparams.axis is None:
            return self._add_tensor_clip(tensor, bounds)
        shape = self._broadcast_shape(tensor, qparams)
        clipped = tensor
        for kind, bound in bounds:
            if bound is not None:
                constant = self.add_constant(f"{tensor}_clip_{kind}", bound.reshape(shape))
                op_type = "Max" if kind == "min" else "Min"
                clipped = self.add_node(
                    op_type,
                    tensor,
                    [clipped, constant],
                    None,
                    after=tensor,
                    output_suffix="clipped",
                )
        return clipped

    def _add_tensor_clip(self, tensor: str, bounds: list[tuple[str, np.ndarray | None]]) -> str:
        if self.opset < _CLIP_INPUTS_OPSET:
            attributes = {kind: float(bound) for kind, bound in bounds if bound is not None}
            return self.add_node(
                "Clip",
                tensor,
                [tensor],
                None,
                after=tensor,
                output_suffix="clipped",
                attributes=attributes,
            )
        inputs = [tensor] + [
            "" if bound is None else self.add_constant(f"{tensor}_clip_{kind}", bound)
            for kind, bound in bounds
        ]
        while inputs[-1] == "":
            inputs.pop()
        return self.add_node("Clip", tensor, inputs, None, after=tensor, output_suffix="clipped")

    def add_node(
        self,
        op_type: str,
        tensor: str,
        inputs: Sequence[str],
        axis: int | None,
        *,
        after: str | None,
        output_suffix: str | None = None,
        attributes: Mapping[str, float] | None = None,
    ) -> str:
        """Add an `op_type` node named after `tensor`, placed after the producer of `after`."""
        suffix = output_suffix or {"QuantizeLinear": "quantized"}.get(op_type, "dequantized")
        output = self.names.allocate(f"{tensor}_{suffix}")
        node = helper.make_node(
            op_type, list(inputs), [output], name=self.names.allocate(f"{tensor}_{op_type}")
        )
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        for key, value in sorted((attributes or {}).items()):
            node.attribute.append(helper.make_attribute(key, value))
        producer = None if after is None else self.index.producer.get(after)
        if producer is None:
            self._front.append(node)
        else:
            self._after[self._position[id(producer)]].append(node)
        self._new_producer[output] = node
        self._reads.added(node)
        self.modified = True
        return output

    def add_constant(self, base: str, value: np.ndarray) -> str:
        name = self.names.allocate(base)
        self._initializers.append(numpy_helper.from_array(value, name))
        return name

    def add_integer_initializer(self, base: str, codes: np.ndarray, dtype: int) -> str:
        name = self.names.allocate(base)
        self._initializers.append(_integer_tensor(name, codes, dtype))
        return name

    def redirect(self, uses: Sequence[Use], value: str) -> None:
        """Make each use read `value` instead of what it read."""
        for use in uses:
            old = use.node.input[use.slot]
            use.node.input[use.slot] = value
            self._reads.redirected(use.node, old, value)
            self._redirected.add((id(use.node), use.slot))
        self.modified = True

    def count_reads(self, count: Counter[str]) -> None:
        """Count every read of a value by this graph's nodes (new ones included) and outputs."""
        for node in (*self.graph.node, *self._new_nodes()):
            if id(node) not in self._removed:
                count.update(node.input)
        count.update(v.name for v in self.graph.output)

    def remove(self, node: onnx.NodeProto) -> None:
        """Leave `node` (of this graph, or added by this pass) out when the graph is written."""
        self._reads.removed(node)
        self._removed.add(id(node))
        self.modified = True

    def remove_producer(self, value: str) -> None:
        """Leave out the node this pass added that writes `value`."""
        node = self._new_producer.get(value)
        if node is not None:
            self.remove(node)

    def _new_nodes(self) -> Iterator[onnx.NodeProto]:
        yield from self._front
        for nodes in self._after.values():
            yield from nodes

    def drop(self, tensor: str) -> None:
        """Remove initializer `tensor` when the graph is written."""
        self._dropped.add(tensor)

    def finish(self) -> None:
        """Write nodes in topological order, add the new initializers, remove dropped floats."""
        if self._front or self._after:
            ordered: list[onnx.NodeProto] = list(self._front)
            for position, node in enumerate(self.graph.node):
                ordered.append(node)
                ordered.extend(self._after.get(position, ()))
            ordered = [node for node in ordered if id(node) not in self._removed]
            copies = [onnx.NodeProto() for _ in ordered]
            for copy, node in zip(copies, ordered):
                copy.CopyFrom(node)
            del self.graph.node[:]
            self.graph.node.extend(copies)
        for values in (self.graph.initializer, self.graph.input, self.graph.value_info):
            for i in reversed(range(len(values))):
                if values[i].name in self._dropped:
                    del values[i]
        self.graph.initializer.extend(self._initializers)

    def _broadcast_shape(self, tensor: str, qparams: OnnxQParams) -> tuple[int, ...]:
        """Shape ``(C, 1, ..., 1)`` that lines per-axis clip bounds up with `qparams.axis`."""
        assert qparams.axis is not None
        axis, channels = qparams.axis, int(np.asarray(qparams.scale).size)
        if axis < 0:
            return (channels,) + (1,) * (-axis - 1)
        rank = self._ranks.get(tensor)
        if rank is None:
            raise ModelError(
                f"{InsertQDQ.name}: rank of activation {tensor!r} is unknown; "
                f"cannot clip it on axis {axis}"
            )
        return (channels,) + (1,) * (rank - axis - 1)


def _same_qparams(a: OnnxQParams, b: OnnxQParams) -> bool:
    """Whether two parameter sets quantize alike (same type, scale, zero point, axis, clip)."""
    return _divided_qparams(a, b, 1.0, rtol=0.0)


def _divided_qparams(
    source: OnnxQParams, divided: OnnxQParams, divisor: float, *, rtol: float = _FOLD_SCALE_RTOL
) -> bool:
    """Whether `divided` is `source` for the values divided by `divisor`: per tensor, same type
    and zero point, scale and clip bounds divided by it (to `rtol`). The codes of a value then
    are the same under both, so `divided`'s DequantizeLinear can read `source`'s codes."""
    if source.dtype != divided.dtype or source.axis is not None or divided.axis is not None:
        return False
    if not np.array_equal(np.asarray(source.zero_point), np.asarray(divided.zero_point)):
        return False
    pairs: list[tuple[np.ndarray, np.ndarray]] = [(source.scale, divided.scale)]
    for a, b in ((source.clip_min, divided.clip_min), (source.clip_max, divided.clip_max)):
        if (a is None) != (b is None):
            return False
        if a is not None and b is not None:
            pairs.append((a, b))
    return all(
        np.allclose(
            np.asarray(b, np.float64) * divisor, np.asarray(a, np.float64), rtol=rtol, atol=0.0
        )
        for a, b in pairs
    )


def _positive_scalar(constant: onnx.TensorProto | None) -> float | None:
    """The value of a one-element float constant if it is finite and positive, else None."""
    if constant is None or constant.data_type not in _FLOAT_TYPES:
        return None
    values = tensor_array(constant)
    if values.size != 1:
        return None
    value = float(values.reshape(()))
    return value if np.isfinite(value) and value > 0 else None


def _string_attribute(node: onnx.NodeProto, name: str) -> str:
    for attribute in node.attribute:
        if attribute.name == name:
            return str(attribute.s.decode())
    return ""


def _group_by_tensor(
    targets: Sequence[WeightTarget],
) -> Iterator[tuple[str, list[WeightTarget]]]:
    grouped: dict[str, list[WeightTarget]] = defaultdict(list)
    for target in targets:
        grouped[target.tensor].append(target)
    for tensor in sorted(grouped):
        yield tensor, grouped[tensor]


def _check_qparams(qparams: OnnxQParams, what: str) -> None:
    """Parameters a QuantizeLinear/DequantizeLinear pair can carry."""

    def fail(message: str) -> ModelError:
        return ModelError(f"{InsertQDQ.name}: {what}: {message}")

    if qparams.dtype not in _INTEGER_TYPES:
        raise fail(f"unsupported ONNX type {qparams.dtype}")
    scale = np.asarray(qparams.scale)
    if scale.dtype != np.float32 or not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
        raise fail("scale must be finite, positive float32")
    expected_ndim = 0 if qparams.axis is None else 1
    if scale.ndim != expected_ndim or np.shape(qparams.zero_point) != scale.shape:
        raise fail(f"scale and zero point must have {expected_ndim} dimension(s) and equal shapes")
    _checked_codes(np.asarray(qparams.zero_point), qparams.dtype, scale.shape, what)
    for bound in (qparams.clip_min, qparams.clip_max):
        if bound is not None and np.shape(bound) != scale.shape:
            raise fail("clip bounds must have the scale's shape")


def _checked_codes(codes: np.ndarray, dtype: int, shape: tuple[int, ...], what: str) -> np.ndarray:
    """`codes` in the storage dtype of ONNX type `dtype`, after checking shape and range."""
    storage, low, high = _INTEGER_TYPES[dtype]
    codes = np.asarray(codes)
    prefix = f"{InsertQDQ.name}: {what}:"
    if codes.shape != shape:
        raise ModelError(f"{prefix} codes of shape {list(codes.shape)}, expected {list(shape)}")
    if codes.dtype.kind not in "iuf" or (
        codes.dtype.kind == "f" and not np.array_equal(codes, np.rint(codes))
    ):
        raise ModelError(f"{prefix} codes are not integers")
    if codes.size and (codes.min() < low or codes.max() > high):
        name = TensorProto.DataType.Name(dtype)
        raise ModelError(f"{prefix} codes outside the {name} range [{low}, {high}]")
    return codes.astype(storage)


def _check_axis_length(qparams: OnnxQParams, shape: tuple[int, ...], what: str) -> None:
    assert qparams.axis is not None
    prefix = f"{InsertQDQ.name}: {what}:"
    if not -len(shape) <= qparams.axis < len(shape):
        raise ModelError(f"{prefix} axis {qparams.axis} out of range for shape {list(shape)}")
    channels = np.asarray(qparams.scale).size
    if shape[qparams.axis] != channels:
        raise ModelError(
            f"{prefix} {channels} scales for {shape[qparams.axis]} channels on axis {qparams.axis}"
        )


def _quantize_bias_codes(values: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    """``saturate_int32(rne(b / scale))``, divided in float64 so the saturation bound is exact."""
    if axis is not None:
        shape = [1] * values.ndim
        shape[axis] = scale.size
        scale = scale.reshape(shape)
    ratio = values.astype(np.float64) / scale.astype(np.float64)
    return np.clip(np.rint(ratio), _INT32_MIN, _INT32_MAX).astype(np.int32)


def _integer_tensor(name: str, codes: np.ndarray, dtype: int) -> onnx.TensorProto:
    """An initializer of ONNX integer type `dtype` (4-bit types packed two codes per byte)."""
    if dtype in _FOUR_BIT_TYPES:
        packed = codes.astype(helper.tensor_dtype_to_np_dtype(dtype))
        return helper.make_tensor(name, dtype, codes.shape, packed, raw=True)
    storage = np.int32 if dtype == TensorProto.INT32 else _INTEGER_TYPES[dtype][0]
    return numpy_helper.from_array(codes.astype(storage), name)


def _numpy_float(float_type: int) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(float_type)


def _float_array(values: np.ndarray, float_type: int) -> np.ndarray:
    """`values` in the float type of the tensor they apply to (float32 unless half precision)."""
    return np.asarray(values, dtype=np.float32).astype(_numpy_float(float_type))


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
