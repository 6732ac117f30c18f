"""The planner: `plan_quantization` decides for every node, by `OP_RULES` and the user's
selection, whether it is quantized and which tensors get Q/DQ, one graph at a time (If/Loop/Scan
bodies by planners of their own)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import onnx
import onnx.defs

from qcal.graph.files.large import tensor_array
from qcal.graph.integer_kernels import FUSED_ACTIVATIONS, added_bias_of, through_gemm_bias
from qcal.graph.parameters import parameter_tensors
from qcal.graph.placement import Placement, place
from qcal.graph.plan._rules import MUL_BY_CONSTANT, OP_RULES, OpRule
from qcal.graph.plan._selection import _check_selection, _Selection
from qcal.graph.plan._targets import (
    _Found,
    _NodeTargets,
    _share_roots,
    _shared_outputs,
    _weight_targets,
)
from qcal.graph.plan._types import (
    ActivationTarget,
    BiasTarget,
    NodeDecision,
    QuantPlan,
    SelectionRules,
)
from qcal.graph.plan._walk import _CONTROL_FLOW_OPS, _defined_twice, _walk_nodes
from qcal.graph.structure import (
    DEFAULT_DOMAINS,
    FLOAT_TYPES,
    NOT_FLOAT,
    UseIndex,
    attribute_graphs,
    default_opset,
    float_attribute,
    graph_element_types,
    int_attribute,
)
from qcal.graph.traps import Traps, find_traps

_NO_INTEGER_FORM = (
    "placement auto: no integer kernel for it, and its integer form (`OpRule.integer_form`) needs "
    "uint8 activations: with int8 ones onnxruntime converts a pair to the uint8 its x86 kernels "
    "take only where the QuantizeLinear has one reader")


def plan_quantization(model: onnx.ModelProto, rules: SelectionRules) -> QuantPlan:
    """Decide, by `OP_RULES` and `rules`, which nodes and tensors of `model` to quantize.

    `model` should come from `prepare_model` (named nodes, Constant weights as initializers,
    inferred types): tensors whose element type is unknown are not quantized. Nodes inside
    If/Loop/Scan bodies are planned by the same rules (constants of enclosing graphs count as
    weights); nodes in the graphs of other operators stay float, with that reason.

    Raises:
        ConfigError: an op type in `rules.op_types` has no rule, or a tensor in
            `rules.exclude_tensors` is not in the model.
        ModelError: a node has no name or a repeated one, or the model is already quantized.
    """
    _check_selection(model, rules)
    opset = default_opset(model) or onnx.defs.onnx_opset_version()
    return _Planner(
        model.graph, rules, opset=opset, ambiguous=_defined_twice(model.graph)
    ).plan()


class _Planner(_Selection):
    """One planning run over one graph, the main graph or an If/Loop/Scan body (indexes built
    once); bodies are planned by planners of their own, in graph order, depth first."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        rules: SelectionRules,
        *,
        opset: int,
        types: Mapping[str, int] | None = None,
        outer_constants: Mapping[str, onnx.TensorProto] | None = None,
        ambiguous: frozenset[str] = frozenset(),
        loop_body: bool = False,
    ) -> None:
        self._graph = graph
        self._rules = rules
        self._index = UseIndex.build(graph)
        # Value names are unique across scopes (bar `ambiguous`), so one type map serves all.
        self._types = graph_element_types(graph) if types is None else types
        self._outer_constants = outer_constants or {}
        self._ambiguous = ambiguous
        self._opset = opset
        self._parameters = parameter_tensors(graph, self._index, opset)
        self._selected: dict[str, OpRule] = {}
        self._skips: dict[str, str] = {}
        self._traps = (
            find_traps(graph, self._index, self._types, self._constant)
            if rules.default_exclusions else Traps()
        )
        # placement "auto" as asked (an explicit op-type list quantizes every selected node)
        self._auto = rules.placement == "auto" and rules.op_types is None
        shaped = [v for v in (*graph.input, *graph.value_info, *graph.output)
                  if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")]
        self._ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in shaped}
        self._static = {v.name for v in shaped
                        if all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
        self._divisors: dict[str, float] = {}  # node -> the positive scalar it divides by
        for node in graph.node:
            rule, reason = self._select(node)
            # a Mul by a positive constant scalar is a division by its reciprocal
            dividing = MUL_BY_CONSTANT if rule is OP_RULES["Mul"] else rule
            divisor = None if dividing is None else self._scalar(node, dividing)
            if divisor is not None:
                rule = dividing
            if rule is not None and rule.integer_form and self._auto and not rules.integer_forms:
                rule, reason = None, _NO_INTEGER_FORM
            if rule is not None and rule.refuses is not None:
                refused = rule.refuses(node, self._constant)
                if refused is not None:
                    rule, reason = None, refused
            if rule is not None and (other := self._not_float(node, rule)) is not None:
                rule, reason = None, other  # before placement: no size says why (a double MLP)
            if rule is None:
                self._skips[node.name] = reason
                continue
            self._selected[node.name] = rule
            if divisor is not None:
                self._divisors[node.name] = divisor
        self._placed = Placement()
        # Adds onnxruntime fuses with the MatMul before them into a Gemm (a bias row on a 2-D
        # input): a Relu/Clip after one fuses into that Gemm as into any other
        self._gemm_biases = frozenset(n.name for n in graph.node if self._two_d_gemm_bias(n))
        if self._auto:
            self._placed = place(graph, self._index, self._selected, self._activation_inputs,
                                 self._constant, loop_body=loop_body,
                                 run_macs=dict(rules.run_macs),
                                 min_product_macs=rules.min_product_macs,
                                 gemm_biases=self._gemm_biases)
            for name, reason in self._placed.nodes.items():
                del self._selected[name]
                self._skips[name] = reason
        self._fused = self._fused_tensors()

    def plan(self) -> QuantPlan:
        found = _Found()
        self._plan_into(found)
        readers = found.readers
        roots = _share_roots(found.shares, readers)
        return QuantPlan(
            activations=tuple(
                ActivationTarget(t, tuple(sorted(readers[t])), *roots.get(t, (None, 1.0)))
                for t in sorted(readers)
            ),
            weights=_weight_targets(found.weights, found.operands),
            biases=tuple(sorted(found.biases, key=lambda b: (b.tensor, b.node))),
            nodes=tuple(found.decisions),
            integer_forms=frozenset(found.integer_forms),
        )

    def _plan_into(self, found: _Found) -> None:
        for node in self._graph.node:
            self._decide(node, found)
            for attribute in node.attribute:
                for subgraph in attribute_graphs(attribute):
                    where = f"the {attribute.name} of {node.op_type} node {node.name!r}"
                    if node.op_type in _CONTROL_FLOW_OPS and node.domain in DEFAULT_DOMAINS:
                        body = _Planner(
                            subgraph,
                            self._rules,
                            opset=self._opset,
                            types=self._types,
                            outer_constants=self._scope_constants(),
                            ambiguous=self._ambiguous,
                            loop_body=node.op_type in ("Loop", "Scan"),
                        )
                        body._plan_into(found)
                        continue
                    reason = f"inside {where}: only If, Loop and Scan bodies are quantized"
                    found.decisions += [
                        NodeDecision(inner.name, inner.op_type, False, reason)
                        for inner, _ in _walk_nodes(subgraph, where)
                    ]

    def _decide(self, node: onnx.NodeProto, found: _Found) -> None:
        rule = self._selected.get(node.name)
        targets = self._targets(node, rule) if rule is not None else self._skips[node.name]
        if isinstance(targets, str) or targets.is_empty():
            reason = targets if isinstance(targets, str) else targets.empty_reason()
            found.decisions.append(NodeDecision(node.name, node.op_type, False, reason))
            # a float node that reads one input quantized all the same (a MaxPool kept so)
            if (guarded := self._placed.guards.get(node.name)) is not None:
                found.readers.setdefault(guarded, set()).add(node.name)
            return
        assert rule is not None
        for tensor in targets.inputs:
            found.readers.setdefault(tensor, set()).add(node.name)
        for tensor in targets.outputs:
            found.readers.setdefault(tensor, set())
        for tensor, axis in targets.weights:
            found.weights.setdefault(tensor, []).append((node.name, node.op_type, axis))
        found.operands.update((tensor, node.name) for tensor in targets.operands)
        found.shares.update(_shared_outputs(node, targets, self._divisor(node)))
        bias = self._bias(node, rule, targets)
        if bias is not None:
            found.biases.append(bias)
        reason = "; ".join([f"{node.op_type} rule: {rule.summary}", *targets.notes])
        found.decisions.append(NodeDecision(node.name, node.op_type, True, reason))
        if (rule.integer_form or rule.conv_form) and self._auto:
            found.integer_forms.add(node.name)  # only with uint8 codes (_NO_INTEGER_FORM)

    def _activation_inputs(self, node: onnx.NodeProto) -> list[str]:
        """The float activations (not constants) `node` reads at the inputs its rule quantizes."""
        rule = self._selected[node.name]
        return [
            tensor for slot, tensor in enumerate(node.input)
            if tensor and _quantized_slot(rule.inputs, slot) and self._constant(tensor) is None
            and self._types.get(tensor) in FLOAT_TYPES and tensor not in self._parameters
        ]

    def _constant(self, value: str) -> onnx.TensorProto | None:
        """The initializer holding `value`, in this graph or an enclosing one."""
        own = self._index.constant(value)
        if own is not None or value in self._index.graph_inputs or value in self._index.producer:
            return own
        return self._outer_constants.get(value)

    def _scope_constants(self) -> dict[str, onnx.TensorProto]:
        """The constants a body inside this graph sees: ours and those of enclosing graphs."""
        visible = {
            name: tensor
            for name, tensor in self._outer_constants.items()
            if name not in self._index.graph_inputs and name not in self._index.producer
        }
        visible.update(
            (name, tensor)
            for name, tensor in self._index.initializers.items()
            if name not in self._index.graph_inputs
        )
        return visible

    def _fused_tensors(self) -> dict[str, tuple[str, str]]:
        """Tensor -> (compute node, activation node) for outputs onnxruntime fuses."""
        fused: dict[str, tuple[str, str]] = {}
        if not self._rules.fuse_activations:
            return fused
        float_biases = self._gemm_biases - self._selected.keys()  # fused with their MatMul first
        for node in self._graph.node:
            rule = self._selected.get(node.name)
            if rule is None or not rule.fuses_activation or not node.output:
                continue
            tensors = through_gemm_bias(node.output[0], self._index, float_biases)
            readers = self._index.readers(tensors[-1])
            if any(t in self._index.graph_outputs for t in tensors) or len(readers) != 1:
                continue
            if not (node.input and self._quantizable(node.input[0])):
                continue  # the compute node itself will not run quantized
            (activation,) = readers
            if (
                activation.op_type in FUSED_ACTIVATIONS
                and activation.domain in DEFAULT_DOMAINS
                and activation.name in self._selected
                and activation.input[0] == tensors[-1]
                and len(self._index.uses.get(tensors[-1], ())) == 1
                and self._quantizable(activation.output[0])
                and all(not v or self._constant(v) is not None for v in activation.input[1:])
            ):
                fused.update(dict.fromkeys(tensors, (node.name, activation.name)))
        return fused

    def _two_d_gemm_bias(self, node: onnx.NodeProto) -> bool:
        """Whether `node` is an Add of a bias row (`added_bias_of`) to a MatMul of a 2-D input
        (and the row of rank 2 at most), which onnxruntime fuses into a Gemm."""
        if added_bias_of(node, self._index, self._constant) is None:
            return False
        row = next(c for v in node.input if (c := self._constant(v)) is not None)
        matmul = next(p for v in node.input
                      if (p := self._index.producer.get(v)) and p.op_type == "MatMul")
        return self._ranks.get(matmul.input[0]) == 2 and len(row.dims) <= 2

    def _divisor(self, node: onnx.NodeProto) -> float | None:
        """The positive finite scalar constant `node` divides by, or None (not such a node)."""
        return self._divisors.get(node.name) if node.name in self._selected else None

    def _scalar(self, node: onnx.NodeProto, rule: OpRule) -> float | None:
        """What `node` divides by under `rule` (a positive finite constant scalar, its input 1;
        its reciprocal for a Mul), or None."""
        if not rule.divides_by_constant or len(node.input) < 2:
            return None
        if self._constant(node.input[0]) is not None:
            return None  # both constant: nothing to quantize
        constant = self._constant(node.input[1])
        if constant is None or constant.data_type not in FLOAT_TYPES:
            return None
        values = tensor_array(constant)
        if values.size != 1:
            return None
        if values.ndim and values.ndim > self._ranks.get(node.input[0], -1):
            return None  # a divisor of higher (or unknown) rank may broadcast to a new shape
        value = float(values.reshape(()))
        if not (math.isfinite(value) and value > 0):
            return None
        return 1.0 / value if rule.by_reciprocal else value

    def _not_float(self, node: onnx.NodeProto, rule: OpRule) -> str | None:
        """Why a node with a weight computes in no float type qcal quantizes, or None."""
        main = node.input[0] if node.input else ""
        if rule.weight is not None and main and self._types.get(main) not in FLOAT_TYPES:
            return f"{NOT_FLOAT}: input {main!r} is {self._type_name(main)}"
        return None

    def _targets(self, node: onnx.NodeProto, rule: OpRule) -> _NodeTargets | str:
        """What `node` quantizes under `rule`, or why it cannot be quantized."""
        found = _NodeTargets()  # (a node of no float type was never selected: `_not_float`)
        if rule.divides_by_constant and self._divisor(node) is None:
            return "the divisor is not a positive constant scalar"
        for slot, tensor in enumerate(node.input):
            if tensor and _quantized_slot(rule.inputs, slot):
                self._add_input(node, rule, slot, tensor, found)
        for slot, tensor in enumerate(node.output):
            if tensor and _quantized_slot(rule.outputs, slot):
                self._add_output(node, tensor, found)
        return found

    def _add_input(
        self, node: onnx.NodeProto, rule: OpRule, slot: int, tensor: str, found: _NodeTargets
    ) -> None:
        if (node.name, tensor) in self._traps.reads:
            found.notes.append(self._traps.reads[(node.name, tensor)])
            return
        if tensor in self._fused:
            found.notes.append(
                f"input {tensor!r} left float: onnxruntime fuses this "
                f"{node.op_type} into {self._fused[tensor][0]!r}"
            )
            return
        if not self._accepts(tensor, found):
            return
        constant = self._constant(tensor)
        if constant is None:
            found.inputs.append(tensor)
            return
        axis = None
        if slot == rule.weight and rule.weight_axis is not None and self._rules.per_channel:
            axis = rule.weight_axis(node, len(constant.dims))
        found.weights.append((tensor, axis))
        if slot != rule.weight:
            found.operands.append(tensor)

    def _add_output(self, node: onnx.NodeProto, tensor: str, found: _NodeTargets) -> None:
        if tensor in self._fused:
            found.notes.append(
                f"output {tensor!r} left float: onnxruntime fuses the "
                f"following {self._fused[tensor][1]!r} into it"
            )
            return
        if self._accepts(tensor, found):
            found.outputs.append(tensor)

    def _bias(self, node: onnx.NodeProto, rule: OpRule, targets: _NodeTargets) -> BiasTarget | None:
        if node.op_type == "MatMul":
            return self._added_bias(node, targets)
        if rule.bias is None or len(node.input) <= rule.bias or not node.input[rule.bias]:
            return None
        bias, source, weight = node.input[rule.bias], node.input[0], node.input[1]
        why = self._bias_problem(node, bias, weight)
        if why is None and source not in targets.inputs:
            why = f"input {source!r} is not quantized"
        if why is None and weight not in {t for t, _ in targets.weights}:
            why = f"weight {weight!r} is not a quantized constant"
        if why is not None:
            targets.notes.append(f"bias {bias!r} stays float: {why}")
            return None
        return BiasTarget(tensor=bias, node=node.name, input_tensor=source, weight_tensor=weight)

    def _added_bias(self, node: onnx.NodeProto, targets: _NodeTargets) -> BiasTarget | None:
        """The constant a float Add adds to this MatMul's float output, stored as int32 like a
        Gemm's bias. onnxruntime fuses MatMul + Add into a Gemm, and a Gemm reading a float bias
        beside dequantized inputs runs in float on dequantized weights (every run); with the
        bias dequantized from int32 codes it runs as one integer kernel (QGemm). Where
        onnxruntime does not fuse the two (below), the bias stays float (`as_float`)."""
        if len(node.input) < 2 or len(node.output) != 1 or node.output[0] in targets.outputs:
            return None
        readers = self._index.readers(node.output[0])
        if len(readers) != 1 or added_bias_of(readers[0], self._index, self._constant) != node.name:
            return None
        (add,) = readers
        if add.name in self._selected:
            return None  # an Add that is quantized itself takes the MatMul's output quantized
        source, weight = node.input[0], node.input[1]
        bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        if (source not in targets.inputs or weight not in {t for t, _ in targets.weights}
                or bias in self._rules.exclude_tensors):
            return None
        # onnxruntime fuses MatMul and Add into a Gemm for a 2-D input (and a row of rank 2 at
        # most), or an input of static shape it flattens to 2-D (and a 1-D row); otherwise the
        # MatMul runs as MatMulIntegerToFloat, which takes no bias. Of unknown rank, the bias
        # stays int32: were they fused, a float bias would make a float Gemm of them.
        row = self._constant(bias)
        row_rank = len(row.dims) if row is not None else 0
        rank = self._ranks.get(source)
        fused = ((rank == 2 and row_rank <= 2)
                 or (source in self._static and row_rank == 1))
        as_float = rank is not None and not fused
        targets.notes.append(
            f"the Add {add.name!r} after it adds {bias!r} in float (onnxruntime's integer "
            "MatMul of this input takes no bias)" if as_float
            else f"the Add {add.name!r} after it adds {bias!r} as an int32 bias")
        return BiasTarget(tensor=bias, node=add.name, input_tensor=source, weight_tensor=weight,
                          anchor=node.name, as_float=as_float)

    def _bias_problem(self, node: onnx.NodeProto, bias: str, weight: str) -> str | None:
        constant = self._constant(bias)
        weight_constant = self._constant(weight)
        if bias in self._rules.exclude_tensors:
            return "excluded by --exclude-tensors"
        if constant is None or constant.data_type not in FLOAT_TYPES:
            return "not a float constant"
        if len(self._index.readers(bias)) != 1:
            return "other nodes read it too"
        if weight_constant is None:
            return "the weight is not constant"
        if node.op_type == "Gemm":
            if (
                float_attribute(node, "alpha", 1.0) != 1.0
                or float_attribute(node, "beta", 1.0) != 1.0
            ):
                return "alpha or beta is not 1"
            channels = weight_constant.dims[0 if int_attribute(node, "transB", 0) else -1]
        else:
            channels = weight_constant.dims[0]
        if list(constant.dims) != [channels]:
            return f"shape {list(constant.dims)} is not [{channels}]"
        return None

    def _type_name(self, tensor: str) -> str:
        elem_type = self._types.get(tensor)
        if elem_type is None:
            return "of unknown type"
        return str(onnx.TensorProto.DataType.Name(elem_type)).lower()


def _quantized_slot(slots: tuple[int, ...] | None, slot: int) -> bool:
    return slots is None or slot in slots
