"""The float model: its inputs, preparation for quantization, and the plan of what to
quantize. (Loading it is `qcal.graph.files.load`.)

* `model_inputs` lists the inputs a calibration sample must feed.
* `prepare_model` runs the preparation passes of `qcal.graph.passes` on a copy and reports each step.
* `plan_quantization` (in `qcal.graph.plan`, public here) applies the per-operator rules of
  `OP_RULES` and the user's selection to decide, for every node, whether it is quantized and
  which tensors get Q/DQ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx

from qcal.graph.passes import (
    ConstantsToInitializers,
    ConvTransposeAsConv,
    EliminateIdentity,
    FoldBatchNorm,
    FoldConstantShapes,
    FoldConstantWeights,
    FoldInputAffine,
    FoldPad,
    InferShapes,
    InitializersNotInputs,
    InlineFunctions,
    LowerEinsum,
    NameNodes,
    PoolSpatialMeans,
    PrepPass,
    ShuffleAsGather,
    SumAsAdd,
    UnshareBiases,
    UpgradeOpset,
    WidenHalf,
)
from qcal.graph.plan import (
    OP_RULES,
    OP_RULES_DOC,
    ActivationTarget,
    BiasTarget,
    NodeDecision,
    OpRule,
    QuantPlan,
    SelectionRules,
    WeightTarget,
    leave_unobserved_float,
    plan_quantization,
    rules_table,
)
from qcal.graph.structure import check_wiring
from qcal.graph.training_mode import refuse_random_dropout
from qcal.numerics.errors import ModelError, QcalError

__all__ = [
    "OP_RULES",
    "OP_RULES_DOC",
    "ActivationTarget",
    "BiasTarget",
    "InputSpec",
    "NodeDecision",
    "OpRule",
    "PrepStep",
    "QuantPlan",
    "SelectionRules",
    "WeightTarget",
    "leave_unobserved_float",
    "model_inputs",
    "plan_quantization",
    "prepare_model",
    "rules_table",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSpec:
    """One model input a calibration sample must provide.

    Attributes:
        name: the graph input's name.
        dtype: numpy dtype of its element type.
        shape: per dimension an int (fixed), a str (symbolic) or None (unknown).
    """

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a calibration sample must feed: graph inputs that are not initializers.

    Raises:
        ModelError: naming the input when it is not a tensor, has no element type or rank, or
            is bfloat16 (no feed can hold it); when the model declares no outputs, or an output
            of bfloat16 (nor can a result).
    """
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if not value.type.HasField("tensor_type"):
            kind = value.type.WhichOneof("value") or "no type"
            raise ModelError(
                f"model input {value.name!r} is a {kind}; only tensor inputs are supported"
            )
        tensor_type = value.type.tensor_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        except (KeyError, ValueError, TypeError):
            raise ModelError(
                f"model input {value.name!r} has no usable element type ({tensor_type.elem_type})"
            ) from None
        if tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
            # numpy has no bfloat16, and onnxruntime's Python API takes no ml_dtypes array
            raise ModelError(
                f"model input {value.name!r} is bfloat16, which cannot be fed through onnxruntime's "
                "Python API, so qcal cannot run this model (float32 and float16 inputs can be: a "
                "Cast from float32 at the input makes it one)")
        if not tensor_type.HasField("shape"):
            raise ModelError(f"model input {value.name!r} has no shape (unknown rank)")
        shape = tuple(_dimension(d) for d in tensor_type.shape.dim)
        specs.append(InputSpec(name=value.name, dtype=np.dtype(dtype), shape=shape))
    if not model.graph.output:
        raise ModelError("the model declares no outputs: there is nothing to calibrate")
    for value in model.graph.output:
        if value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
            raise ModelError(
                f"model output {value.name!r} is bfloat16, which onnxruntime's Python API cannot "
                "return, so qcal cannot run this model (a Cast to float32 at the output makes "
                "it float32)")
    return specs


