"""Convolutions too narrow for onnxruntime's integer kernels to pay: placement "auto" keeps
them float (`qcal.graph.placement`). The figures below were measured with onnxruntime's CPU
provider, one Conv with its Q/DQ against the same Conv in float."""

from __future__ import annotations

import math

import onnx

from qcal.graph.structure import UseIndex, int_attribute

__all__ = ["NARROW_CONV", "slow_narrow_conv"]

# How each reason `slow_narrow_conv` gives begins (a coverage message groups them by it).
NARROW_CONV = ("placement auto: a convolution ", "placement auto: a grouped convolution ")


# Channels per group below which a grouped (not depthwise) Conv stays float: onnxruntime's
# integer kernel runs one matrix product per group, and products this narrow cost 2-11x its
# float kernel (one Conv with its Q/DQ, one thread: 1 input and 2 output channels per group
# 6-11x, 2 and 2 5.5x, 4 and 4 2.3-3.1x, 8 and 8 0.8-1.4x).
_MIN_CHANNELS_PER_GROUP = 8
# A 2-D or 3-D Conv of one group with fewer input channels than this and a kernel of at most
# _MAX_NARROW_TAPS taps per channel (an image's stem: 1 or 3 channels, 3x3 or 5x5; a small
# network's narrow layers) stays float: its integer kernel, with the QuantizeLinear of its input
# and the change to channels-last, costs more than onnxruntime's float kernel for it. A stem
# Conv (32 output channels) before three integer 3x3 Convs of 32, the whole with the stem float
# against quantized: 0.78-0.95x at 28-224 pixels with 1 or 3 input channels and 3x3 or 5x5
# kernels, 0.93-1.04x with 4 and 6 channels, 1.14-1.27x with 8 to 16 (the integer stem faster);
# a LeNet (1 and 6 input channels, 5x5, 28 x 28) 1.07x float with both float, 1.42x with the
# second quantized, 2.4x with both; a 3-D UNet's first Conv (1 input channel, 3x3x3) 156 us in
# float against 2391 us in integers. Larger kernels pay in integers: 4x4 patches level
# (1.00-1.02x), 7x7 0.92-1.14x, 8x8 1.14x, a ViT's 16x16 patches 1.52x (its model 0.52x float
# quantized, 0.88x with them float). Not a 1-D Conv, which runs in float as an unfolding and a
# matrix product: a waveform's stem (1 input channel, a kernel of 80, stride 4) ran its model
# 0.29x float quantized against 1.17x with it float.
_MIN_INPUT_CHANNELS = 8
_MAX_NARROW_TAPS = 27
# None of this holds for a Conv on a pooled vector (one output position): a squeeze-excitation's
# (PP-OCR's RSE-FPN: 4 input and 16 output channels, 64 multiply-adds) costs nothing either way,
# and kept float it left its HardSigmoid, its Mul and the FPN after it in float.


def slow_narrow_conv(node: onnx.NodeProto, index: UseIndex,
                     output_dims: tuple[int | None, ...] | None = None) -> str | None:
    """Why a Conv with few channels stays float under "auto", or None: a depthwise Conv (one
    input and one output channel per group) has an integer kernel of its own, slow on a single
    channel (one group, one input and one output channel); other grouped
    Convs with few channels per group (_MIN_CHANNELS_PER_GROUP), and 2-D and 3-D Convs of one
    group with few input channels and a small kernel (_MIN_INPUT_CHANNELS), do not pay; unless
    the dimensions its output states (`output_dims`) say it has one position."""
    if node.op_type != "Conv" or len(node.input) < 2:
        return None
    if output_dims is not None and len(output_dims) > 2 and set(output_dims[2:]) == {1}:
        return None
    group = int_attribute(node, "group", 1)
    weight = index.constant(node.input[1])
    if weight is None or len(weight.dims) < 3 or group < 1 or weight.dims[0] % group:
        return None
    inputs, outputs = weight.dims[1], weight.dims[0] // group
    if group == 1 and (inputs, outputs) == (1, 1):
        # onnxruntime's integer kernel takes it for a depthwise one, whose integer kernel
        # is 5x the float one on a single channel (1x256 and 5x5 taps alike; 2 output
        # channels are 0.6x): a pitch detector's 1-channel filters took 8 ms of its 19
        return ("placement auto: a convolution of one input and one output channel, which "
                "onnxruntime runs as a depthwise one: its integer kernel is slower than its "
                "float kernel")
    if group == 1:
        taps = math.prod(int(d) for d in weight.dims[2:])
        if (inputs >= _MIN_INPUT_CHANNELS or len(weight.dims) < 4
                or taps > _MAX_NARROW_TAPS):
            return None
        return (f"placement auto: a convolution with {inputs} input channel"
                f"{'s' if inputs > 1 else ''}, whose integer kernel (with the quantization of "
                "its input) is slower than its float kernel")
    if (inputs, outputs) == (1, 1) or min(inputs, outputs) >= _MIN_CHANNELS_PER_GROUP:
        return None
    return (f"placement auto: a grouped convolution with {inputs} input and {outputs} output "
            f"channels per group, which onnxruntime's integer kernel computes as {group} "
            "narrow matrix products: slower than its float kernel")
