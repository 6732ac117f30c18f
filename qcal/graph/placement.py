"""Where Q/DQ goes: on the values an operator computes with, where integer kernels pay.

The planner (`qcal.graph.plan`) asks this of every graph, before any data is seen; which inputs
are parameters, never quantized, is `qcal.graph.parameters`.

**Placement "auto" (the default).** Q/DQ pays where onnxruntime runs the operator on integers
after QDQ fusion: Conv, ConvTranspose, MatMul and Gemm (the *anchors*). Elsewhere a Q/DQ pair is
work added to a float operator, and error added where it may be amplified (normalizations,
softmax, GELU, recurrent state). So under "auto":

* anchors are quantized; a Relu/Clip that onnxruntime fuses into an anchor goes with it.
  Depthwise convolutions are anchors too: on small feature maps onnxruntime's integer kernel
  for them is slower than its float one (PP-OCR cls: 1.13 ms against 0.24 ms for ten of them),
  but keeping them float costs more elsewhere (layout changes between the integer and float
  convolutions, a Quantize and a Dequantize each): PP-OCRv4 det ran 0.59x float with them
  quantized and 0.88x without, rec 0.59x and 0.77x; only cls gained (1.35x -> 1.22x);
* a MatMul or Gemm of two activations (attention scores and context) is not an anchor:
  onnxruntime would quantize both operands at every run and multiply uint8 by uint8, slower
  than its float kernel on x86 (PRODUCT_OF_ACTIVATIONS);
* a MatMul or Gemm of fewer than 2^18 multiply-adds per run at the calibration data's shapes
  (`--min-product-macs`) is not an anchor: its integer kernel writes float, so its input is
  quantized at every run, which with the kernel's fixed cost outweighs what it saves (with
  that QuantizeLinear, at one thread: 1.07-1.21x the float kernel below 2^16, 0.99-1.07x at
  2^18, 0.75-0.96x at 2^20; LSTM/GRU models whose only products are their projections ran
  1.24-1.32x float, 0.98-1.00x without them, a JAX MLP-Mixer 1.26x, 1.00x). Not Conv: its
  integer kernel reads and writes codes, so between integer neighbours it has no such cost;
* a grouped Conv that is not depthwise, with few channels per group, is not an anchor:
  onnxruntime's integer kernel computes one narrow matrix product per group, several times its
  float kernel (`qcal.graph.narrow_convs`); nor is a Conv of one input and one output channel,
  which onnxruntime runs as a slow depthwise one; nor is a 2-D or 3-D Conv of one group with few
  input channels and a small kernel (an image's stem), whose integer kernel with the
  QuantizeLinear of its input costs more than its float one. Unless it has one output position
  (a squeeze-excitation's on a pooled vector), or its input is dequantized
  and its output runs straight into a quantized node: onnxruntime then quantizes its weight
  itself (per tensor) and runs that kernel anyway; or a narrow Conv of one group writes
  (through a Relu/Clip) into a MaxPool whose output is quantized: onnxruntime would run that
  MaxPool on uint8 in its slow channels-first loop (`pools_into_quantized`);
* a cheap operator that onnxruntime runs on integers (data movement, average pooling, Concat,
  Add, Mul, Relu, LeakyRelu, Sigmoid, a Div by a constant, and HardSwish, HardSigmoid, PRelu
  and Pad, which the Q/DQ writer spells in integer operators) is quantized only when it sits
  *between* anchors: every float input
  it computes with comes from a quantized anchor or such an operator, or is an anchor's input
  (quantized anyway: a residual Add beside the Conv that reads a MaxPool's output), and its
  output reaches an anchor through such operators (or through a float MaxPool whose output an
  anchor reads: onnxruntime moves that QuantizeLinear up through it). Then it saves a
  Dequantize/Quantize pair instead of adding one. So is a MaxPool of the codes an integer
  node writes that no anchor reads (`pools_codes`);
* a MaxPool stays float; where it reads a float tensor and only quantized nodes read its
  output, its input is quantized too, with parameters of its own (`guarded_pools`): else
  onnxruntime moves its output's QuantizeLinear up through it and runs it on uint8, in a loop
  10-50x its float kernel;
* an Add that only adds a constant row to an anchor MatMul's output is that MatMul's bias
  (`added_bias_of`), never a serving node: quantized, it would cost an integer Add and a
  requantization, and hold the bias in 8 bits;
* an anchor's output is quantized only when a quantized node reads it, or for Conv and
  ConvTranspose, whose integer kernel (QLinearConv) writes integers, or for a Gemm or MatMul
  with a fused Relu/Clip (_QUANTIZED_WITH_ACTIVATION; a MatMul's read through the Add of its
  bias on a 2-D input, fused with it into a Gemm first). MatMul and Gemm have integer kernels
  with a float output, so attention logits and final logits stay float;
* a node that computes from constants alone stays float: onnxruntime computes it once, when
  it loads the model, where Q/DQ around it would have it computed at every run;
* every other node stays float.

Placement "all" quantizes every node that has a rule (full emulation of an integer target, as
accelerator toolchains do); so does an explicit ``--op-types`` list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx
import onnx.defs

from qcal.graph.integer_kernels import (
    ANCHOR_OPS,
    FUSED_ACTIVATIONS,
    INTEGER_OUTPUT_ANCHORS,
    QUANTIZE_SEES_THROUGH,
    added_bias_of,
    through_gemm_bias,
)
from qcal.graph.max_pools import (
    GUARDED_POOL,
    guarded_pools,
    passes_quantized,
    pools_codes,
    pools_into_quantized,
)
from qcal.graph.narrow_convs import slow_narrow_conv
from qcal.graph.shapes import value_dims
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    UseIndex,
    computed_from_constants,
)

__all__ = ["PLACEMENTS", "PRODUCT_OF_ACTIVATIONS", "SMALL_PRODUCT", "SMALL_PRODUCT_MACS",
           "Placement", "place"]

PLACEMENTS = ("auto", "all")
SMALL_PRODUCT_MACS = 1 << 18  # the default --min-product-macs (module docstring)
# How the reason of such a product begins (the coverage figure counts them).
SMALL_PRODUCT = "placement auto: too small for an integer kernel to pay"
# Cheap operators onnxruntime runs on integers when their inputs and output are quantized.
# Not MaxPool: onnxruntime's uint8 MaxPool is a plain loop, about 10x its float (NCHWc) kernel
# (PP-OCR cls: 0.34 ms against 0.03 ms), far more than the Dequantize/Quantize pair it saves.
_SERVING_OPS = frozenset({
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Gather", "Split", "Slice",
    "DepthToSpace", "SpaceToDepth", "GlobalMaxPool", "Resize",
    "AveragePool", "GlobalAveragePool", "Concat", "Add", "Mul", "Div", "Relu", "Clip",
    "LeakyRelu", "Sigmoid",  # bounded slopes: they shrink an input error, never amplify it
    # no integer kernel of their own: the Q/DQ writer spells them as integer Add and Mul
    # (`OpRule.integer_form`); float between integer Convs they also break the channels-last
    # layout onnxruntime gives integer chains (MobileNetV3-like models: 5-17 % of their time)
    "HardSwish", "HardSigmoid",
    # onnxruntime's float kernel is slow (half a MediaPipe palm detector's time); written as
    # integer Clips, Mul and Add (`OpRule.integer_form`)
    "PRelu",
    # no integer kernel when a Q/DQ pair surrounds it; the writer pads the codes themselves
    # (a MediaPipe face detector pads channels before 11 residual Adds: float, they and their
    # Adds split every block into islands)
    "Pad",
})


@dataclass
class Placement:
    """What placement keeps float in one graph, each with its reason.

    Attributes:
        nodes: node name -> why it stays float although it has a rule.
        tensors: tensor -> why it stays float (an anchor's output no quantized node reads).
    """

    nodes: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)
    # float node -> the input it reads quantized all the same (`guarded_pools`)
    guards: dict[str, str] = field(default_factory=dict)


def place(
    graph: onnx.GraphProto,
    index: UseIndex,
    selected: Mapping[str, object],
    quantized_inputs: Callable[[onnx.NodeProto], list[str]],
    constant: Callable[[str], onnx.TensorProto | None],
    *,
    loop_body: bool = False,
    run_macs: Mapping[str, int] | None = None,
    min_product_macs: int = 0,
    gemm_biases: frozenset[str] = frozenset(),
) -> Placement:
    """Placement "auto" for one graph (module docstring).

    Args:
        graph: the graph (nodes in topological order, as ONNX requires).
        index: its use index.
        selected: names of the nodes the user's selection and the default exclusions leave to
            be quantized (values unused).
        quantized_inputs: the float activations (not constants) a node would read quantized
            under its rule.
        constant: the constant a value holds in this graph's scope (outer scopes included),
            or None.
        loop_body: `graph` is the body of a Loop or Scan. There an anchor whose weight is not a
            constant (tf2onnx passes a scan's weights in as loop state) would quantize it anew
            at every iteration: such anchors stay float (a tf.scan model ran 3.2x slower).
        run_macs: MACs per run of compute nodes at the calibration data's shapes
            (module docstring), held to `min_product_macs`; a node missing: size unknown.
        gemm_biases: the Adds of a bias row that onnxruntime fuses with their MatMul into a
            Gemm (a 2-D input): a Relu/Clip after one fuses into that Gemm.
    """
    placement = Placement()
    nodes = [n for n in graph.node if n.name in selected and n.domain in DEFAULT_DOMAINS]
    # Q/DQ there would make onnxruntime compute at every run what it otherwise folds once
    for name in computed_from_constants(graph) & {n.name for n in nodes}:
        placement.nodes[name] = ("placement auto: it computes from constants alone, which "
                                 "onnxruntime does once, when it loads the model")
    for node in nodes:
        if node.name in placement.nodes:
            continue
        if node.op_type in ANCHOR_OPS and len(quantized_inputs(node)) > 1:
            if loop_body:
                placement.nodes[node.name] = (
                    "placement auto: inside a Loop/Scan body its weight is not a constant, "
                    "so it would be quantized again at every iteration")
            elif node.op_type in _PRODUCT_OPS:
                placement.nodes[node.name] = PRODUCT_OF_ACTIVATIONS
        elif node.op_type in _PRODUCT_OPS and (macs := (run_macs or {}).get(
                node.name, min_product_macs)) < min_product_macs:
            placement.nodes[node.name] = (
                f"{SMALL_PRODUCT}: {macs} multiply-adds per run at the calibration data's shapes, "
                f"fewer than {min_product_macs} (--min-product-macs): quantizing its input at "
                "every run costs more than its integer kernel saves")
    nodes = [n for n in nodes if n.name not in placement.nodes]
    dims = value_dims(graph)
    slow = {n.name: why for n in nodes if (why := slow_narrow_conv(n, index, dims.get(n.output[0])))}
    # Add -> the MatMul it adds a constant row to (its bias), found once for both placements
    bias_of = {n.name: anchor for n in nodes if n.op_type == "Add"
               and (anchor := added_bias_of(n, index, constant)) is not None}
    quantized, tensors = _place_among(nodes, index, quantized_inputs, bias_of, gemm_biases,
                                     frozenset(slow))
    # onnxruntime quantizes a float Conv's weight itself (per tensor) when its input is
    # dequantized and its output runs straight (through a Relu/Clip, or what it moves a
    # QuantizeLinear up through) into a QuantizeLinear: such a narrow Conv would run in the
    # slow integer kernel anyway, with coarser weights.
    by_name = {n.name: n for n in nodes}
    sandwiched = {name for name in slow if _between_quantized(
        by_name[name], index, quantized_inputs, quantized, tensors)}
    pooled = {name for name in slow if pools_into_quantized(
        by_name[name], index, quantized_inputs, quantized)}
    if sandwiched or pooled:
        slow = {name: why for name, why in slow.items()
                if name not in sandwiched and name not in pooled}
        quantized, tensors = _place_among(nodes, index, quantized_inputs, bias_of, gemm_biases,
                                     frozenset(slow))
    placement.nodes.update(slow)
    for node in nodes:
        if node.name in quantized or node.name in slow:
            continue
        anchor = bias_of.get(node.name)
        placement.nodes[node.name] = (
            f"placement auto: it adds a constant row to MatMul {anchor!r}, which takes it as "
            "its bias" if anchor is not None and anchor in quantized
            else "placement auto: not between quantized anchors")
    placement.tensors.update(tensors)
    placement.guards = guarded_pools(nodes, index, quantized_inputs, quantized, tensors)
    placement.nodes.update(dict.fromkeys(placement.guards, GUARDED_POOL))
    return placement


def _place_among(
    nodes: list[onnx.NodeProto],
    index: UseIndex,
    quantized_inputs: Callable[[onnx.NodeProto], list[str]],
    bias_of: Mapping[str, str],
    gemm_biases: frozenset[str],
    floated: frozenset[str],
) -> tuple[set[str], dict[str, str]]:
    """The nodes quantized under "auto" among `nodes` (`floated` left out), and the anchors'
    outputs no quantized node reads (tensor -> why it stays float). `bias_of`: each Add that
    only adds a constant row to a MatMul, with that MatMul (`added_bias_of`); `gemm_biases`,
    those onnxruntime fuses with it into a Gemm."""
    nodes = [n for n in nodes if n.name not in floated]
    by_name = {n.name: n for n in nodes}
    anchors = {n.name for n in nodes if n.op_type in ANCHOR_OPS}
    biases = {add for add, matmul in bias_of.items() if matmul in anchors}
    fused = _fused_activations(nodes, anchors, index, biases & gemm_biases)
    group_of = {activation: anchor for anchor, activation in fused.items()}
    in_group = anchors | set(group_of)

    # Inputs of anchors: quantized whoever produces them (a float MaxPool's output, ...).
    read_by_anchors = {t for name in anchors for t in quantized_inputs(by_name[name])}
    # Forward: serving nodes whose every quantized input comes from a quantized producer or is
    # quantized anyway for an anchor (a residual Add beside the Conv reading a MaxPool's output).
    forward: set[str] = set()
    for node in nodes:
        if node.name in in_group or node.name in biases or (
                node.op_type not in _SERVING_OPS
                and not pools_codes(node, index, in_group | forward, anchors)):
            continue
        inputs = quantized_inputs(node)
        if inputs and all(_quantized_source(t, index, in_group | forward, read_by_anchors)
                          for t in inputs):
            forward.add(node.name)
    # Backward: of those, the ones whose output reaches an anchor through such nodes.
    serving: set[str] = set()
    for node in reversed(nodes):
        if node.name in forward and any(
            reader.name in anchors or reader.name in serving
            or passes_quantized(reader, read_by_anchors)
            for value in node.output if value
            for reader in index.readers(value)
        ):
            serving.add(node.name)
    quantized = in_group | serving
    tensors: dict[str, str] = {}
    for anchor in sorted(anchors):
        node = by_name[anchor]
        if node.op_type in INTEGER_OUTPUT_ANCHORS or not node.output:
            continue
        tail = fused.get(anchor)
        if tail and node.op_type in _QUANTIZED_WITH_ACTIVATION:
            continue  # its activation's output is quantized whoever reads it
        output = by_name[tail].output[0] if tail else node.output[0]
        if not any(r.name in quantized for r in index.readers(output)):
            tensors[output] = "placement auto: no quantized node reads it"
    return quantized, tensors


def _between_quantized(
    node: onnx.NodeProto,
    index: UseIndex,
    quantized_inputs: Callable[[onnx.NodeProto], list[str]],
    quantized: set[str],
    float_outputs: Mapping[str, str],
) -> bool:
    """Whether float `node` reads a quantized tensor and its output runs, one reader at a time
    (QUANTIZE_SEES_THROUGH), into a tensor a quantized node reads: the form onnxruntime
    quantizes itself."""
    data = node.input[0] if node.input else ""
    producer = index.producer.get(data)
    written_quantized = (producer is not None and producer.name in quantized
                         and data not in float_outputs)
    if not written_quantized and not any(
        r.name in quantized and data in quantized_inputs(r) for r in index.readers(data)
    ):
        return False
    value = node.output[0] if node.output else ""
    while value and value not in index.graph_outputs:
        readers = index.readers(value)
        if len(readers) != 1:
            return False
        reader = readers[0]
        if reader.name in quantized and value in quantized_inputs(reader):
            return value not in float_outputs
        if reader.op_type not in QUANTIZE_SEES_THROUGH or not reader.output:
            return False
        value = reader.output[0]
    return False


# A Gemm or MatMul whose Relu/Clip onnxruntime fuses writes integers whoever reads the
# activation's output. Left float, onnxruntime fuses a Gemm and its activation into a float
# FusedGemm before its QDQ fusion sees them, and turns a MatMul into its integer
# MatMulIntegerToFloat only when no Relu or Clip reads its output: either runs on dequantized
# weights (then the check against its graph keeps it float, and the layer before it that fed
# it quantized: a Linear-ReLU MLP between float ops went all float, on 2-D inputs as Gemms and
# on tokens as MatMuls); quantized after the activation, the pair runs as one integer kernel.
_QUANTIZED_WITH_ACTIVATION = frozenset({"Gemm", "MatMul"})


# A MatMul or Gemm of two activations (attention scores and context) stays float: with both
# operands quantized at every run, onnxruntime's integer kernel multiplies uint8 by uint8, and
# on x86 that runs slower than its float kernel. An attention block (4 heads, one thread), with
# the two products float against integer: 0.98 against 1.16x float at 64 tokens of width 64,
# 0.62 against 0.70x at 256 tokens of width 256; larger ones depend on the thread count (512 of
# 512: 0.55 against 0.58x at one thread, 0.48 against 0.34x at two, where integers would win:
# a size guard needs shapes at planning time). Attention keeps float precision too.
_PRODUCT_OPS = frozenset({"MatMul", "Gemm"})
PRODUCT_OF_ACTIVATIONS = (
    "placement auto: a product of two activations, which onnxruntime would multiply as uint8 by "
    "uint8, after quantizing both at every run: slower than its float kernel")


def _quantized_source(
    tensor: str, index: UseIndex, quantized_nodes: set[str], read_by_anchors: set[str]
) -> bool:
    """Whether `tensor` is quantized whoever else reads it: written by a quantized node, or
    read by an anchor."""
    producer = index.producer.get(tensor)
    return (producer is not None and producer.name in quantized_nodes) or tensor in read_by_anchors


def _fused_activations(
    nodes: list[onnx.NodeProto], anchors: set[str], index: UseIndex, gemm_biases: set[str]
) -> dict[str, str]:
    """Anchor -> the Relu/Clip that is its output's only reader, or that of its bias Add
    (`gemm_biases`, fused with it into a Gemm first): onnxruntime fuses the pair."""
    names = {n.name for n in nodes}
    fused = {}
    for node in nodes:
        if node.name not in anchors or not node.output:
            continue
        values = through_gemm_bias(node.output[0], index, gemm_biases)
        readers = index.readers(values[-1])
        if (
            len(readers) == 1
            and readers[0].op_type in FUSED_ACTIVATIONS
            and readers[0].name in names
            and not any(v in index.graph_outputs for v in values)
        ):
            fused[node.name] = readers[0].name
    return fused
