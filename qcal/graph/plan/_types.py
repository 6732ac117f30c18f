"""The plan's data: the user's selection (`SelectionRules`) and what planning decides (a
`QuantPlan` of activation, weight and bias targets and one `NodeDecision` per node)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SelectionRules:
    """Which nodes and tensors the user lets qcal quantize.

    Attributes:
        op_types: only these op types (None: every op type with a rule).
        exclude_op_types: op types to leave float.
        exclude_nodes: fnmatch globs on node names to leave float.
        exclude_tensors: tensors never to quantize.
        per_channel: quantize weights per channel where the rule allows.
        default_exclusions: apply the trap-avoiding default exclusions (`TRAP_RULES_DOC`).
        placement: "auto" (Q/DQ where onnxruntime's integer kernels pay, `qcal.graph.placement`)
            or "all" (every node with a rule). With `op_types` set, every selected node counts.
        fuse_activations: a Relu/Clip right after a Conv/Gemm/MatMul is left to the
            QuantizeLinear of its output (the compute node's own output stays float).
            onnxruntime drops the Relu/Clip only when that QuantizeLinear's range starts at the
            activation's floor, i.e. when a range from 0 gets the lowest code as zero point
            (asymmetric activations); otherwise the compute node would run in float.
        integer_forms: placement "auto" writes HardSwish and HardSigmoid in integer operators
            (`OpRule.integer_form`); with activations of another type than uint8 it leaves
            them float instead.
        run_macs: (node, MACs per run) of compute nodes at the calibration data's shapes
            (inside an If, Loop or Scan body: per call of the body);
            placement "auto" leaves the MatMul and Gemm under `min_product_macs` float
            (`qcal.graph.placement`). Empty: sizes unknown, none left float for their size.
        min_product_macs: the fewest MACs per run of a quantized MatMul/Gemm under "auto".
    """

    op_types: frozenset[str] | None = None
    exclude_op_types: frozenset[str] = frozenset()
    exclude_nodes: tuple[str, ...] = ()
    exclude_tensors: frozenset[str] = frozenset()
    per_channel: bool = True
    default_exclusions: bool = True
    placement: str = "auto"
    fuse_activations: bool = True
    integer_forms: bool = True
    run_macs: tuple[tuple[str, int], ...] = ()
    min_product_macs: int = 0


@dataclass(frozen=True)
class ActivationTarget:
    """An activation to observe and quantize once.

    Attributes:
        tensor: its name.
        consumers: names of the quantized nodes that read it through the DQ (sorted).
        same_as: for the output of an operator that only moves or selects values (Reshape,
            Transpose, MaxPool, Resize, ...; `SAME_SCALE_OPS`), the activation upstream whose
            parameters it takes instead of being observed: its values lie within that tensor's
            range, and with equal parameters onnxruntime runs the operator on the integers,
            without a DequantizeLinear/QuantizeLinear pair around it. None: observed itself.
        divisor: with `same_as`, the source's scale is divided by this: the tensor is the
            source divided by a positive constant (a Div, `OpRule.divides_by_constant`, on the
            way). 1.0 when only data movement lies between them.
    """

    tensor: str
    consumers: tuple[str, ...]
    same_as: str | None = None
    divisor: float = 1.0


@dataclass(frozen=True)
class WeightTarget:
    """A constant (initializer) read by a quantized node, stored pre-quantized.

    Attributes:
        tensor: the initializer's name.
        node: the quantized node reading it.
        op_type: that node's op type.
        axis: channel axis for per-channel quantization, None for per-tensor.
        role: "weight" at the rule's weight input (the preset's weight scheme); "operand" at
            another input (Add, Mul, Concat, a constant MatMul A): per tensor in the activation
            scheme, so that its type matches the activations and onnxruntime's integer kernels
            (QLinearAdd, QLinearMul, ...) take the node.
    """

    tensor: str
    node: str
    op_type: str
    axis: int | None
    role: str = "weight"


@dataclass(frozen=True)
class BiasTarget:
    """A bias stored as int32 with scale = input scale x weight scale.

    Attributes:
        tensor: the bias initializer.
        node: the Conv/Gemm reading it, or the Add adding it to a MatMul's output.
        input_tensor: the quantized activation feeding the Conv/Gemm/MatMul.
        weight_tensor: its quantized weight.
        anchor: the MatMul whose output the Add reads ("": the bias is `node`'s own).
        as_float: an Add's bias left in float (with bias correction's shift, if any), not
            stored as int32 codes and a DequantizeLinear. onnxruntime fuses a MatMul and its
            Add into an integer Gemm only for a 2-D input or one of static shape with a 1-D
            bias (flattened to 2-D); otherwise the MatMul runs as
            MatMulIntegerToFloat, which takes no bias, and the DequantizeLinear would run at
            every run.
    """

    tensor: str
    node: str
    input_tensor: str
    weight_tensor: str
    anchor: str = ""
    as_float: bool = False

    @property
    def computed_by(self) -> str:
        """The node whose input and weight scales make the bias's scale."""
        return self.anchor or self.node


@dataclass(frozen=True)
class NodeDecision:
    """Whether a node is quantized, and why (the rule used, or the reason it was skipped)."""

    node: str
    op_type: str
    quantized: bool
    reason: str


@dataclass(frozen=True)
class QuantPlan:
    """What to quantize: targets sorted by tensor name, node decisions in graph order.

    `integer_forms` names the nodes (HardSwish, HardSigmoid, Pad: `OpRule.integer_form`;
    AveragePool: `OpRule.conv_form`) that the Q/DQ writer spells in operators onnxruntime runs
    on integers, or runs faster on them, where it finds the node still
    quantized (a plan restricted later keeps the names) and between its input's
    DequantizeLinear and its output's QuantizeLinear. Only placement
    "auto" asks for it: "all" emulates a target's arithmetic, which quantizes only the node's
    input and output.
    """

    activations: tuple[ActivationTarget, ...]
    weights: tuple[WeightTarget, ...]
    biases: tuple[BiasTarget, ...]
    nodes: tuple[NodeDecision, ...]
    integer_forms: frozenset[str] = frozenset()
