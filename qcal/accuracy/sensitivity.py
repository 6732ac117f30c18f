"""Per-tensor sensitivity: how much the model outputs move when one tensor alone is quantized.

One onnxruntime session runs a "switch model": the float model in which every planned tensor
``t`` also has its fake-quantized copy ``fq(t)`` (the same Q/DQ arithmetic as the written model:
optional Clip, QuantizeLinear, DequantizeLinear; weights as their dequantized codes) and a
``Where(unit == k, fq(t), t)`` that the tensor's quantized consumers read. Feeding ``unit = -1``
gives the float model exactly; ``unit = k`` quantizes tensor k alone. For every batch the float
outputs are computed once and then every unit is run, so only per-unit sums are kept, never
activations of more than one batch.

Screening (``screen_samples``): that is one model run per tensor and sample, the whole cost of
sensitivity. Most tensors of a real model barely move the outputs, and their exact figure does
not change any decision (the fallback ranks by harm, largest first). So every tensor is measured
on the first ``screen_samples`` samples only; the tensors whose harm there is at least
``screen_fraction`` of the worst tensor's (and not negligible, below -60 dB) are measured on the
remaining samples too, with a switch model rebuilt for them alone (fewer ``If`` nodes, so each
run costs about one float inference), until ``refine_runs`` runs are spent (a model whose harm
is spread over many tensors measures them on fewer samples instead of costing more). Each
tensor's ``samples`` says what it was measured on. Local SQNR is always measured on every sample
(one run per batch for all tensors together).

Per tensor, with x the float outputs and y the outputs with only that tensor quantized:

* output SQNR = ``10 log10(sum x^2 / sum (x - y)^2)`` per model output, the worst output kept;
  ``noise_ratio`` is its linear form ``sum (x - y)^2 / sum x^2`` (the harm, additive to first
  order over tensors whose errors are independent);
* top-1 agreement of classifier-like outputs (rank 2), the worst output kept;
* local SQNR = ``10 log10(sum t^2 / sum (t - fq(t))^2)`` over the tensor itself;
* for outputs computed by Softmax or LogSoftmax (through reshapes), the same noise ratio over
  the logits the softmax reads (``logit_noise_ratio``), and that is the tensor's ``harm``.
  Probabilities are a poor yardstick for ranking: a small perturbation moves them only where
  two classes are close, so their noise is a handful of argmax flips, which a few samples
  estimate badly and which do not add up over tensors; the logits move smoothly with the
  perturbation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.evaluate import is_classifier_like
from qcal.calibration.runtime import create_session
from qcal.graph.files.large import tensor_array
from qcal.graph.model import QuantPlan
from qcal.graph.names import NameAllocator
from qcal.graph.qdq import QuantizedWeight
from qcal.graph.structure import UseIndex, element_types
from qcal.numerics.errors import DataError, ModelError
from qcal.numerics.onnx_mapping import OnnxQParams

__all__ = ["SensitivityResult", "TensorSensitivity", "measure_sensitivity"]

logger = logging.getLogger(__name__)

Feed = Mapping[str, np.ndarray]

_NATIVE_QDQ_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})

# Screening keeps measuring a tensor when its harm is at least this share of the worst tensor's
# (1 %: 20 dB below it; the fallback ranks by harm, so the order below that changes nothing it
# could reach) and above -60 dB (a millionth of the output energy: harmless whatever the rest).
SCREEN_FRACTION = 0.01
_NEGLIGIBLE = 1e-6


@dataclass(frozen=True)
class TensorSensitivity:
    """The effect of quantizing one tensor alone.

    Attributes:
        tensor: the tensor's name.
        role: "activation" or "weight".
        output_sqnr_db: worst model-output SQNR with only this tensor quantized (None: outputs
            unchanged).
        noise_ratio: worst output noise energy over signal energy (0.0: unchanged).
        top1_agreement: worst top-1 agreement of classifier-like outputs, None without any.
        local_sqnr_db: SQNR of the tensor against its fake-quant (None: quantized exactly).
        samples: samples the output figures were measured on (fewer than the result's when
            screening found the tensor harmless; None: not recorded).
        logit_noise_ratio: worst noise ratio over the logits of softmax outputs (None: no
            output is a softmax).
    """

    tensor: str
    role: str
    output_sqnr_db: float | None
    noise_ratio: float
    top1_agreement: float | None
    local_sqnr_db: float | None
    samples: int | None = None
    logit_noise_ratio: float | None = None

    @property
    def harm(self) -> float:
        """What screening and the fallback rank by: the logits' noise ratio, else the outputs'."""
        return self.noise_ratio if self.logit_noise_ratio is None else self.logit_noise_ratio

    def to_json(self) -> dict[str, object]:
        return {
            "tensor": self.tensor,
            "role": self.role,
            "output_sqnr_db": _round(self.output_sqnr_db),
            "noise_ratio": _round(self.noise_ratio),
            "top1_agreement": _round(self.top1_agreement),
            "local_sqnr_db": _round(self.local_sqnr_db),
            "samples": self.samples,
            "logit_noise_ratio": _round(self.logit_noise_ratio),
        }


@dataclass(frozen=True)
class SensitivityResult:
    """Sensitivity of every planned tensor, worst (lowest output SQNR) first."""

    samples: int
    tensors: tuple[TensorSensitivity, ...]

    def by_tensor(self) -> dict[str, TensorSensitivity]:
        return {t.tensor: t for t in self.tensors}

    def to_json(self) -> dict[str, object]:
        return {"samples": self.samples, "tensors": [t.to_json() for t in self.tensors]}


def measure_sensitivity(
    model: onnx.ModelProto,
    plan: QuantPlan,
    activations: Mapping[str, OnnxQParams],
    weights: Mapping[str, QuantizedWeight],
    batches: Iterable[tuple[Feed, int]],
    *,
    screen_samples: int | None = None,
    screen_fraction: float = SCREEN_FRACTION,
    refine_runs: int | None = None,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> SensitivityResult:
    """Quantize each planned tensor of `model` alone and measure the outputs (module docstring).

    Args:
        model: the prepared float model the plan was made for.
        plan: its quantization plan; every activation and weight target is measured.
        activations: ONNX parameters per planned activation (as given to InsertQDQ).
        weights: codes and parameters per planned weight (as given to InsertQDQ).
        batches: evaluation batches (feed, samples in it), streamed once.
        screen_samples: measure every tensor on this many samples only (at least; whole
            batches), the relevant ones on all (module docstring); None: every tensor on all.
        screen_fraction: relevance threshold of screening, a fraction of the worst harm.
        refine_runs: after screening, at most about this many runs (whole batches) for the
            relevant tensors; None: all samples.
        providers, threads: onnxruntime settings.
        on_batch: called with the number of samples after each batch.

    Raises:
        DataError: no batch, or onnxruntime failed on one.
        ModelError: onnxruntime cannot load the switch model.
    """
    models = _Models.build(model, plan, activations, weights)
    probe = create_session(models.probe, providers=providers, threads=threads,
                           what="sensitivity probe model")
    switch: object | None = create_session(models.switch, providers=providers, threads=threads,
                                           what="sensitivity model")
    selector = models.selector
    outputs = [o.name for o in model.graph.output] + list(models.logits)
    probes = [name for pair in models.probes.values() for name in pair]
    units = models.units
    noise = {u: _OutputNoise.empty(len(outputs), len(model.graph.output)) for u, _ in units}
    local = {u: [0.0, 0.0] for u, _ in units}
    measured = {u: 0 for u, _ in units}
    active = list(range(len(units)))  # unit indices still run; position = selector value
    refine_until: int | None = None  # samples after which the relevant tensors stop
    samples = 0
    for feed, n in batches:
        values = _run(probe, outputs + probes, feed)
        reference = values[: len(outputs)]
        probed = dict(zip(probes, values[len(outputs):]))
        del values
        for tensor, (plain, faked) in models.probes.items():
            x = probed[plain].astype(np.float64, copy=False).ravel()
            d = x - probed[faked].astype(np.float64, copy=False).ravel()
            local[tensor][0] += float(x @ x)
            local[tensor][1] += float(d @ d)
        del probed
        for k, unit in enumerate(active):
            tensor = units[unit][0]
            quantized = _run(switch, outputs, {**feed, selector: np.array(k, np.int64)})
            noise[tensor].add(reference, quantized)
            measured[tensor] += n
        samples += n
        if on_batch is not None:
            on_batch(n)
        if refine_until is not None and samples >= refine_until and active:
            logger.info("sensitivity: refinement budget spent after %d samples", samples)
            active, switch = [], None
        if screen_samples is not None and samples >= screen_samples and len(active) == len(units):
            relevant = _relevant(units, noise, screen_fraction)
            if refine_runs is not None:
                refine_until = samples + refine_runs // max(len(relevant), 1)
            if len(relevant) < len(active):
                logger.info("sensitivity: %d of %d tensors relevant after %d samples",
                            len(relevant), len(units), samples)
                active, switch = relevant, None  # release the large session first
                if active:
                    rebuilt, selector = models.switch_for(active)
                    switch = create_session(rebuilt, providers=providers, threads=threads,
                                            what="sensitivity model")
            screen_samples = None
    if samples == 0:
        raise DataError("sensitivity data has no samples")
    found = [
        noise[tensor].result(tensor, role, local[tensor][0], local[tensor][1], measured[tensor])
        for tensor, role in units
    ]
    found.sort(key=lambda s: (-s.harm, -s.noise_ratio, s.tensor))
    return SensitivityResult(samples, tuple(found))


def _relevant(units: tuple[tuple[str, str], ...], noise: Mapping[str, _OutputNoise],
              fraction: float) -> list[int]:
    """Indices of the units whose harm so far passes the screening thresholds."""
    harms = [noise[tensor].harm() for tensor, _ in units]
    worst = max(harms, default=0.0)
    bar = max(fraction * worst, _NEGLIGIBLE)
    return [k for k, harm in enumerate(harms) if harm > 0.0 and harm >= bar]


# ---------------------------------------------------------------------------- accumulation


@dataclass
class _OutputNoise:
    signal: list[float]
    noise: list[float]
    agree: list[int]
    rows: list[int]
    classifier: list[bool] = field(default_factory=list)
    real: int = 0  # the first `real` are model outputs, the rest softmax logits

    @classmethod
    def empty(cls, outputs: int, real: int) -> _OutputNoise:
        return cls([0.0] * outputs, [0.0] * outputs, [0] * outputs, [0] * outputs,
                   [True] * outputs, real)

    def add(self, reference: list[np.ndarray], quantized: list[np.ndarray]) -> None:
        for i, (x, y) in enumerate(zip(reference, quantized)):
            x64 = np.asarray(x, dtype=np.float64).ravel()
            d = x64 - np.asarray(y, dtype=np.float64).ravel()
            self.signal[i] += float(x64 @ x64)
            self.noise[i] += float(d @ d)
            self.classifier[i] = self.classifier[i] and is_classifier_like(np.shape(x))
            if self.classifier[i]:
                self.agree[i] += int(np.sum(np.argmax(x, -1) == np.argmax(y, -1)))
                self.rows[i] += int(np.shape(x)[0])

    def worst_ratio(self, logits: bool = False) -> float:
        chosen = slice(self.real, None) if logits else slice(0, self.real)
        ratios = [n / s if s > 0 else (0.0 if n == 0 else math.inf)
                  for s, n in zip(self.signal[chosen], self.noise[chosen])]
        return max(ratios, default=0.0)

    def harm(self) -> float:
        return self.worst_ratio(logits=len(self.signal) > self.real)

    def result(self, tensor: str, role: str, local_signal: float,
               local_noise: float, samples: int | None = None) -> TensorSensitivity:
        worst = self.worst_ratio()
        agreements = [a / r for a, r, c in zip(self.agree[:self.real], self.rows[:self.real],
                                                 self.classifier[:self.real]) if c and r]
        return TensorSensitivity(
            tensor=tensor,
            role=role,
            output_sqnr_db=_db(worst),
            noise_ratio=worst,
            top1_agreement=min(agreements) if agreements else None,
            local_sqnr_db=_db(local_noise / local_signal if local_signal > 0 else
                              (0.0 if local_noise == 0 else math.inf)),
            samples=samples,
            logit_noise_ratio=self.worst_ratio(logits=True) if len(self.signal) > self.real
            else None,
        )


def _db(noise_ratio: float) -> float | None:
    if noise_ratio == 0.0:
        return None
    if math.isinf(noise_ratio):
        return -math.inf
    return -10.0 * math.log10(noise_ratio)


def _round(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None if value is None or math.isnan(value) else (-1e9 if value < 0 else 1e9)
    return float(f"{value:.6g}")


def _run(session: object, names: list[str], feed: Feed) -> list[np.ndarray]:
    try:
        return session.run(names, dict(feed))  # type: ignore[attr-defined, no-any-return]
    except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"onnxruntime failed on a sensitivity batch: {message}") from None


# ---------------------------------------------------------------------------- the two models


@dataclass(frozen=True)
class _Models:
    """The probe model (fake-quants as extra outputs) and the switch model (one If per tensor)."""

    probe: onnx.ModelProto
    switch: onnx.ModelProto
    selector: str  # int64 scalar input of the switch model: the unit to quantize
    units: tuple[tuple[str, str], ...]  # (tensor, role); the index is the selector value
    probes: Mapping[str, tuple[str, str]]  # tensor -> (float output, fake-quant output)
    chains: _Chains
    consumers: tuple[tuple[str, ...], ...]  # per unit: the nodes reading it quantized
    logits: tuple[str, ...]  # softmax inputs of softmax outputs, extra outputs of both models

    def switch_for(self, subset: list[int]) -> tuple[onnx.ModelProto, str]:
        """A switch model for the units `subset` alone; selector value k quantizes subset[k]."""
        return self.chains.switch_model([(self.units[k][0], self.consumers[k]) for k in subset])

    @classmethod
    def build(
        cls,
        model: onnx.ModelProto,
        plan: QuantPlan,
        activations: Mapping[str, OnnxQParams],
        weights: Mapping[str, QuantizedWeight],
    ) -> _Models:
        logits = _softmax_logits(model)
        if logits:
            exposed = onnx.ModelProto()
            exposed.CopyFrom(model)
            types = element_types(model.graph)
            exposed.graph.output.extend(
                helper.make_tensor_value_info(t, types.get(t, TensorProto.FLOAT), None)
                for t in logits)
            model = exposed
        chains = _Chains(model)
        units: list[tuple[str, str, tuple[str, ...]]] = []
        for target in sorted(plan.activations, key=lambda t: t.tensor):
            if not target.consumers:
                continue  # nothing reads it quantized: InsertQDQ writes no pair either
            chains.add_activation(target.tensor, activations[target.tensor])
            units.append((target.tensor, "activation", target.consumers))
        readers: dict[str, list[str]] = {}
        for weight in plan.weights:
            readers.setdefault(weight.tensor, []).append(weight.node)
        for tensor in sorted(readers):
            chains.add_weight(tensor, weights[tensor])
            units.append((tensor, "weight", tuple(readers[tensor])))
        probe, probes = chains.probe_model()
        switch, selector = chains.switch_model([(t, c) for t, _, c in units])
        return cls(probe, switch, selector, tuple((t, r) for t, r, _ in units), probes, chains,
                   tuple(c for _, _, c in units), tuple(logits))


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
        """The float model where unit k's consumers read ``If(selector == k, fq(t), t)``.

        If runs only the branch it takes, so a run costs about one float inference whichever
        tensor is quantized.
        """
        out = self._copy()
        graph = out.graph
        selector = self._names.allocate("qcal_sensitivity_unit")
        graph.input.append(helper.make_tensor_value_info(selector, TensorProto.INT64, []))
        index = UseIndex.build(graph)
        after: dict[str, list[onnx.NodeProto]] = {}
        before: list[onnx.NodeProto] = []
        for k, (tensor, consumers) in enumerate(units):
            chain = self._chains[tensor]
            nodes: list[onnx.NodeProto] = []
            unit = self._const(f"{tensor}_unit", np.array(k, np.int64), graph)
            chosen = self._node(nodes, "Equal", [selector, unit], f"{tensor}_chosen")
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
