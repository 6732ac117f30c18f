"""The qparams stage of a run: observers and weights turned into TensorRecords (what the
report says of each tensor) and QuantizedWeights (the codes InsertQDQ writes).

Activations take their range from their observer through the preset's recipe (a tensor that
shares another's parameters takes them, divided when the plan says so); weights are observed
and quantized here, large ones a block at a time; biases are read back from the written graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx

from qcal.calibration.hessians import HessianTarget, LayerInputs, hessian_target
from qcal.config import CalibrationConfig
from qcal.graph.files.large import WeightFile, tensor_array
from qcal.graph.model import ActivationTarget, QuantPlan
from qcal.graph.qdq import InsertQDQ, QuantizedWeight
from qcal.graph.structure import FLOAT_TYPES, all_graphs
from qcal.numerics import fakequant
from qcal.numerics.bias_correction import output_mean_shift
from qcal.numerics.errors import ConfigError, DataError, EmptyStatisticsError, ModelError
from qcal.numerics.gptq import gptq_weight
from qcal.numerics.observers import MinMaxStats, Observer, PerChannel, PerTensor
from qcal.numerics.onnx_mapping import OnnxQParams
from qcal.numerics.presets import TensorRecipe
from qcal.numerics.ranges import RangeChoice, choose_range, new_observer
from qcal.numerics.schemes import QParams
from qcal.report import TensorRecord

# Range selections run at once: the calibration's own two cores (see qcal.calibration.collect).
_RANGE_WORKERS = 2


def _activation_observer(recipe: TensorRecipe, config: CalibrationConfig, tensor: str) -> Observer:
    return new_observer(recipe, config.method_for(tensor), PerTensor())


def _activation_records(
    plan: QuantPlan, observers: Mapping[str, Observer], recipe: TensorRecipe,
    config: CalibrationConfig, opset: int, *, output_side: frozenset[str] = frozenset(),
) -> dict[str, TensorRecord]:
    """Each observed activation's range and parameters (`output_side`: see `choose_range`),
    and those of the tensors that share another's."""
    records: dict[str, TensorRecord] = {}

    def choose(tensor: str) -> RangeChoice | None:
        try:
            return choose_range(observers[tensor], recipe, config.method_for(tensor),
                                config.histogram_settings(),
                                percentile=config.percentile_for(tensor),
                                output_side=tensor in output_side)
        except EmptyStatisticsError:
            return None  # received no values: the caller leaves it float
        except DataError as err:
            raise type(err)(f"tensor {tensor!r}: {err}") from None

    observed = [t.tensor for t in plan.activations if t.tensor in observers]
    # Each range is a function of its own statistics alone: chosen on both cores (the
    # histogram searches spend their time in numpy, outside the GIL), used in plan order.
    with ThreadPoolExecutor(max_workers=_RANGE_WORKERS, thread_name_prefix="qcal-range") as pool:
        choices = dict(zip(observed, pool.map(choose, observed)))
    for target in plan.activations:
        if target.tensor not in observers:
            continue  # takes the parameters of `target.same_as`, below
        method = config.method_for(target.tensor)
        choice = choices[target.tensor]
        if choice is None:
            continue
        qparams = recipe.qparams(choice.stats)
        records[target.tensor] = TensorRecord(
            tensor=target.tensor, role="activation", method=method, choice=choice,
            qparams=qparams, onnx=recipe.to_onnx(qparams, opset=opset), consumers=target.consumers,
        )
    for target in plan.activations:
        source = records.get(target.same_as or "")
        if target.tensor in records or source is None or source.choice is None:
            continue  # observed itself, or its source received no values (both stay float)
        summary = {**source.choice.summary, "same_as": source.tensor}
        if target.divisor == 1.0:
            records[target.tensor] = dataclasses.replace(
                source, tensor=target.tensor, consumers=target.consumers,
                choice=RangeChoice(source.choice.observed, source.choice.stats, summary),
            )
            continue
        # The source divided by a positive constant: its range divided by it, through the
        # preset's own scheme (whose scale then is the source's divided by it, up to rounding).
        summary["divided_by"] = target.divisor
        choice = RangeChoice(
            _divided(source.choice.observed, target.divisor),
            _divided(source.choice.stats, target.divisor),
            summary,
        )
        qparams = recipe.qparams(choice.stats)
        records[target.tensor] = dataclasses.replace(
            source, tensor=target.tensor, consumers=target.consumers, choice=choice,
            qparams=qparams, onnx=recipe.to_onnx(qparams, opset=opset),
        )
    return records