def _dimension(dim: onnx.TensorShapeProto.Dimension) -> int | str | None:
    if dim.HasField("dim_value"):
        # Some exporters (PaddlePaddle) write -1 for a dynamic dim; onnxruntime reads it as unknown.
        return int(dim.dim_value) if dim.dim_value >= 0 else None
    if dim.HasField("dim_param") and dim.dim_param:
        return dim.dim_param
    return None


# -------------------------------------------------------------------------------- preparation


@dataclass(frozen=True)
class PrepStep:
    """One thing model preparation did (or could not do).

    Attributes:
        name: the pass: "upgrade-opset", "name-nodes", "constants-to-initializers",
            "eliminate-identity", "fold-batchnorm", "fold-pad", "infer-shapes", ...
        detail: a human sentence: "opset 11 -> 13", "folded 3 BatchNormalizations into Conv".
    """

    name: str
    detail: str


def prepare_model(
    model: onnx.ModelProto, *, min_opset: int = 13, in_place: bool = False,
    for_speed: bool = False,
) -> tuple[onnx.ModelProto, list[PrepStep]]:
    """A copy of `model` ready to quantize, and the steps that changed it.

    Passes, in order: inline-functions (model-local functions), upgrade-opset (to `min_opset`
    when below: per-axis Q/DQ needs 13, int4/int16 need 21), initializers-not-inputs,
    name-nodes, constants-to-initializers, eliminate-identity, widen-half, lower-einsum,
    fold-constant-shapes, fold-constant-weights, fold-batchnorm, fold-pad, fold-input-affine,
    unshare-biases, sum-as-add, infer-shapes, pool-spatial-means and shuffle-as-gather (after
    shape inference: they read ranks and dimensions); with `for_speed` (Q/DQ placed for
    onnxruntime's integer kernels, not to emulate a target), conv-transpose-as-conv before
    infer-shapes. Each step that did something (or could not complete, as shape inference may)
    is reported. `model` itself is never changed, unless `in_place`
    (which saves a copy of the weights when the caller has no further use for `model`).

    A model with float16 or bfloat16 tensors is computed in float32 inside (widen-half, after
    eliminate-identity), its inputs and outputs cast at the edges: onnxruntime's integer kernels
    take float32 graphs only.

    Raises:
        ModelError: naming the step, when the model is malformed or a step cannot do its job.
        ConfigError: when `min_opset` is not an opset the installed onnx knows.
    """
    passes: list[PrepPass] = [
        InlineFunctions(),
        UpgradeOpset(min_opset),
        InitializersNotInputs(),
        NameNodes(),
        ConstantsToInitializers(),
        EliminateIdentity(),
        WidenHalf(),
        LowerEinsum(),
        FoldConstantShapes(),
        FoldConstantWeights(),
        FoldBatchNorm(),
        FoldPad(),
        FoldInputAffine(),
        UnshareBiases(),
        SumAsAdd(),
        *([ConvTransposeAsConv()] if for_speed else []),
        InferShapes(),
        PoolSpatialMeans(),
        ShuffleAsGather(),
    ]
    work = model
    if not in_place:
        work = onnx.ModelProto()
        work.CopyFrom(model)
    problem = check_wiring(work.graph)
    if problem is not None:
        raise ModelError(f"cannot prepare the model: {problem}")
    refuse_random_dropout(work.graph)
    steps: list[PrepStep] = []
    done: list[str] = []
    for prep in passes:
        try:
            result = prep(work)
        except ModelError as err:
            raise ModelError(f"{prep.name}: {err}") from None
        work = result.model
        problem = check_wiring(work.graph)
        if problem is not None:  # a bug in the pass, not in the model
            after = f" (after {', '.join(done)})" if done else ""
            raise QcalError(f"preparation step {prep.name}{after} broke the graph: {problem}")
        done.append(prep.name)
        if result.detail:
            steps.append(PrepStep(prep.name, result.detail))
            logger.info("%s: %s", prep.name, result.detail)
    return work, steps


