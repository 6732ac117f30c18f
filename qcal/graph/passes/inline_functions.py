"""Pass: the calls of model-local functions are replaced by the nodes of their bodies.

onnxscript writes the ``@script`` functions a model calls as model-local functions
(``model.functions``): the main graph then holds calls such as ``ConvBlock`` in a domain of the
model's own, and the Conv, MatMul and Gemm inside are out of reach of every later pass and of
the plan: such a model came out with its convolutions float and a coverage that counted only
the Gemm outside the calls. onnxruntime inlines them when it loads the model; inlined here, qcal
sees what onnxruntime runs. The model computes what it did.
"""

from __future__ import annotations

from typing import ClassVar

import onnx

# onnx's C++ inliner itself: it takes and returns serialized models
from onnx.onnx_cpp2py_export import inliner

from qcal.graph.files.large import run_detached
from qcal.graph.passes._base import StepResult
from qcal.graph.structure import all_graphs
from qcal.numerics.errors import ModelError

__all__ = ["InlineFunctions"]


class InlineFunctions:
    """Inline every call of a model-local function (recursively, in subgraphs too); a body
    written for another opset than the model's is converted to the model's opset."""

    name: ClassVar[str] = "inline-functions"

    def __call__(self, model: onnx.ModelProto) -> StepResult:
        if not model.functions:
            return StepResult(model, False)
        local = {(f.domain, f.name) for f in model.functions}
        calls = sum(1 for node in _nodes(model) if (node.domain, node.op_type) in local)

        def inline(data: onnx.ModelProto | bytes) -> onnx.ModelProto:
            if isinstance(data, onnx.ModelProto):
                data = data.SerializeToString()
            return onnx.load_from_string(inliner.inline_local_functions(data, True))

        try:
            inlined = run_detached(model, inline, what="function inlining")
        except (RuntimeError, ValueError, onnx.checker.ValidationError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(f"cannot inline the model's local functions: {first}") from None
        # the domains only the functions were called in go with them
        gone = {domain for domain, _ in local} - {n.domain for n in _nodes(inlined)}
        keep = [o for o in inlined.opset_import
                if o.domain in ("", "ai.onnx") or o.domain not in gone]
        del inlined.opset_import[:]
        inlined.opset_import.extend(keep)
        count = len(local)
        functions = f"{count} local function{'s' * (count != 1)}"
        if not calls:
            return StepResult(inlined, True, f"dropped {functions} that nothing calls")
        return StepResult(inlined, True,
                          f"inlined {calls} call{'s' * (calls != 1)} of {functions}")


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node of the model's graph and its subgraphs."""
    return [node for graph in all_graphs(model.graph) for node in graph.node]
