"""Which activations get a Q/DQ pair, and who reads it: the planned quantized consumers, and
the float readers that must read the DequantizeLinear too for onnxruntime to run the producer
in integers. One pair per tensor, in the graph that defines it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import onnx

from qcal.graph.integer_kernels import ANCHOR_OPS, FUSED_ACTIVATIONS
from qcal.graph.qdq._base import _Writer
from qcal.graph.qdq._codes import _same_qparams
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    SHAPE_READERS,
    SUBGRAPH_SLOT,
    Use,
    string_attribute,
)

if TYPE_CHECKING:
    from qcal.graph.plan import ActivationTarget
    from qcal.graph.qdq._emit import _Rewrite, _Scopes

logger = logging.getLogger(__name__)

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
    "HardSigmoid": (0,),  # as the integer Add the writer spells it with (`_integer_forms`)
    "HardSwish": (0,),  # as integer Add and Mul, likewise
    "PRelu": (0,),  # as integer Clips, a depthwise Conv and an Add (`_prelu_form`)
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
        "Pad",  # not dropped by onnxruntime: written as a Pad of the codes (`_integer_forms`)
    }
)


class _ActivationWriter(_Writer):
    """The activation part of `InsertQDQ`: a QuantizeLinear/DequantizeLinear pair per planned
    activation, read by its quantized consumers (and the float readers that must)."""

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
        bodies = [r for r in scopes.rewrites if r is not owner]
        uses += self._float_reads_of_integer_output(owner, tensor, uses, bodies)
        if owner is scopes.main and self._integer_kernel_writes_output(owner, tensor):
            # the DequantizeLinear writes `tensor`: every reader reads it as it is
            self._insert_pair(owner, tensor, uses, output=True)
            return
        if all(_reads_shape_only(use) for use in uses):
            # Nothing would read the pair: a dangling Q/DQ only costs time and blocks fusion.
            logger.debug("activation %r has no quantized consumer; left in float", tensor)
            return
        self._insert_pair(owner, tensor, uses)

    def _float_reads_of_integer_output(
        self, rewrite: _Rewrite, tensor: str, quantized: Sequence[Use],
        bodies: Sequence[_Rewrite] = (),
    ) -> list[Use]:
        """The float reads of `tensor` that must go through its pair for onnxruntime to compute
        the producer in integers.

        onnxruntime fuses DequantizeLinear -> Conv (Add, Mul, ...) -> QuantizeLinear into one
        integer kernel only when the QuantizeLinear is the producer's only reader. So when every
        input of the producer is quantized, float readers (a HardSigmoid, a Div) read the
        DequantizeLinear too, as onnxruntime's own quantizer arranges it. Not for graph outputs
        or tensors a body returns as they are: those keep the float value (a body's nodes read
        the DequantizeLinear from the outer scope, `bodies`). Likewise for the output of
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
        if self._integer_data_op(producer, tensor) or (
                quantized and self._moves_kernel_codes(rewrite, producer, tensor)):
            return self._other_float_reads(rewrite, tensor, quantized, bodies)
        fused = self._fused_into(rewrite, producer)
        if fused is not None:
            if not quantized and self._quantized_after_data_movement(rewrite, tensor):
                # onnxruntime moves the QuantizeLinear after a MaxPool (Reshape, ...) up to the
                # Relu/Clip by itself, and a pair here would block that.
                return []
            producer = fused  # the Relu/Clip's output is its anchor's integer output
        if not self._integer_kernel(producer):
            return []
        return self._other_float_reads(rewrite, tensor, quantized, bodies)

    def _integer_kernel(self, node: onnx.NodeProto) -> bool:
        """Whether `node` reads quantized every input its integer kernel takes (and a Conv or
        Gemm its bias): onnxruntime then runs it as that kernel."""
        if node.op_type not in _INTEGER_KERNEL_INPUTS:
            return False
        slots = _INTEGER_KERNEL_INPUTS[node.op_type]
        for slot, value in enumerate(self._planned_inputs.get(node.name, node.input)):
            read = (value, node.name)
            if not value:
                continue
            if slots is None or slot in slots:
                if read not in self._quantized_reads and read not in self._quantized_weights:
                    return False
            elif slot == 2 and node.op_type in ("Conv", "Gemm") and \
                    read not in self._quantized_biases:
                return False  # a float bias keeps the node float
        return True

    def _moves_kernel_codes(self, rewrite: _Rewrite, producer: onnx.NodeProto,
                            tensor: str) -> bool:
        """Whether `producer` is a data-movement operator left float (a MaxPool) that alone
        reads an integer kernel's output (through its fused Relu/Clip): onnxruntime moves the
        QuantizeLinear of `tensor` up through it to that kernel, and runs both on the codes,
        only when that QuantizeLinear is its only reader. So float readers (a UNet's skip
        Concat beside the next Conv) read the DequantizeLinear; reading the float pool, they
        left the Conv before it in float on dequantized weights."""
        if (producer.op_type not in _INTEGER_DATA_OPS or producer.op_type == "Pad"
                or not producer.input or tensor != producer.output[0]):
            return False
        source = producer.input[0]
        writer = rewrite.index.producer.get(source)
        if (writer is None or writer.domain not in DEFAULT_DOMAINS
                or source in rewrite.index.graph_outputs
                or len(rewrite.index.uses.get(source, ())) != 1):
            return False
        return self._integer_kernel(self._fused_into(rewrite, writer) or writer)

    def _fused_into(self, rewrite: _Rewrite, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """The anchor a Relu/Clip `node` is fused into, if any: its input is left float
        (onnxruntime removes the Relu/Clip before a QuantizeLinear whose range clips the same
        way, then runs the anchor as one integer kernel) and read by `node` alone. The fusion
        needs the QuantizeLinear to be the Relu/Clip's only reader, as for any integer kernel,
        so float readers of its output must read the DequantizeLinear too: otherwise the anchor
        runs in float on dequantized weights (a float Conv in the middle of integer ones). A
        MatMul's int32 bias Add between them is fused into it first (a Gemm)."""
        if node.op_type not in FUSED_ACTIVATIONS or not node.input or not node.input[0]:
            return None
        source, reader = node.input[0], node
        anchor = rewrite.index.producer.get(source)
        if anchor is not None and anchor.name in self._bias_adds and \
                self._read_alone_float(rewrite, source, reader):
            source, reader = next(v for v in anchor.input if (p := rewrite.index.producer.get(v))
                                  and p.name == self._bias_adds[anchor.name]), anchor
            anchor = rewrite.index.producer.get(source)
        if (
            anchor is None
            or anchor.domain not in DEFAULT_DOMAINS
            or anchor.op_type not in ANCHOR_OPS
            or not self._read_alone_float(rewrite, source, reader)
        ):
            return None
        return anchor

    def _read_alone_float(self, rewrite: _Rewrite, value: str, reader: onnx.NodeProto) -> bool:
        """Whether `reader` alone reads `value`, in float, and the graph does not return it."""
        return ((value, reader.name) not in self._quantized_reads
                and value not in rewrite.index.graph_outputs
                and len(rewrite.index.uses.get(value, ())) == 1)

    def _quantized_after_data_movement(self, rewrite: _Rewrite, tensor: str) -> bool:
        """Whether every reader of `tensor` only moves values (`_INTEGER_DATA_OPS`) into an
        output that is quantized itself."""
        readers = [use.node for use in rewrite.index.uses.get(tensor, ())]
        return bool(readers) and all(
            node.op_type in _INTEGER_DATA_OPS and node.domain in DEFAULT_DOMAINS
            and bool(node.output) and node.output[0] in self._activation_qparams
            for node in readers
        )

    @staticmethod
    def _other_float_reads(
        rewrite: _Rewrite, tensor: str, quantized: Sequence[Use], bodies: Sequence[_Rewrite],
    ) -> list[Use]:
        """The reads of `tensor` not in `quantized`, those of the nodes inside `bodies` (If,
        Loop and Scan bodies nested in `rewrite`'s graph) included; none when a body returns it
        as it is (a graph output is a name, not a read to redirect)."""
        taken = {(id(use.node), use.slot) for use in quantized}
        reads = [*rewrite.index.uses.get(tensor, ()),
                 *(u for body in bodies for u in body.index.uses.get(tensor, ()))]
        if any(tensor in body.index.graph_outputs for body in bodies):
            return []
        return [u for u in reads if u.slot != SUBGRAPH_SLOT and (id(u.node), u.slot) not in taken]

    def _integer_data_op(self, producer: onnx.NodeProto, tensor: str) -> bool:
        """Whether `producer` moves the values of an input it reads quantized with the
        parameters of its output `tensor`, so that onnxruntime runs it on the integers."""
        if producer.op_type not in _INTEGER_DATA_OPS or tensor != producer.output[0]:
            return False
        if producer.op_type == "Resize" and string_attribute(producer, "mode", "") not in (
            "", "nearest"  # the default
        ):
            return False
        planned = self._planned_inputs.get(producer.name, tuple(producer.input))
        source = planned[0] if planned else ""
        if (source, producer.name) not in self._quantized_reads:
            return False
        return _same_qparams(self._activation_qparams[source], self._activation_qparams[tensor])

    def _integer_kernel_writes_output(self, rewrite: _Rewrite, tensor: str) -> bool:
        """Whether `tensor` is a graph output (listed once) that an integer kernel writes,
        through its fused Relu/Clip or not, and that onnxruntime would otherwise compute in
        float on dequantized weights, then kept float by the check against its graph:

        - a Conv's, read by no node: onnxruntime runs a Conv in integers only before a
          QuantizeLinear (a style-transfer network's last Conv, 9x9 at full resolution, a
          third of its work, failed the coverage floor);
        - any integer kernel's read by nodes too: onnxruntime fuses the QuantizeLinear into
          the kernel only when it is the value's only reader and the value no graph output
          (a classifier returning its features beside the logits the head computes from them
          ran its feature layer in float: 16 % of the MACs quantized).

        The output is then written by a DequantizeLinear, on the grid its calibrated range
        gives, and the other readers read it there."""
        producer = rewrite.index.producer.get(tensor)
        listed = [v.name for v in rewrite.graph.output].count(tensor)
        qparams = self._activation_qparams[tensor]
        if (producer is None or producer.domain not in DEFAULT_DOMAINS or listed != 1
                or qparams.clip_min is not None or qparams.clip_max is not None):
            return False
        anchor = self._fused_into(rewrite, producer) or producer
        if not self._integer_kernel(anchor):
            return False
        return anchor.op_type == "Conv" or bool(rewrite.index.uses.get(tensor))

    def _insert_pair(self, rewrite: _Rewrite, tensor: str, uses: Sequence[Use], *,
                     output: bool = False) -> None:
        """A pair on `tensor` that `uses` read; with `output`, its DequantizeLinear writes
        `tensor` itself, a graph output, from its writer's value renamed."""
        qparams = self._activation_qparams[tensor]
        float_type = self._float_type(rewrite, tensor, "activation")
        if output:  # `_integer_kernel_writes_output`: no clip bounds
            source = rewrite.rename_output(tensor)
        elif qparams.clip_min is not None or qparams.clip_max is not None:
            source = rewrite.add_clip(tensor, qparams, float_type)
        else:
            source = tensor
        scale, zero_point = rewrite.add_qparams(tensor, qparams, float_type)
        quantized = rewrite.add_node(
            "QuantizeLinear", tensor, [source, scale, zero_point], qparams.axis, after=tensor
        )
        dequantized = rewrite.add_node(
            "DequantizeLinear", tensor, [quantized, scale, zero_point], qparams.axis, after=tensor,
            output=tensor if output else None,
        )
        self._read_pair(rewrite, uses, quantized, dequantized)
        self._pairs[tensor] = (quantized, dequantized)

    @staticmethod
    def _read_pair(rewrite: _Rewrite, uses: Sequence[Use], codes: str, dequantized: str) -> None:
        """Make `uses` read a pair: a Shape or Size node its codes, which have the same shape
        (a DequantizeLinear only for it would compute a whole tensor to give its shape), every
        other reader its DequantizeLinear."""
        shape_only = [u for u in uses if _reads_shape_only(u)]
        rewrite.redirect(shape_only, codes)
        rewrite.redirect([u for u in uses if not _reads_shape_only(u)], dequantized)


def _reads_shape_only(use: Use) -> bool:
    return (use.slot == 0 and use.node.op_type in SHAPE_READERS
            and use.node.domain in DEFAULT_DOMAINS)
