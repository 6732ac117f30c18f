"""The per-operator rules: which inputs and outputs of each op type are quantized, which input
is a weight (and its channel axis), which a bias stored as int32, which ops onnxruntime fuses
with a following Relu/Clip, and which outputs take their input's parameters. Change these to
change what a node quantizes; `OP_RULES_DOC` says the principles."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx
import onnx.numpy_helper

from qcal.graph.structure import int_attribute, string_attribute


def _conv_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    return 0


def _conv_transpose_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    return 1


def _gemm_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    # B is (N, K) with transB=1, else (K, N): the output channel N is axis 0 or 1.
    return 0 if int_attribute(node, "transB", 0) else 1


def _matmul_weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    # B is (K, N): the output channel is the last axis; a vector B has no channel. A stack of
    # matrices (..., K, N) goes per tensor: onnxruntime's integer MatMul takes per-column
    # scales for a 2-D B only, and fails at run time on a stack quantized per column.
    return rank - 1 if rank == 2 else None


@dataclass(frozen=True)
class OpRule:
    """How one operator type is quantized.

    Attributes:
        summary: one line for the docs and the plan's reasons.
        inputs: input positions whose float tensors are quantized (None: every input).
            Activations get a Q/DQ pair; constant (initializer) inputs become weights,
            per tensor unless this is the `weight` position.
        outputs: output positions whose float tensors are quantized (None: every output).
        weight: input position of the weight that may be quantized per channel.
        weight_axis: the weight's channel axis from (node, weight rank); None: per tensor.
        bias: input position of a bias stored as int32 (scale = input scale x weight scale).
        fuses_activation: onnxruntime fuses a directly following Relu/Clip into this op, so
            the tensor between them is left float.
        divides_by_constant: the node divides input 0 by input 1 and is quantized only when
            input 1 is a positive constant scalar c; its output then takes input 0's parameters
            with the scale divided by c, and the division is folded into the output's
            DequantizeLinear (``DQ(q, s, z) / c = DQ(q, s / c, z)``): nothing left to run.
            With `by_reciprocal`, the node multiplies by input 1 (a division by 1 / c).
        integer_form: onnxruntime has no integer kernel for the op, but under placement "auto"
            the Q/DQ writer spells it, between its input's DequantizeLinear and its output's
            QuantizeLinear, in operators that onnxruntime runs on integers (an Add and a Mul;
            a Pad of the codes) (`QuantPlan.integer_forms`).
        conv_form: onnxruntime's integer kernel for the op is slow, and under placement "auto"
            the Q/DQ writer spells a node of it between its pair as a depthwise Conv that
            onnxruntime runs in its integer kernel (an AveragePool: `QuantPlan.integer_forms`);
            a node the form does not fit stays as written.
        refuses: why a node of the op type stays float whatever the selection (a form its
            quantization would change), from the node and the constant a value holds; None
            when the rule applies.
    """

    summary: str
    inputs: tuple[int, ...] | None = (0,)
    outputs: tuple[int, ...] | None = (0,)
    weight: int | None = None
    weight_axis: Callable[[onnx.NodeProto, int], int | None] | None = field(
        default=None, compare=False
    )
    bias: int | None = None
    fuses_activation: bool = False
    divides_by_constant: bool = False
    by_reciprocal: bool = False
    integer_form: bool = False
    conv_form: bool = False
    refuses: Callable[[onnx.NodeProto, Callable[[str], onnx.TensorProto | None]], str | None] | \
        None = field(default=None, compare=False)


def _pad_refuses(
    node: onnx.NodeProto, constant: Callable[[str], onnx.TensorProto | None]
) -> str | None:
    """A Pad copies its input's values and, in constant mode, adds its constant: a quantized
    Pad is exact when that constant is 0 (the zero point's code), the default."""
    if string_attribute(node, "mode", "constant") != "constant":
        return None
    value = node.input[2] if len(node.input) > 2 else ""
    if not value:
        return None
    tensor = constant(value)
    if tensor is not None and not onnx.numpy_helper.to_array(tensor).any():
        return None
    return "a Pad by a constant other than 0 (or not a constant) stays float"


# A Mul whose B is a positive constant scalar c: a division by 1 / c, folded as a Div is
# (keras's hard-swish x * (relu6(x + 3) * (1 / 6)), a Rescaling layer, GELU's 0.5).
MUL_BY_CONSTANT = OpRule(
    "input A and the output, B a positive constant scalar c: the output takes A's parameters "
    "with the scale multiplied by c, which removes the multiplication",
    divides_by_constant=True,
    by_reciprocal=True,
)


def _data_rule(what: str) -> OpRule:
    return OpRule(summary=f"{what} and the output")


OP_RULES: Mapping[str, OpRule] = {
    "Conv": OpRule(
        "input X, weight W (per channel: axis 0) and output Y; bias B as int32",
        inputs=(0, 1),
        weight=1,
        weight_axis=_conv_weight_axis,
        bias=2,
        fuses_activation=True,
    ),
    "ConvTranspose": OpRule(
        "input X, weight W (per channel: axis 1) and output Y; bias stays float",
        inputs=(0, 1),
        weight=1,
        weight_axis=_conv_transpose_weight_axis,
    ),
    "Gemm": OpRule(
        "input A, weight B (per channel: axis 0 if transB=1, else 1) and output Y; "
        "1-D bias C as int32 when alpha = beta = 1",
        inputs=(0, 1),
        weight=1,
        weight_axis=_gemm_weight_axis,
        bias=2,
        fuses_activation=True,
    ),
    "MatMul": OpRule(
        "inputs A and B and output Y; a constant 2-D B per channel on its last axis (a stack "
        "of matrices per tensor), a constant A per tensor; two activations (attention) are "
        "both quantized under `--placement all` or `--op-types` (placement auto keeps such a "
        "product float); the constant of an Add reading its output alone as an int32 bias",
        inputs=(0, 1),
        weight=1,
        weight_axis=_matmul_weight_axis,
        fuses_activation=True,
    ),
    "Add": OpRule(
        "both inputs (constants per tensor, in the activation type) and the output",
        inputs=(0, 1),
        fuses_activation=True,
    ),
    "Mul": OpRule(
        "both inputs (constants per tensor, in the activation type) and the output; by a "
        "positive constant scalar c (as B): A and the output, which takes A's parameters with "
        "the scale multiplied by c, which removes the multiplication",
        inputs=(0, 1),
        fuses_activation=True,
    ),
    "Div": OpRule(
        "input A and the output, only when B is a positive constant scalar c: the output takes "
        "A's parameters with the scale divided by c, which removes the division",
        divides_by_constant=True,
    ),
    "Concat": OpRule("every input and the output", inputs=None),
    "MaxPool": _data_rule("input X (never the Indices output)"),
    "AveragePool": OpRule(
        "input X and the output; under placement auto written as a depthwise Conv of weight "
        "1 / (kernel size), times a constant map of kernel size / taps inside where it does not "
        "count its padding", conv_form=True),
    "GlobalAveragePool": _data_rule("input X"),
    "GlobalMaxPool": _data_rule("input X"),
    "Relu": _data_rule("input X"),
    "LeakyRelu": _data_rule("input X"),
    "Sigmoid": _data_rule("input X"),
    "HardSigmoid": OpRule(
        "input X and the output; under placement auto written as an integer Add whose output "
        "quantization clips to [0, 1]", integer_form=True),
    "HardSwish": OpRule(
        "input X and the output; under placement auto written as an integer Add (x + 3, "
        "clipped to [0, 6] by its quantization) and an integer Mul by x, the / 6 in the "
        "output's scale", integer_form=True),
    "PRelu": OpRule(
        "input X and the output (never the slope); under placement auto written as integer "
        "Clips of X's codes at its zero point (its positive and negative parts), the negative "
        "part times the slopes as an integer depthwise 1 x 1 Conv (each slope exact) onto the "
        "output's grid, and an integer Add", integer_form=True),
    "Softmax": _data_rule("input X"),
    "Clip": _data_rule("input X (never min/max)"),
    "Resize": _data_rule("input X (never roi/scales/sizes)"),
    "Reshape": _data_rule("input data (never the shape)"),
    "Transpose": _data_rule("input X"),
    "Flatten": _data_rule("input X"),
    "Squeeze": _data_rule("input data (never axes)"),
    "Unsqueeze": _data_rule("input data (never axes)"),
    "Slice": _data_rule("input data (never starts/ends/axes/steps)"),
    "Gather": _data_rule("input data (never indices)"),
    "DepthToSpace": _data_rule("input X"),
    "SpaceToDepth": _data_rule("input X"),
    "Split": OpRule("input (never split sizes) and every output", outputs=None),
    "Pad": OpRule(
        "input data and the output (never pads or axes), unless it pads with a constant other "
        "than 0; under placement auto written as a Pad of the input's codes by its zero point",
        integer_form=True, refuses=_pad_refuses),
}
OP_RULES_DOC = """Per-operator quantization rules (ai.onnx domain), keyed by op type.

Only tensors with a float element type (float32, float16, bfloat16; observed in float32) are
quantized: shapes, indices and masks never are. A node whose op type has no rule stays float.
A tensor read by a quantized node at a quantized input position is quantized for that node
(whoever produced it, graph inputs included); a quantized node's quantized outputs are
quantized even when nothing quantized reads them. For onnxruntime's CPU provider, the tensor
between a Conv, Gemm, MatMul, Add or Mul and a Relu or Clip (constant bounds) that is its only
reader is left float: onnxruntime folds the activation into the QuantizeLinear that follows
it, and the Relu/Clip output is quantized instead. The outputs of Reshape, Transpose, Flatten,
Squeeze, Unsqueeze, Gather, Split, Slice, DepthToSpace, SpaceToDepth, MaxPool, GlobalMaxPool,
Resize (not cubic) and Pad (by 0, the zero point's code) take the parameters of their input and
are not observed: their values lie in its range, and onnxruntime then runs them on the integers (float readers of such an output
read its DequantizeLinear, which holds the same values). The output of a Div by a positive
constant scalar c takes its input's parameters with the scale divided by c: the
DequantizeLinear of the input's codes with that scale is the quotient, and the Div is removed
(as in the x * relu6(x + 3) / 6 of hard-swish); a Mul by a positive constant scalar c likewise,
with the scale multiplied by c (Keras writes x * (relu6(x + 3) * (1 / 6))). Constants at quantized inputs are
stored pre-quantized: at a weight input with the weight scheme, elsewhere (Add, Mul, Concat,
a constant MatMul A) per tensor with the activation scheme, whose type the integer kernels need.
"""
"""The principles behind `OP_RULES`, for the README and `qcal inspect`."""



def rules_table() -> str:
    """`OP_RULES` as a Markdown table (for the README and `qcal inspect`); see `OP_RULES_DOC`."""
    lines = ["| op type | quantized |", "| --- | --- |"]
    lines += [f"| {op} | {rule.summary} |" for op, rule in OP_RULES.items()]
    return "\n".join(lines)


# Operators whose outputs hold only values of their first input (moved, selected, or the max of
# some), or, for Resize, values between them: an output quantized with the input's parameters
# loses nothing the input did not, and onnxruntime then drops the DequantizeLinear/QuantizeLinear
# pair around the node and runs it on the integers.
SAME_SCALE_OPS = frozenset(
    {
        "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Gather", "Split", "Slice",
        "DepthToSpace", "SpaceToDepth", "MaxPool", "GlobalMaxPool", "Resize",
        "Pad",  # its input's values and 0, which every grid holds exactly (the zero point)
    }
)
