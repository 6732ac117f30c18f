"""Where placement "auto" keeps a MaxPool float, and where onnxruntime would run it on uint8.

onnxruntime's uint8 MaxPool outside an integer chain is a plain channels-first loop, 10-50x its
float kernel; its QDQ propagation moves a QuantizeLinear up through a MaxPool whose output only
it reads, so a pool can end on uint8 that the plan left float. These rules decide, from the
graph, which pools get a pair of their own and which narrow Convs are quantized so that the
pool after them runs channels-last in integers (`qcal.graph.placement`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx

from qcal.graph.integer_kernels import FUSED_ACTIVATIONS
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, int_attribute, ints_attribute

__all__ = ["GUARDED_POOL", "guarded_pools", "passes_quantized", "pools_codes",
           "pools_into_quantized"]


GUARDED_POOL = (
    "placement auto: onnxruntime's uint8 MaxPool is a plain channels-first loop, 10-50x its "
    "float kernel; its input is quantized too, with parameters of its own, so that onnxruntime "
    "does not move the QuantizeLinear of its output up through it and run it on uint8")


def guarded_pools(
    nodes: list[onnx.NodeProto],
    index: UseIndex,
    quantized_inputs: Callable[[onnx.NodeProto], list[str]],
    quantized: set[str],
    float_outputs: Mapping[str, str],
) -> dict[str, str]:
    """Float MaxPool -> its input to quantize, where onnxruntime would otherwise run it on uint8.

    onnxruntime's QDQ propagation moves a QuantizeLinear up through a MaxPool whose output only
    it reads, when what the MaxPool reads comes from no DequantizeLinear and
    has no other reader; the pool then runs on the codes. Between a float op and an integer
    Conv (an audio-quality model's stem Conv and swish, float, then a MaxPool of 32 x 400 x 160:
    5.7 ms on uint8 against 0.2 ms in float) that made the model 1.6-1.7x float; with a Quantize
    and Dequantize of its own before the pool, 0.81x. Where the writer of its input is
    quantized, that input is dequantized already, with other parameters (`pools_into_quantized`
    quantizes a narrow Conv there: both then run channels-last in integers)."""
    guarded = {}
    for node in nodes:
        if (node.op_type != "MaxPool" or node.name in quantized or not node.input
                or len([o for o in node.output if o]) != 1):
            continue
        value, pooled = node.input[0], node.output[0]
        writer = index.producer.get(value)
        readers = index.readers(pooled)
        if (value in index.graph_outputs or pooled in index.graph_outputs
                or len(index.readers(value)) != 1 or not readers
                or not all(r.name in quantized and pooled in quantized_inputs(r)
                           for r in readers)
                or writer is not None and writer.name in quantized
                and value not in float_outputs):
            continue
        guarded[node.name] = value
    return guarded


def pools_into_quantized(
    node: onnx.NodeProto,
    index: UseIndex,
    quantized_inputs: Callable[[onnx.NodeProto], list[str]],
    quantized: set[str],
) -> bool:
    """Whether narrow Conv `node` (one group) writes, one reader at a time through a Relu/Clip,
    into a MaxPool whose output only quantized nodes read, and read quantized.

    onnxruntime then moves the QuantizeLinear of the MaxPool's output up through it (its QDQ
    propagation) and runs the MaxPool on uint8 in channels-first layout, a plain loop 20-30x
    its float kernel (64 channels of 111 x 111 pixels, 3x3, stride 2: 3.5 ms against 0.12 ms).
    With the Conv quantized too, both run channels-last in integers: SqueezeNet 1.1 (3-channel
    3x3 stem, then a MaxPool) ran 1.23x float with the stem float and 0.61x with it quantized,
    ShuffleNetV2 the same way. Not a 3-D Conv, whose narrow integer kernel costs more than that
    loop (a video network's 3x3x3 stem 5.8 ms against 1.5 ms in float, its MaxPool 1.3 ms
    against 0.2: the model 2.4x float with the stem quantized, 0.84x with it float)."""
    weight = index.constant(node.input[1])  # a narrow Conv's, constant (`slow_narrow_conv`)
    if int_attribute(node, "group", 1) != 1 or not node.output or weight is None or \
            len(weight.dims) > 4:
        return False
    value = node.output[0]
    while value and value not in index.graph_outputs:
        readers = index.readers(value)
        if len(readers) != 1 or len([o for o in readers[0].output if o]) != 1:
            return False
        reader = readers[0]
        if reader.op_type == "MaxPool" and reader.domain in DEFAULT_DOMAINS:
            pooled = reader.output[0]
            readers = index.readers(pooled)
            return (pooled not in index.graph_outputs and bool(readers) and all(
                r.name in quantized and pooled in quantized_inputs(r) for r in readers))
        if reader.op_type not in FUSED_ACTIVATIONS:
            return False
        value = reader.output[0]
    return False


def passes_quantized(node: onnx.NodeProto, read_by_anchors: set[str]) -> bool:
    """Whether `node` is a float MaxPool whose output an anchor reads quantized: onnxruntime
    moves that QuantizeLinear up through it, so what writes its input serves the anchor."""
    return (node.op_type == "MaxPool" and node.domain in DEFAULT_DOMAINS
            and bool(node.output) and node.output[0] in read_by_anchors)


def pools_codes(node: onnx.NodeProto, index: UseIndex, written: set[str],
                anchors: set[str]) -> bool:
    """Whether `node` is a 2-D MaxPool (one output) of a tensor that a quantized node in
    `written` writes, whose output no anchor reads: a serving node then, quantized with its
    input's parameters where it lies between quantized nodes. onnxruntime drops the pair
    around it and runs it on the codes, channels-last between integer layers (its
    NhwcMaxPool, as fast as the float pool there: 32 channels of 128 x 128 between integer 1x1
    Convs, 0.21 ms both ways, at opsets 13 and 22). A MediaPipe downsampling block's MaxPool ->
    Pad -> Add -> PRelu stayed float and split the integer chain in two. (A pool an anchor
    reads stays float: onnxruntime moves the anchor's QuantizeLinear up through it anyway.)"""
    if (node.op_type != "MaxPool" or node.domain not in DEFAULT_DOMAINS or not node.input
            or len([o for o in node.output if o]) != 1
            or len(ints_attribute(node, "kernel_shape")) != 2):
        return False
    producer = index.producer.get(node.input[0])
    return (producer is not None and producer.name in written
            and not any(r.name in anchors for r in index.readers(node.output[0])))
