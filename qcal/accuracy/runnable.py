"""qcal never hands over a model onnxruntime cannot load or run.

The quantized model is opened and run once on one calibration sample, with the session options
of the evaluation. When onnxruntime refuses it (a kernel missing for a quantized form, a Q/DQ
pair where an operator wants its exact float value), the node it names is kept float and the
model is built again; the node's decision in the report says why. A failure that names no node
of the model, or that persists, is a clear ModelError (exit 4), never an internal error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from qcal.accuracy.restrict import restrict_plan
from qcal.calibration.runtime import create_session
from qcal.graph.model import QuantPlan
from qcal.graph.structure import all_graphs
from qcal.numerics.errors import ModelError

__all__ = ["Runnable", "make_runnable"]

_MAX_REPAIRS = 8  # nodes kept float one at a time; more means the cause is not one node
_NODE_NAMES = (
    re.compile(r"Name:'([^']+)'"),
    re.compile(r"node with name '([^']+)'"),
    re.compile(r"Node \(([^)]+)\)"),
    re.compile(r"node ([^\s:]+):", re.IGNORECASE),
)
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


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
    threads: int,
) -> Runnable:
    """Build the model of `plan` (for `float_model`); while onnxruntime cannot run it on `feed`,
    keep the node it names float and build again."""
    repaired: dict[str, str] = {}
    model = build(plan)
    for _ in range(_MAX_REPAIRS + 1):
        failure, session = _run_failure(model, feed, providers, threads)
        if failure is None:
            return Runnable(model, plan, repaired, session)
        node = _culprit(float_model, model, failure, plan)
        if node is None or node in repaired or len(repaired) == _MAX_REPAIRS:
            raise ModelError(f"onnxruntime cannot run the quantized model: {failure}")
        repaired[node] = failure
        reason = f"kept float: onnxruntime cannot run it quantized ({_short(failure)})"
        plan = restrict_plan(plan, dict.fromkeys(_tensors_of(plan, float_model, node), reason))
        model = build(plan)
    raise AssertionError("unreachable")  # pragma: no cover


def _run_failure(
    model: onnx.ModelProto, feed: Mapping[str, np.ndarray], providers: tuple[str, ...],
    threads: int,
) -> tuple[str | None, Any]:
    """(None, the open session) when onnxruntime runs `model` on `feed`, else (why, None)."""
    try:
        session = create_session(model, providers=providers, threads=threads,
                                 what="quantized model")
        names = [o.name for o in session.get_outputs()]
        session.run(names, dict(feed))
    except ModelError as err:
        return str(err), None
    except Exception as err:  # noqa: BLE001  onnxruntime raises its own untyped exceptions
        text = str(err).strip()
        return (" ".join(text.split()) if text else type(err).__name__), None
    return None, session


def _culprit(
    float_model: onnx.ModelProto, model: onnx.ModelProto, message: str, plan: QuantPlan
) -> str | None:
    """The node `message` blames, when Q/DQ touches it: a node of the model reading or writing a
    quantized tensor (or quantized itself), named directly or through one of its Q/DQ nodes."""
    nodes = {n.name: n for g in all_graphs(model.graph) for n in g.node}
    for pattern in _NODE_NAMES:
        for name in pattern.findall(message):
            node = nodes.get(name)
            if node is not None and node.op_type in _QDQ_OPS:
                owner = _owner_of_pair(node, nodes.values(), plan)
                if owner is not None:
                    return owner
            elif node is not None and _tensors_of(plan, float_model, name):
                return str(name)
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