# A range spanning fewer steps than this share of the integer grid has lost more than four
# bits: only the preset's floor on the step (PyTorch's eps, 2^-23) does that to a range of
# its own, on tensors whose values are all below about 3e-5.
_FEWEST_STEPS_SHARE = 1 / 16


def unrepresentable_ranges(
    records: Mapping[str, TensorRecord], recipe: TensorRecipe
) -> dict[str, str]:
    """Activations whose values the preset's smallest step cannot tell apart -> why; they
    stay float (quantized, they would be all but constant, their readers' signal gone). Only
    a scale at that floor counts: a softmax's output whose step its fixed range sets spans few
    steps by design."""
    tiny = np.float32(1e-30)
    floor = float(np.max(recipe.qparams(MinMaxStats(-tiny, tiny)).scale))
    found: dict[str, str] = {}
    for name, record in records.items():
        choice, qparams = record.choice, record.qparams
        if choice is None or qparams is None:
            continue
        if "same_as" in choice.summary and "divided_by" not in choice.summary:
            continue  # a copy of another tensor's parameters: judged with it, below
        observed = float(np.max(choice.observed.max - choice.observed.min))
        span = np.asarray(choice.stats.max, np.float64) - np.asarray(choice.stats.min, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale (a constant 0)
            steps = float(np.max(span / np.asarray(qparams.scale, np.float64)))
        grid = qparams.quant_max - qparams.quant_min
        at_floor = float(np.max(qparams.scale)) <= floor * (1 + 1e-6)
        if observed > 0 and at_floor and steps < grid * _FEWEST_STEPS_SHARE:
            found[name] = (
                f"its values span {observed:.3g}, {steps:.3g} of the {grid} steps of the "
                f"smallest scale the preset allows ({float(np.min(qparams.scale)):.3g}): "
                "quantized, they would be all but constant")
    for name, record in records.items():  # tensors with a copy of such a tensor's parameters
        summary = record.choice.summary if record.choice is not None else {}
        if summary.get("same_as") in found and "divided_by" not in summary:
            found[name] = found[summary["same_as"]]
    return found


def _divided(stats: MinMaxStats, divisor: float) -> MinMaxStats:
    return MinMaxStats(
        (stats.min / np.float32(divisor)).astype(np.float32),
        (stats.max / np.float32(divisor)).astype(np.float32),
    )


def _observed(target: ActivationTarget, config: CalibrationConfig) -> bool:
    """Whether `target` gets an observer: a shared output does not, unless configured itself."""
    return target.same_as is None or target.tensor in config.tensors


def _quantize_weights(
    model: onnx.ModelProto, plan: QuantPlan, recipe: TensorRecipe, config: CalibrationConfig,
    opset: int, *, operand_recipe: TensorRecipe | None = None,
    layer_inputs: Mapping[str, LayerInputs] | None = None,
) -> tuple[dict[str, QuantizedWeight], dict[str, TensorRecord]]:
    """Codes and records of the planned weights; "operand" constants use `operand_recipe`.

    A weight whose node was measured in `layer_inputs` (keyed by node) gets GPTQ codes where
    its Hessian was measured (`layer_input_targets`), and its bias a correction with
    `config.bias_correction`.
    """
    nodes = {n.name: n for n in model.graph.node}
    # If/Loop/Scan bodies hold initializers too (their Constant nodes become initializers).
    initializers = {i.name: i for g in all_graphs(model.graph) for i in g.initializer}
    weights: dict[str, QuantizedWeight] = {}
    records: dict[str, TensorRecord] = {}
    weight_recipe = recipe
    for target in plan.weights:
        recipe = operand_recipe if target.role == "operand" and operand_recipe else weight_recipe
        array = tensor_array(initializers[target.tensor])
        array = array.astype(np.float32, copy=False)
        granularity = _weight_granularity(recipe, target.axis, config.per_channel)
        observer = new_observer(recipe, "minmax", granularity)
        try:
            observer.update(array)
            choice = choose_range(observer, recipe, "minmax", config.histogram_settings())
        except DataError as err:  # a weight is part of the model, not of the data
            raise ModelError(f"weight {target.tensor!r}: {err}") from None
        qparams = recipe.qparams(choice.stats)
        onnx_qparams = recipe.to_onnx(qparams, opset=opset)
        codes = _quantize_in_blocks(recipe, array, qparams, opset)
        measured = (layer_inputs or {}).get(target.node) if target.role == "weight" else None
        node = nodes.get(target.node)
        row_axis = None if node is None else _row_axis(node, qparams, array.ndim)
        rounded = shift = None
        if measured is not None and node is not None and row_axis is not None:
            if measured.hessian is not None:
                rounded = gptq_weight(
                    array, row_axis=row_axis, groups=measured.hessian.shape[0],
                    hessian=measured.hessian,
                    quantize=_column_quantizer(recipe, qparams, onnx_qparams),
                    scale=onnx_qparams.scale, zero_point=onnx_qparams.zero_point, nearest=codes)
                codes = rounded.codes
            if config.bias_correction and measured.count > 0:
                shift = output_mean_shift(
                    array, codes, row_axis=row_axis, scale=onnx_qparams.scale,
                    zero_point=onnx_qparams.zero_point, input_means=measured.means(),
                    real_means=measured.real_means())
        weights[target.tensor] = QuantizedWeight(codes=codes, onnx=onnx_qparams, bias_shift=shift)
        records[target.tensor] = TensorRecord(
            tensor=target.tensor, role="weight", method="minmax", choice=choice,
            qparams=qparams, onnx=onnx_qparams, consumers=(target.node,),
            rounding=None if rounded is None else {
                "method": "gptq", "output_error_nearest": rounded.error_nearest,
                "output_error": rounded.error_gptq},
            bias_shift=None if shift is None else float(np.max(np.abs(shift), initial=0.0)),
        )
    return weights, records


def _column_quantizer(
    recipe: TensorRecipe, qparams: QParams, onnx_qparams: OnnxQParams
) -> Callable[[np.ndarray], np.ndarray]:
    """The preset's own rounding and limits, with the ONNX parameters worked out once."""

    def quantize(column: np.ndarray) -> np.ndarray:
        return fakequant.quantize(column, qparams, recipe.scheme, onnx_qparams)

    return quantize


def _row_axis(node: onnx.NodeProto, qparams: QParams, ndim: int) -> int | None:
    """The axis of `node`'s weight that holds its output channels (Conv 0, MatMul 1, Gemm by
    transB); None where the weight's parameters run along another axis (per channel along its
    inputs): GPTQ and bias correction then leave it alone."""
    if node.op_type not in ("Conv", "MatMul", "Gemm"):
        return None
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)
    row_axis = 1 if node.op_type == "MatMul" or (node.op_type == "Gemm" and not trans_b) else 0
    if qparams.axis is not None and qparams.axis % ndim != row_axis:
        return None
    return row_axis


