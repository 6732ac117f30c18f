"""The two models sensitivity runs: the probe model (the float model that also computes every
planned tensor's fake-quant, exposed as outputs: local SQNR) and the switch model (the float
model in which a boolean input, one flag per tensor, selects the tensors whose consumers read
them fake-quantized).

The fake-quant is the written model's own arithmetic (optional Clip, QuantizeLinear,
DequantizeLinear; weights as their dequantized codes), so a tensor measured here is the tensor
InsertQDQ writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.decision_counts import DecisionRule
from qcal.accuracy.decisions import decision_rules
from qcal.accuracy.evaluate import numeric_outputs
from qcal.accuracy.padding import compared_positions, measured_mask
from qcal.accuracy.sensitivity._results import _OutputNoise
from qcal.graph.attention_masks import AttentionMask, attention_mask
from qcal.graph.files.large import tensor_array
from qcal.graph.model import QuantPlan
from qcal.graph.names import NameAllocator
from qcal.graph.qdq import QuantizedWeight
from qcal.graph.structure import UseIndex, element_types, exposing
from qcal.numerics.errors import ModelError
from qcal.numerics.onnx_mapping import OnnxQParams

_NATIVE_QDQ_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})


@dataclass(frozen=True)
class _Models:
    """The switch model (one If per tensor) and, on demand, the probe model (fake-quants as
    extra outputs)."""

    switch: onnx.ModelProto
    selector: str  # bool [units] input of the switch model: which units are quantized
    units: tuple[tuple[str, str], ...]  # (tensor, role); the index is the selector flag's
    chains: _Chains
    consumers: tuple[tuple[str, ...], ...]  # per unit: the nodes reading it quantized
    logits: tuple[str, ...]  # softmax inputs of softmax outputs, extra outputs of both models
    compared: tuple[str, ...]  # the model outputs compared: not a ZipMap of dicts, nor strings
    rules: tuple[DecisionRule | None, ...]  # how each compared output is read
    mask: AttentionMask | None  # outputs compared on real tokens only (`qcal.accuracy.padding`)

    @property
    def outputs(self) -> list[str]:
        """What a run of either model is asked for: the compared outputs, then the logits."""
        return [*self.compared, *self.logits]

    def empty_noise(self) -> _OutputNoise:
        """Sums for one set of tensors quantized, over `outputs`."""
        masked = frozenset() if self.mask is None else self.mask.outputs
        # a masked output's softmax logits are rows per position as it is (rank 3 or more)
        return _OutputNoise.empty(len(self.outputs), list(self.rules), tuple(
            name in masked for name in self.compared) + (bool(masked),) * len(self.logits))

    def positions(self, feed: Mapping[str, Any]) -> np.ndarray | None:
        """The positions of a batch its outputs are compared on (None: all of them)."""
        return compared_positions(feed, self.mask)

    def measured(self, feed: Mapping[str, Any], session: Any, reference: list[np.ndarray]
                 ) -> tuple[bool, _Models]:
        """Whether `feed` told which value of the mask marks padding, and these models with
        that mask (`qcal.accuracy.padding.measured_mask`; `session` runs the float model's
        outputs, the switch model's with nothing switched or the probe model's; `reference`:
        its `outputs` on `feed`)."""
        done, mask = measured_mask(self.mask, feed, session, dict(zip(self.outputs, reference)))
        return done, replace(self, mask=mask) if done else self

    def probe_model(self) -> tuple[onnx.ModelProto, Mapping[str, tuple[str, str]]]:
        """The probe model and, per tensor, its (float, fake-quant) outputs (a copy of the
        model, built when asked for: block measurements run the switch model alone)."""
        return self.chains.probe_model()

    def switch_for(self, subset: list[int]) -> tuple[onnx.ModelProto, str]:
        """A switch model for the units `subset` alone; selector flag k quantizes subset[k]."""
        return self.chains.switch_model([(self.units[k][0], self.consumers[k]) for k in subset])

    @classmethod
    def build(
        cls,
        model: onnx.ModelProto,
        plan: QuantPlan,
        activations: Mapping[str, OnnxQParams],
        weights: Mapping[str, QuantizedWeight],
    ) -> _Models:
        compared = tuple(numeric_outputs(model))
        rules = decision_rules(model)
        mask = attention_mask(model)
        logits = _softmax_logits(model)
        if logits:
            model = exposing(model, logits)
        chains = _Chains(model)
        # Sensitivity is measured on the main graph: tensors of If/Loop/Scan bodies are not
        # switched (they stay as planned, and are no fallback candidates).
        graph = model.graph
        main_values = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        main_values.update(v for node in graph.node for v in node.output)
        units: list[tuple[str, str, tuple[str, ...]]] = []
        for target in sorted(plan.activations, key=lambda t: t.tensor):
            if not target.consumers or target.tensor not in main_values:
                continue  # nothing reads it quantized: InsertQDQ writes no pair either
            chains.add_activation(target.tensor, activations[target.tensor])
            units.append((target.tensor, "activation", target.consumers))
        readers: dict[str, list[str]] = {}
        for weight in plan.weights:
            if weight.tensor in main_values:
                readers.setdefault(weight.tensor, []).append(weight.node)
        for tensor in sorted(readers):
            chains.add_weight(tensor, weights[tensor])
            units.append((tensor, "weight", tuple(readers[tensor])))
        switch, selector = chains.switch_model([(t, c) for t, _, c in units])
        return cls(switch, selector, tuple((t, r) for t, r, _ in units), chains,
                   tuple(c for _, _, c in units), tuple(logits), compared,
                   tuple(rules.get(name) for name in compared), mask)


_RESHAPING_OPS = frozenset({"Reshape", "Flatten", "Identity", "Transpose", "Squeeze",
                            "Unsqueeze"})


def _softmax_logits(model: onnx.ModelProto) -> list[str]:
    """Inputs of the Softmax/LogSoftmax nodes whose result is a model output (up to reshapes)."""
    index = UseIndex.build(model.graph)
    outputs = {o.name for o in model.graph.output}
    found: list[str] = []
    for output in model.graph.output:
        node = index.producer.get(output.name)
        while node is not None and node.op_type in _RESHAPING_OPS and node.input:
            node = index.producer.get(node.input[0])
        if (node is not None and node.op_type in ("Softmax", "LogSoftmax") and node.input
                and node.input[0] not in outputs and node.input[0] not in found):
            found.append(node.input[0])
    return found


@dataclass
class _Chain:
    nodes: list[onnx.NodeProto]  # fake-quant nodes (empty for a weight: its output is a constant)
    output: str  # the fake-quantized tensor
    elem_type: int


class _Chains:
    """Fake-quant chains, one per tensor, placed into either model."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._names = NameAllocator.from_model(model)
        self._index = UseIndex.build(model.graph)
        self._types = element_types(model.graph)
        self._initializers: list[onnx.TensorProto] = []
        self._chains: dict[str, _Chain] = {}

    def add_activation(self, tensor: str, qparams: OnnxQParams) -> None:
        if qparams.axis is not None:
            raise ModelError(f"activation {tensor!r}: per-axis activations cannot be measured "
                             "for sensitivity")
        elem_type = self._types.get(tensor, TensorProto.FLOAT)
        nodes: list[onnx.NodeProto] = []
        source = tensor
        if elem_type != TensorProto.FLOAT:
            source = self._node(nodes, "Cast", [tensor], f"{tensor}_as_float", to=TensorProto.FLOAT)
        faked = self._fake_quant(nodes, tensor, source, qparams)
        if elem_type != TensorProto.FLOAT:
            faked = self._node(nodes, "Cast", [faked], f"{tensor}_fq_cast", to=elem_type)
        self._chains[tensor] = _Chain(nodes, faked, elem_type)

    def add_weight(self, tensor: str, weight: QuantizedWeight) -> None:
        original = tensor_array(self._index.initializers[tensor])
        q = weight.onnx
        scale = np.asarray(q.scale, np.float32)
        zero_point = np.asarray(q.zero_point).astype(np.float32)
        if q.axis is not None:
            shape = [1] * original.ndim
            shape[q.axis] = -1
            scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
        # DequantizeLinear's arithmetic: (q - zero_point) * scale in float32.
        dequantized = ((weight.codes.astype(np.float32) - zero_point) * scale).astype(original.dtype)
        name = self._const(f"{tensor}_fq", dequantized)
        self._chains[tensor] = _Chain([], name, helper.np_dtype_to_tensor_dtype(original.dtype))

    def probe_model(self) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
        """The float model computing every fake-quant too, exposed with its tensor as outputs."""
        out = self._copy()
        graph = out.graph
        after: dict[str, list[onnx.NodeProto]] = {}
        before: list[onnx.NodeProto] = []
        probes: dict[str, tuple[str, str]] = {}
        present = {o.name for o in graph.output}
        for tensor, chain in self._chains.items():
            producer = self._index.producer.get(tensor)
            plain = tensor
            if producer is None:  # a graph input or a constant: copied out through an Identity
                plain = self._node(before, "Identity", [tensor], f"{tensor}_float")
            (after.setdefault(producer.name, []) if producer else before).extend(chain.nodes)
            probes[tensor] = (plain, chain.output)
            for name in (plain, chain.output):
                if name not in present:
                    graph.output.append(helper.make_tensor_value_info(name, chain.elem_type, None))
                    present.add(name)
        _reorder(graph, before, after)
        return out, probes

    def switch_model(
        self, units: list[tuple[str, tuple[str, ...]]]
    ) -> tuple[onnx.ModelProto, str]:
        """The float model where unit k's consumers read ``If(selector[k], fq(t), t)``:
        `selector` is a bool vector of one flag per unit, so one model quantizes any set of
        them (`switch_flags`).

        If runs only the branch it takes, so a run costs about one float inference whichever
        tensors are quantized.
        """
        out = self._copy()
        graph = out.graph
        selector = self._names.allocate("qcal_sensitivity_units")
        graph.input.append(helper.make_tensor_value_info(selector, TensorProto.BOOL,
                                                         [len(units)]))
        index = UseIndex.build(graph)
        after: dict[str, list[onnx.NodeProto]] = {}
        before: list[onnx.NodeProto] = []
        for k, (tensor, consumers) in enumerate(units):
            chain = self._chains[tensor]
            nodes: list[onnx.NodeProto] = []
            unit = self._const(f"{tensor}_unit", np.array(k, np.int64), graph)
            chosen = self._node(nodes, "Gather", [selector, unit], f"{tensor}_chosen", axis=0)
            switched = self._names.allocate(f"{tensor}_switched")
            then_out = chain.output
            then_nodes = list(chain.nodes)
            if not then_nodes:  # a constant: a branch must compute its output
                then_out = self._node(then_nodes, "Identity", [chain.output], f"{tensor}_fq_out")
            else_nodes: list[onnx.NodeProto] = []
            else_out = self._node(else_nodes, "Identity", [tensor], f"{tensor}_float_out")
            nodes.append(helper.make_node(
                "If", [chosen], [switched], name=self._names.allocate(f"{tensor}_If"),
                then_branch=_branch(f"{tensor}_quantized_branch", then_nodes, then_out,
                                    chain.elem_type),
                else_branch=_branch(f"{tensor}_float_branch", else_nodes, else_out,
                                    chain.elem_type),
            ))
            producer = self._index.producer.get(tensor)
            (after.setdefault(producer.name, []) if producer else before).extend(nodes)
            wanted = set(consumers)
            for use in index.uses.get(tensor, ()):
                if use.node.name in wanted and use.slot >= 0:
                    use.node.input[use.slot] = switched
        _reorder(graph, before, after)
        return out, selector

    # -- pieces ---------------------------------------------------------------------------

    def _copy(self) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(self._model)
        out.graph.initializer.extend(self._initializers)
        return out

    def _fake_quant(self, nodes: list[onnx.NodeProto], tensor: str, source: str,
                    q: OnnxQParams) -> str:
        if q.clip_min is not None or q.clip_max is not None:
            bounds = [self._const(f"{tensor}_clip_{kind}", np.asarray(bound, np.float32))
                      if bound is not None else "" for kind, bound in
                      (("min", q.clip_min), ("max", q.clip_max))]
            source = self._node(nodes, "Clip", [source, *bounds], f"{tensor}_clipped")
        scale = self._const(f"{tensor}_scale", np.asarray(q.scale, np.float32))
        if q.dtype in _NATIVE_QDQ_TYPES:
            numpy_type = np.int8 if q.dtype == TensorProto.INT8 else np.uint8
            zero_point = self._const(f"{tensor}_zero_point",
                                     np.asarray(q.zero_point).astype(numpy_type))
            codes = self._node(nodes, "QuantizeLinear", [source, scale, zero_point],
                               f"{tensor}_q")
            return self._node(nodes, "DequantizeLinear", [codes, scale, zero_point],
                              f"{tensor}_fq")
        # Types other than 8 bits may need a newer opset for QuantizeLinear; the same
        # arithmetic in float ops: (clip(rint(x / s) + zp, lo, hi) - zp) * s.
        low, high = _type_range(q.dtype)
        zp = self._const(f"{tensor}_zp_float", np.asarray(q.zero_point, np.float32))
        scaled = self._node(nodes, "Div", [source, scale], f"{tensor}_scaled")
        rounded = self._node(nodes, "Round", [scaled], f"{tensor}_rounded")
        shifted = self._node(nodes, "Add", [rounded, zp], f"{tensor}_shifted")
        clamped = self._node(nodes, "Clip", [
            shifted, self._const(f"{tensor}_lo", np.float32(low)),
            self._const(f"{tensor}_hi", np.float32(high))], f"{tensor}_codes")
        centred = self._node(nodes, "Sub", [clamped, zp], f"{tensor}_centred")
        return self._node(nodes, "Mul", [centred, scale], f"{tensor}_fq")

    def _node(self, nodes: list[onnx.NodeProto], op_type: str, inputs: list[str], output: str,
              **attributes: Any) -> str:
        name = self._names.allocate(output)
        node_name = self._names.allocate(f"{name}_{op_type}")
        nodes.append(helper.make_node(op_type, inputs, [name], name=node_name, **attributes))
        return name

    def _const(self, base: str, value: np.ndarray | np.generic,
               graph: onnx.GraphProto | None = None) -> str:
        name = self._names.allocate(base)
        tensor = numpy_helper.from_array(np.asarray(value), name)
        if graph is None:
            self._initializers.append(tensor)  # shared by both models
        else:
            graph.initializer.append(tensor)
        return name


def switch_flags(units: int, quantized: Iterable[int] = ()) -> np.ndarray:
    """The switch model's selector value quantizing the units `quantized` (none: the float
    model)."""
    flags = np.zeros(units, dtype=np.bool_)
    flags[list(quantized)] = True
    return flags


def _branch(name: str, nodes: list[onnx.NodeProto], output: str, elem_type: int) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, elem_type, None)])


def _reorder(graph: onnx.GraphProto, before: list[onnx.NodeProto],
             after: Mapping[str, list[onnx.NodeProto]]) -> None:
    """Insert `before` first and each `after[name]` right behind that node (topological order)."""
    ordered = list(before)
    for node in graph.node:
        ordered.append(node)
        ordered.extend(after.get(node.name, []))
    del graph.node[:]
    graph.node.extend(ordered)


def _type_range(dtype: int) -> tuple[int, int]:
    info: dict[int, tuple[int, int]] = {
        TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255),
        TensorProto.INT16: (-32768, 32767), TensorProto.UINT16: (0, 65535),
        TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15),
    }
    if dtype not in info:
        raise ModelError(f"sensitivity: no integer range known for ONNX type {dtype}")
    return info[dtype]
