"""qcal never hands over a model onnxruntime cannot load or run.

The quantized model is opened and run once on one calibration sample, with the session options
of the evaluation. When onnxruntime refuses it (a kernel missing for a quantized form, a Q/DQ
pair where an operator wants its exact float value), the node it names is kept float and the
model is built again; the node's decision in the report says why. A failure that names no node
of the model, or that persists, is a clear ModelError (exit 4), never an internal error.

A model onnxruntime runs may still not run where qcal planned integer kernels: onnxruntime fuses
DequantizeLinear -> Conv/MatMul/Gemm -> QuantizeLinear only in the forms its kernels support
(no ConvTranspose on the CPU provider; a Conv writing a graph output gets a pair of its own
for it, `qcal.graph.qdq`), and otherwise runs
the node in float on dequantized weights, every run, with the input's Quantize/Dequantize on
top: slower than the float model, and counted as quantized when it is not.
So the graph onnxruntime will run (after its fusions) is read back once, and every planned weight
it still dequantizes into a float Conv, ConvTranspose, MatMul or Gemm is kept float with its
node: what qcal reports as quantized is what runs in integers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qcal.accuracy.evaluate import COMPARE_THREADS
from qcal.accuracy.restrict import restrict_plan
from qcal.calibration.runtime import create_session
from qcal.graph.integer_kernels import QUANTIZE_SEES_THROUGH, integer_output_writers
from qcal.graph.model import NodeDecision, QuantPlan
from qcal.graph.structure import DEFAULT_DOMAINS, UseIndex, all_graphs
from qcal.numerics.errors import ModelError, one_line

__all__ = ["NO_INTEGER_FORM", "Runnable", "make_runnable", "noted_as_integer",
           "quantized_by_onnxruntime"]

_MAX_REPAIRS = 8  # nodes kept float one at a time; more means the cause is not one node
_MAX_READ_BACKS = 3  # each keeps every node found float at once: more rounds find nothing new
_NODE_NAMES = (
    re.compile(r"Name:'([^']+)'"),
    re.compile(r"node with name '([^']+)'"),
    re.compile(r"Node \(([^)]+)\)", re.IGNORECASE),  # "in node (pool)" too
    re.compile(r"node ([^\s:]+):", re.IGNORECASE),
)
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Float compute operators of onnxruntime's optimized graph (its own fused forms included).
_FLOAT_COMPUTE_OPS = frozenset(
    {"Conv", "FusedConv", "ConvTranspose", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"}
)
NO_INTEGER_FORM = "kept float: onnxruntime runs it in float on dequantized weights"
_FLOAT_REASON = (f"{NO_INTEGER_FORM} (no integer kernel for this form), so Q/DQ would only add "
                 "work")


@dataclass(frozen=True)
class Runnable:
    """A quantized model onnxruntime runs, the plan it was built from, and the nodes kept float
    to get there (node -> onnxruntime's message)."""

    model: onnx.ModelProto
    plan: QuantPlan
    repaired: Mapping[str, str]
    # The session that ran `model`, still open (the evaluation's options): the evaluation can
    # use it instead of building the same session again.
    session: Any = field(default=None, compare=False, repr=False)


def make_runnable(
    float_model: onnx.ModelProto,
    plan: QuantPlan,
    build: Callable[[QuantPlan], onnx.ModelProto],
    feed: Mapping[str, np.ndarray],
    *,
    providers: tuple[str, ...],
    replan: Callable[[frozenset[str]], QuantPlan] | None = None,
) -> Runnable:
    """Build the model of `plan` (for `float_model`); while onnxruntime cannot run it on `feed`,
    keep the node it names float and build again. With `replan` (placement for speed, not
    emulation: the plan again with these nodes left float), also keep float the nodes
    onnxruntime would run in float on dequantized weights (module docstring): planned again
    without them, so that what they read stays quantized for the integer kernels writing it."""
    repaired: dict[str, str] = {}
    writers: dict[str, str] | None = None  # found at the first repair, for every one after
    model = build(plan)
    # Read-backs left: keeping a node float can leave another without integer readers or
    # writers (a Conv whose only readers were the Convs of an If branch), so the plan made
    # without them is read back again.
    read_backs = 0 if replan is None else _MAX_READ_BACKS
    for _ in range(_MAX_REPAIRS + _MAX_READ_BACKS + 1):
        failure, session, optimized = _run_failure(
            model, feed, providers, read_back=read_backs > 0)
        if failure is None and optimized is not None:
            read_backs -= 1
            stray = _float_anchors(optimized, plan)
            if stray:  # built again without them, and run once more
                assert replan is not None
                nodes = frozenset(stray.values())
                repaired.update(dict.fromkeys(sorted(nodes), _FLOAT_REASON))
                plan = _within(replan(frozenset(repaired)), plan, nodes)
                model = build(plan)
                continue
        if failure is None:
            return Runnable(model, plan, repaired, session)
        node = _culprit(float_model, model, failure, plan)
        if node is None or node in repaired or len(repaired) == _MAX_REPAIRS:
            raise ModelError(f"onnxruntime cannot run the quantized model: {failure}")
        repaired[node] = failure
        reason = f"kept float: onnxruntime cannot run it quantized ({_short(failure)})"
        keep = dict.fromkeys(_tensors_of(plan, float_model, node), reason)
        if writers is None:
            writers = integer_output_writers(float_model.graph)
        plan = restrict_plan(plan, keep, writers)
        model = build(plan)
    raise AssertionError("unreachable")  # pragma: no cover


def _run_failure(
    model: onnx.ModelProto, feed: Mapping[str, np.ndarray], providers: tuple[str, ...],
    *, read_back: bool,
) -> tuple[str | None, Any, onnx.ModelProto | None]:
    """(None, the open session, the graph onnxruntime runs when `read_back`) when onnxruntime
    runs `model` on `feed`, else (why, None, None)."""
    with tempfile.TemporaryDirectory(prefix="qcal-") as folder:
        optimized_path = Path(folder) / "optimized.onnx" if read_back else None
        try:
            session = create_session(model, providers=providers, threads=COMPARE_THREADS,
                                     what="quantized model", optimized_to=optimized_path)
            names = [o.name for o in session.get_outputs()]
            session.run(names, dict(feed))
        except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
            if read_back:  # writing the optimized graph out may be what failed: judge without
                return _run_failure(model, feed, providers, read_back=False)
            if isinstance(err, ModelError):
                return str(err), None, None
            return one_line(err), None, None
        optimized = None
        if optimized_path is not None and optimized_path.is_file():  # its weights stay there
            try:
                optimized = onnx.load(str(optimized_path), load_external_data=False)
            except Exception:  # noqa: BLE001  a graph onnx cannot read back: no check, no harm
                optimized = None
    return None, session, optimized


def _float_anchors(optimized: onnx.ModelProto, plan: QuantPlan) -> dict[str, str]:
    """Planned weight -> its node, for the weights that onnxruntime's optimized graph still
    dequantizes into a float compute node (the QDQ writer names a weight's codes
    ``<weight>_quantized``), through the Casts it adds where a float16 model's kernels take
    float32, in the main graph and in the bodies of If, Loop and Scan (where it fuses nothing
    that crosses the body's edge)."""
    codes = {f"{w.tensor}_quantized": w for w in plan.weights}
    graphs = list(all_graphs(optimized.graph))
    producers = {out: node for graph in graphs for node in graph.node for out in node.output}
    found: dict[str, str] = {}
    for node in (n for graph in graphs for n in graph.node):
        if node.op_type not in _FLOAT_COMPUTE_OPS:
            continue
        for value in node.input:
            source = producers.get(value)
            while source is not None and source.op_type == "Cast" and source.input:
                source = producers.get(source.input[0])
            if (source is not None and source.op_type == "DequantizeLinear"
                    and source.input and source.input[0] in codes):
                weight = codes[source.input[0]]
                found[weight.tensor] = weight.node
    return found


def quantized_by_onnxruntime(model: onnx.ModelProto) -> list[str]:
    """The float Conv and Gemm nodes of `model`'s main graph that onnxruntime quantizes itself
    when it loads the model (its WeightBiasQuantization): the weight a float initializer, the
    input from a per-tensor DequantizeLinear, the output going, one reader at a time through
    Relu/Clip or what onnxruntime moves a QuantizeLinear up through (`QUANTIZE_SEES_THROUGH`,
    as placement predicts it), to a QuantizeLinear, a bias (if any) a 1-D initializer. Their weights are
    quantized per tensor and they run as integer kernels, whatever the plan says: a node kept
    float between quantized neighbours is not float. (It quantizes a ConvTranspose's weight
    too, but the CPU provider has no integer kernel to run it: that one stays float.)"""
    graph = model.graph
    index = UseIndex.build(graph)
    floats = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    found = []
    for node in graph.node:
        if (node.op_type not in ("Conv", "Gemm")
                or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2
                or node.input[1] not in floats):
            continue
        source = index.producer.get(node.input[0])
        if source is None or source.op_type != "DequantizeLinear" or len(source.input) < 2:
            continue
        scale = index.constant(source.input[1])
        if scale is None or math.prod(scale.dims) != 1:
            continue
        if len(node.input) > 2 and node.input[2]:
            bias = index.constant(node.input[2])
            if bias is None or len(bias.dims) != 1:
                continue
        if _runs_into_quantize(node, index):
            found.append(node.name)
    return found


_SELF_QUANTIZED = ("onnxruntime quantizes its weight itself when it loads the model (per "
                   "tensor: its input arrives dequantized and its output goes straight to a "
                   "QuantizeLinear), so it runs as an integer kernel")


def noted_as_integer(plan: QuantPlan, nodes: Iterable[str]) -> tuple[QuantPlan, str | None]:
    """`plan` with the decisions of `nodes` (from `quantized_by_onnxruntime`) saying so, and
    the warning for the report (None without such nodes)."""
    names = sorted(set(nodes))
    if not names:
        return plan, None
    decisions = tuple(
        NodeDecision(d.node, d.op_type, d.quantized, f"{d.reason}; {_SELF_QUANTIZED}")
        if d.node in names else d for d in plan.nodes)
    shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
    warning = (f"onnxruntime quantizes {len(names)} Conv/Gemm node{'s' * (len(names) != 1)} "
               f"that qcal keeps float ({shown}) itself when it loads the model, weights per "
               "tensor: each reads a dequantized input and writes straight to a QuantizeLinear; "
               "keeping its input or output tensor float (--exclude-tensors) keeps it float")
    return dataclasses.replace(plan, nodes=decisions), warning


def _runs_into_quantize(node: onnx.NodeProto, index: UseIndex) -> bool:
    if len(node.output) != 1 or not node.output[0]:
        return False
    _, reader = index.follow(node.output[0], QUANTIZE_SEES_THROUGH)
    return reader is not None and reader.op_type == "QuantizeLinear"


def _within(replanned: QuantPlan, plan: QuantPlan, floated: frozenset[str]) -> QuantPlan:
    """`replanned` (the plan made again with the `floated` nodes left float) within what `plan`
    quantizes: a target `plan` had dropped (no statistics, ...) stays dropped, a node it kept
    float keeps its reason, a node both quantize keeps `plan`'s reason (which says what
    calibration left float around it), and the `floated` nodes get theirs."""
    activations = {a.tensor for a in plan.activations}
    weights = {(w.tensor, w.node) for w in plan.weights}
    biases = {(b.tensor, b.node) for b in plan.biases}
    before = {d.node: d for d in plan.nodes}
    decisions = []
    for decision in replanned.nodes:
        old = before.get(decision.node)
        if decision.node in floated:
            decision = NodeDecision(decision.node, decision.op_type, False, _FLOAT_REASON)
        elif old is not None and (not old.quantized or decision.quantized):
            decision = old
        decisions.append(decision)
    return QuantPlan(
        activations=tuple(a for a in replanned.activations if a.tensor in activations),
        weights=tuple(w for w in replanned.weights if (w.tensor, w.node) in weights),
        biases=tuple(b for b in replanned.biases if (b.tensor, b.node) in biases),
        nodes=tuple(decisions),
        integer_forms=plan.integer_forms,
    )


def _culprit(
    float_model: onnx.ModelProto, model: onnx.ModelProto, message: str, plan: QuantPlan
) -> str | None:
    """The node `message` blames, when Q/DQ touches it: a node of the model reading or writing a
    quantized tensor (or quantized itself), named directly, through one of its Q/DQ nodes, or
    through a node named after it (onnxruntime's fusions, the writer's integer forms)."""
    nodes = {n.name: n for g in all_graphs(model.graph) for n in g.node}
    planned = sorted((d.node for d in plan.nodes if d.quantized), key=len, reverse=True)
    for pattern in _NODE_NAMES:
        for name in pattern.findall(message):
            node = nodes.get(name)
            if node is not None and node.op_type in _QDQ_OPS:
                owner = _owner_of_pair(node, nodes.values(), plan)
                if owner is not None:
                    return owner
            elif node is not None and _tensors_of(plan, float_model, name):
                return str(name)
            else:  # a node onnxruntime fused ("<name>_token_7") or one the writer spelled a
                # quantized node in ("<name>_slope_Conv"): named after that node
                owner = next((p for p in planned if name.startswith(f"{p}_")), None)
                if owner is not None:
                    return owner
    return None


def _owner_of_pair(qdq: onnx.NodeProto, nodes: Iterable[onnx.NodeProto], plan: QuantPlan) -> str | None:
    """The quantized node of `plan` reading the output of the Q/DQ node `qdq`."""
    planned = {d.node for d in plan.nodes if d.quantized}
    for node in nodes:
        if node.name in planned and set(qdq.output) & set(node.input):
            return str(node.name)
    return None


def _tensors_of(plan: QuantPlan, model: onnx.ModelProto, node: str) -> set[str]:
    """Every tensor of `node` that `plan` quantizes: its inputs (for it or for another reader:
    either way it reads them through Q/DQ), its weights, and the activations it writes."""
    values = {v for g in all_graphs(model.graph) for n in g.node if n.name == node
              for v in (*n.input, *n.output)}
    tensors = {a.tensor for a in plan.activations if node in a.consumers or a.tensor in values}
    tensors |= {w.tensor for w in plan.weights if w.node == node}
    return tensors


def _short(message: str, limit: int = 160) -> str:
    """onnxruntime's own words, without its prefix and source location."""
    _, _, status = message.partition("Status Message: ")
    text = re.sub(r"^\S+\.(?:h|cc|cpp):\d+ \S+ ", "", status or message)
    return text if len(text) <= limit else text[: limit - 3] + "..."