def layer_input_targets(
    model: onnx.ModelProto, plan: QuantPlan, act_params: Mapping[str, OnnxQParams],
    config: CalibrationConfig,
) -> list[HessianTarget]:
    """What the second pass over the calibration data measures: the inputs of the planned
    Conv/MatMul/Gemm weights of the main graph whose input is quantized per tensor, their
    Hessians where `config` rounds the layer's weights with GPTQ, else only their sums where
    bias correction has a bias to correct. Empty: the pass has nothing to do and does not run."""
    nodes = {n.name: n for n in model.graph.node}
    initializers = {i.name: i for i in model.graph.initializer}
    added_biases = {b.anchor for b in plan.biases if b.anchor}  # MatMuls an Add gives a bias
    targets = []
    for weight in plan.weights:
        node = nodes.get(weight.node)
        if (weight.role != "weight" or node is None or weight.tensor not in initializers
                or node.op_type not in ("Conv", "MatMul", "Gemm") or len(node.input) < 2
                or node.input[1] != weight.tensor or node.input[0] not in act_params):
            continue
        gptq = config.rounds_with_gptq(node.op_type)
        has_bias = len(node.input) > 2 or node.name in added_biases
        if not gptq and not (config.bias_correction and has_bias):
            continue
        target = hessian_target(node, list(initializers[weight.tensor].dims),
                                act_params[node.input[0]], products=gptq)
        if target is not None:
            targets.append(target)
    return targets


def _bias_records(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, TensorRecord]:
    """What the QDQ writer made of each planned bias, read back from the written graph."""
    graphs = list(all_graphs(model.graph))  # biases of If/Loop/Scan bodies too
    producers = {out: node for g in graphs for node in g.node for out in node.output}
    consumers = {node.name: node for g in graphs for node in g.node}
    initializers = {i.name: i for g in graphs for i in g.initializer}
    records: dict[str, TensorRecord] = {}
    for bias in plan.biases:
        node = consumers.get(bias.node)
        # The bias is the input the node reads from int32 codes (a Conv/Gemm's input 2, either
        # input of an Add after a MatMul); none when it was left float.
        dq = next((p for p in (producers.get(v) for v in node.input) if p is not None
                   and p.op_type == "DequantizeLinear" and _int32_codes(p, initializers)),
                  None) if node is not None else None
        if dq is None:
            continue  # left float (its input or weight is not quantized)
        scale = onnx.numpy_helper.to_array(initializers[dq.input[1]]).astype(np.float32)
        zero_point = onnx.numpy_helper.to_array(initializers[dq.input[2]])
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None) if scale.ndim else None
        records[bias.tensor] = TensorRecord(
            tensor=bias.tensor, role="bias", method="derived: input scale x weight scale",
            choice=None, qparams=None,
            onnx=OnnxQParams(
                dtype=onnx.TensorProto.INT32, scale=scale, zero_point=zero_point, axis=axis,
                clip_min=None, clip_max=None, exact=True, deviations=(), replacement=None,
                min_opset=13 if scale.ndim else 10,
            ),
            consumers=(bias.node,),
        )
    return records


