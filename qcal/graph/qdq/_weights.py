"""Weights and biases stored as integers: a weight's codes (given) as an initializer read
through a DequantizeLinear, and a Conv/Gemm bias as int32 codes with scale = input scale x weight
scale, the bias onnxruntime's integer kernels add in their accumulator."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from qcal.graph.files.large import tensor_array
from qcal.graph.qdq._base import _Writer
from qcal.graph.qdq._codes import (
    _check_axis_length,
    _checked_codes,
    _numpy_float,
    _quantize_bias_codes,
)
from qcal.numerics.errors import ModelError

if TYPE_CHECKING:
    from qcal.graph.plan import BiasTarget, WeightTarget
    from qcal.graph.qdq._emit import _Scopes
    from qcal.numerics.onnx_mapping import OnnxQParams

logger = logging.getLogger(__name__)


class _WeightWriter(_Writer):
    """The weight and bias part of `InsertQDQ`."""

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
        shift = self._weight_codes[bias.weight_tensor].bias_shift
        if shift is not None and shift.size != values.size:
            shift = None  # bias correction shifts a bias of [N] or [1, N] only
        if shift is not None:
            values = (values.astype(np.float64) - shift.reshape(values.shape)).astype(np.float32)
        if bias.as_float:
            if shift is not None:
                uses = self._uses_by(rewrite, bias.tensor, bias.node, "bias")
                rewrite.redirect(uses, rewrite.add_constant(
                    f"{bias.tensor}_corrected", values.astype(_numpy_float(float_type))))
                scopes.drop_if_unused(bias.tensor)
            return
        if not np.all(np.isfinite(values)):  # the model's own fault: no int32 code holds it
            raise ModelError(f"bias {bias.tensor!r} of node {bias.node!r} holds NaN or "
                             "infinite values: the model computes them there")
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
        if (bias.input_tensor, bias.computed_by) in self._quantized_reads:
            return self._activation_qparams[bias.input_tensor]
        return None

    def _quantized_weight(self, bias: BiasTarget) -> OnnxQParams | None:
        """The parameters of the bias node's weight, if the plan quantizes it for that node."""
        if (bias.weight_tensor, bias.computed_by) in self._quantized_weights:
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


def _group_by_tensor(
    targets: Sequence[WeightTarget],
) -> Iterator[tuple[str, list[WeightTarget]]]:
    grouped: dict[str, list[WeightTarget]] = defaultdict(list)
    for target in targets:
        grouped[target.tensor].append(target)
    for tensor in sorted(grouped):
        yield tensor, grouped[tensor]
