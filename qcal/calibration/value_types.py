"""Element types and shapes that onnx's inference cannot give, from onnxruntime's own.

onnx's shape inference knows the operators of the ONNX domains only. In a model that
onnxruntime's optimizer has already fused (com.microsoft's Attention, SkipLayerNormalization,
FastGelu, FusedMatMul, as `onnxruntime.transformers` and optimum write them), every value after
the first such operator is left untyped, and qcal quantizes no value of unknown type: a GPT-2
so written kept 10 of its 11 MatMul/Gemm float. onnxruntime resolves the same graph with the
schemas of every operator it runs, so a session whose outputs are those values, created and
never run, gives their types and shapes.

And the other way round: onnx's data propagation can state dimensions that are wrong (a CANINE
exported by torch: an attention Transpose's [b, 4, 32, S] stated [b, 32, S, 4]), and onnxruntime
then refuses the model it checks them against, where it loads the user's model. Those stated
dimensions are dropped (`drop_refused_shapes`), the element types kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from qcal.calibration.runtime import create_session
from qcal.graph.model import PrepStep
from qcal.graph.structure import DEFAULT_DOMAINS, all_graphs, element_types
from qcal.numerics.errors import QcalError

__all__ = ["complete_value_types", "drop_refused_shapes", "onnxruntime_steps"]


def onnxruntime_steps(
    model: onnx.ModelProto, *, providers: Sequence[str] = ("CPUExecutionProvider",)
) -> list[PrepStep]:
    """The preparation steps from onnxruntime's view of `model`, in place: the stated shapes it
    refuses dropped (`drop_refused_shapes`), then the element types onnx's inference left
    unknown given (`complete_value_types`)."""
    dropped = drop_refused_shapes(model, providers=providers)
    typed = complete_value_types(model, providers=providers)
    return [PrepStep(name, detail) for name, detail in (
        ("onnxruntime-shapes", dropped), ("onnxruntime-types", typed)) if detail]


def complete_value_types(
    model: onnx.ModelProto, *, providers: Sequence[str] = ("CPUExecutionProvider",)
) -> str | None:
    """Type, in place, the main-graph values onnx's inference left untyped (behind an operator
    of another domain, or where its inference stopped), from onnxruntime's resolution of the
    graph. Returns what it did (a preparation step's detail), or None when there was nothing to
    do (a session is created only then) or onnxruntime could not say (the values then stay
    untyped, and float)."""
    graph = model.graph
    known = element_types(graph)
    missing = sorted({v for node in graph.node for v in node.output if v and v not in known})
    if not missing:
        return None
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=v) for v in missing if v not in present)
    try:
        session = create_session(probe, providers=tuple(providers), threads=1,
                                 what="model (typing its values)", optimize=False)
    except QcalError:
        return None  # the run itself will say what onnxruntime cannot load
    del probe
    typed, wanted = 0, set(missing)
    for value in session.get_outputs():
        elem_type = _element_type(value.type)
        if value.name not in wanted or elem_type is None:
            continue
        # onnxruntime says [] for a value it has no shape for (an ai.onnx.ml Scaler's output)
        # as for a scalar: declared rank 0, the value's readers would refuse it.
        shape = None if not value.shape else [
            d if isinstance(d, (int, str)) else None for d in value.shape]
        graph.value_info.append(onnx.helper.make_tensor_value_info(value.name, elem_type, shape))
        typed += 1
    if not typed:
        return None
    domains = sorted({n.domain for n in graph.node if n.domain not in DEFAULT_DOMAINS})
    where = f" (operators of {', '.join(domains)})" if domains else ""
    return f"element types of {typed} values onnx's shape inference left unknown{where}, " \
           "from onnxruntime"


def _element_type(ort_type: str) -> int | None:
    """TensorProto's element type for onnxruntime's 'tensor(float)', ...; None for others."""
    if not ort_type.startswith("tensor(") or not ort_type.endswith(")"):
        return None
    name = ort_type[len("tensor("):-1].upper()
    try:
        return int(onnx.TensorProto.DataType.Value(name))
    except ValueError:
        return None


def drop_refused_shapes(
    model: onnx.ModelProto, *, providers: Sequence[str] = ("CPUExecutionProvider",)
) -> str | None:
    """Clear, in place, the dimensions stated for intermediate values (every graph's value_info;
    their element types stay) when onnxruntime refuses the model as stated and loads it
    without them (module docstring). Returns what it did, or None: the model loaded as it was,
    or fails either way (the run then says why)."""
    try:
        create_session(model, providers=tuple(providers), threads=1, what="model",
                       optimize=False)
        return None
    except QcalError as err:
        refused = str(err).splitlines()[0]
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    _clear_dimensions(bare)
    try:
        create_session(bare, providers=tuple(providers), threads=1, what="model",
                       optimize=False)
    except QcalError:
        return None
    del bare
    _clear_dimensions(model)
    return ("dimensions onnx's shape inference stated for intermediate values dropped: "
            f"onnxruntime refused them ({refused})")


def _clear_dimensions(model: onnx.ModelProto) -> None:
    """Drop the shapes every graph's value_info states (their element types stay)."""
    for graph in all_graphs(model.graph):
        for value in graph.value_info:
            value.type.tensor_type.ClearField("shape")