def _int32_codes(dequantize: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> bool:
    codes = initializers.get(dequantize.input[0])
    return codes is not None and codes.data_type == onnx.TensorProto.INT32


_QUANTIZE_BLOCK_ELEMENTS = 2**23


def _quantize_in_blocks(
    recipe: TensorRecipe, array: np.ndarray, qparams: QParams, opset: int
) -> np.ndarray:
    """`recipe.quantize`, a block of slices at a time along an axis that is not the channel
    axis: quantizing is elementwise, and whole, a large weight would need several float64
    temporaries of its size."""
    if array.size <= _QUANTIZE_BLOCK_ELEMENTS or array.ndim < 2:
        return recipe.quantize(array, qparams, opset=opset)
    channel = None if qparams.axis is None else qparams.axis % array.ndim
    along = 0 if channel != 0 else 1
    step = max(1, _QUANTIZE_BLOCK_ELEMENTS * array.shape[along] // array.size)
    codes: np.ndarray | None = None  # filled in place: a list of blocks would double it
    for start in range(0, array.shape[along], step):
        where = tuple(slice(start, start + step) if axis == along else slice(None)
                      for axis in range(array.ndim))
        block = recipe.quantize(array[where], qparams, opset=opset)
        if codes is None:
            codes = np.empty(array.shape, dtype=block.dtype)
        codes[where] = block
    assert codes is not None  # array.size > 0 here
    return codes


def _weight_granularity(recipe: TensorRecipe, axis: int | None, per_channel: bool) -> PerTensor | PerChannel:
    if not per_channel or axis is None:
        return PerTensor()
    allowed = recipe.per_channel_axes
    if allowed == "any" or (isinstance(allowed, tuple) and axis in allowed):
        return PerChannel(axis)
    return PerTensor()


def _planned_records(
    records: Mapping[str, TensorRecord], plan: QuantPlan, model: onnx.ModelProto
) -> dict[str, TensorRecord]:
    """The records of what the restricted plan still quantizes, biases read back from `model`."""
    kept = {a.tensor for a in plan.activations} | {w.tensor for w in plan.weights}
    found = {name: r for name, r in records.items() if name in kept and r.role != "bias"}
    found.update(_bias_records(model, plan))
    return found


def build_quantized(
    prepared: onnx.ModelProto, act_params: Mapping[str, OnnxQParams],
    weights: Mapping[str, QuantizedWeight], weight_file: WeightFile | None, plan: QuantPlan,
    *, declared_shapes: frozenset[str],
) -> onnx.ModelProto:
    """The model as written: `prepared` with the plan's Q/DQ, stating the shapes the user's
    model states (`declared_shapes`, see `qcal.graph.structure.keep_declared_shapes`)."""
    built = InsertQDQ(plan, act_params, weights, declared_shapes=declared_shapes)(prepared).model
    if weight_file is not None:  # its weight codes go to a file too
        built = weight_file.offload(built)
    return built


def blame_nan_weights(model: onnx.ModelProto) -> None:
    """Raise ModelError naming the first float initializer that holds a NaN (checked only once
    calibration met a NaN: weights are read once more, on that path alone)."""
    for tensor in model.graph.initializer:
        if tensor.data_type in FLOAT_TYPES:
            values = tensor_array(tensor)
            if np.isnan(values).any():
                raise ModelError(f"weight {tensor.name!r} holds NaN: the model computes NaN "
                                 "whatever the data")


def refuse_non_finite_scales(records: Mapping[str, TensorRecord], preset: str) -> None:
    """ConfigError naming the first tensor whose framework scale is not finite: the preset's
    grid cannot hold its values (one code: a 1-bit signed grid with a narrow range)."""
    for name in sorted(records):
        qparams = records[name].qparams
        if qparams is not None and not np.all(np.isfinite(np.asarray(qparams.scale))):
            raise ConfigError(
                f"preset {preset!r}: the scale of tensor {name!r} is not finite "
                f"({np.asarray(qparams.scale).ravel()[0]:g}): the preset's grid is too narrow "
                "for it (more bits, or another preset option)")
