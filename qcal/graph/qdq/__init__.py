"""The InsertQDQ pass: write a QDQ model from a quantization plan and its ONNX parameters.

Layout, chosen so that onnxruntime's CPU provider fuses each quantized Conv/MatMul/Gemm/Add/
Concat with the Q/DQ nodes around it into one integer kernel (QLinearConv, QLinearMatMul or
MatMulIntegerToFloat, QGemm, QLinearAdd, QLinearConcat) and drops Q/DQ around data movement
(MaxPool, Flatten, Reshape, ...) when both sides carry the same parameters:

* activation ``t``: ``t -> [Clip] -> QuantizeLinear -> t_quantized -> DequantizeLinear ->
  t_dequantized``, one pair per tensor, read by the quantized consumers the plan lists. Other
  consumers and graph outputs keep reading the float ``t``, except where onnxruntime needs the
  QuantizeLinear to be the producer's only reader to run it in integers: then float readers,
  inside If/Loop/Scan bodies too, read ``t_dequantized``.
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

Where it lives: `_pass` (InsertQDQ itself: checks, order of the work, PassResult), built from
the parts `_activations` (which tensors get a pair and which reads go through it), `_fold`
(divisions folded into a DequantizeLinear scale) and `_weights` (weights and int32 biases), on
`_base` (what they share), `_emit` (the graph edits and names) and `_codes` (types, parameter
checks, integer initializers, QuantizedWeight).
"""

from __future__ import annotations

from qcal.graph.qdq._codes import QuantizedWeight, integer_tensor
from qcal.graph.qdq._pass import InsertQDQ, PassResult

__all__ = ["InsertQDQ", "PassResult", "QuantizedWeight", "integer_tensor"]
