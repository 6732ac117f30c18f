"""`calibrate`: the whole run, stage after stage, with each stage's work done by its own module.

config -> model (load, prepare, plan) -> data -> collect (observers) -> qparams -> qdq -> evaluate
-> report. Everything cheap is checked before onnxruntime starts: options, preset, model, data
headers and output paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qcal import data as data_mod
from qcal.collect import collect
from qcal.config import CalibrationConfig
from qcal.errors import ConfigError, DataError
from qcal.evaluate import Comparison, compare_models
from qcal.files import check_output_path, write_atomic
from qcal.model import (
    LoadedModel,
    PrepStep,
    QuantPlan,
    SelectionRules,
    load_model,
    model_inputs,
    plan_quantization,
    prepare_model,
)
from qcal.observers import Observer, PerChannel, PerTensor
from qcal.onnx_mapping import OnnxQParams
from qcal.presets import TensorRecipe, build_preset
from qcal.qdq import InsertQDQ, QuantizedWeight
from qcal.ranges import choose_range, new_observer
from qcal.report import TensorRecord, build_report

__all__ = [
    "CalibrationResult", "Progress", "calibrate", "default_output_paths", "load_labels",
    "plan_model",
]

Progress = Callable[[str, int, "int | None"], None]
"""Called as progress(stage, samples_done_since_last_call, total_samples_or_None)."""


@dataclass(frozen=True)
class CalibrationResult:
    model: onnx.ModelProto
    report: dict[str, Any]
    comparison: Comparison | None
    output: Path | None
    report_path: Path | None


@dataclass
class _Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - started, 6)


def default_output_paths(model_path: Path, cwd: Path | None = None) -> tuple[Path, Path]:
    """`<stem>.qdq.onnx` and `<stem>.qcal.json` in the current directory (never beside the input)."""
    base = cwd or Path.cwd()
    return base / f"{model_path.stem}.qdq.onnx", base / f"{model_path.stem}.qcal.json"


def _selection_rules(config: CalibrationConfig) -> SelectionRules:
    skipped = {name for name, o in config.tensors.items() if o.skip}
    return SelectionRules(
        op_types=frozenset(config.op_types) if config.op_types else None,
        exclude_op_types=frozenset(config.exclude_op_types),
        exclude_nodes=tuple(config.exclude_nodes),
        exclude_tensors=frozenset(config.exclude_tensors) | skipped,
        per_channel=config.per_channel,
    )


def _eval_source_path(config: CalibrationConfig, model_path: Path) -> Path | None:
    if config.eval_data is not None:
        return config.eval_data
    beside = model_path.with_name(f"{model_path.stem}.eval.npz")
    return beside if beside.is_file() and config.synthetic is None else None


def _labels_path(config: CalibrationConfig, eval_path: Path | None) -> Path | None:
    if config.labels is not None:
        return config.labels
    if eval_path is None or eval_path.is_dir():
        return None
    beside = eval_path.with_name(f"{eval_path.stem}.labels.npy")
    return beside if beside.is_file() else None


def load_labels(path: Path) -> np.ndarray:
    """Integer class labels, one per sample, from a .npy file (never unpickled)."""
    try:
        labels = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: labels file not found") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read labels ({err})") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    return np.asarray(labels, dtype=np.int64)


def calibrate(
    model_path: Path,
    config: CalibrationConfig,
    *,
    output: Path | None = None,
    report_path: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> CalibrationResult:
    """Calibrate the model at `model_path`; write the QDQ model and report when paths are given."""
    timings = _Timings()
    with timings.stage("validate"):
        preset = build_preset(config.preset, config.preset_options)
        loaded = load_model(model_path)
        prepared, steps = prepare_model(loaded.model, min_opset=config.opset)
        opset = _default_opset(prepared)
        inputs = model_inputs(prepared)
        calib = data_mod.open_data(
            config.data, model_path=model_path, inputs=inputs, synthetic=config.synthetic,
            limit=config.limit, seed=config.seed,
        )
        data_mod.validate_data(calib, inputs)
        eval_path = _eval_source_path(config, model_path)
        eval_source = None
        if eval_path is not None:
            eval_source = data_mod.open_data(eval_path, model_path=model_path, inputs=inputs)
            data_mod.validate_data(eval_source, inputs)
        labels_path = _labels_path(config, eval_path)
        labels = load_labels(labels_path) if labels_path is not None else None
        plan = plan_quantization(prepared, _selection_rules(config))
        _check_overrides(config, plan)
        written = [p for p in (output, report_path) if p is not None]
        # No output may replace a file the run reads, --force or not.
        read = [model_path, *loaded.external_files]
        read += [p for p in (calib.path, eval_path, labels_path) if p is not None]
        for path, what in ((output, "output"), (report_path, "report")):
            if path is not None:
                check_output_path(path, inputs=read, force=force, what=what)
        if len(written) == 2 and written[0].resolve() == written[1].resolve():
            raise ConfigError(f"report: {report_path} is the same path as the output")

    with timings.stage("collect"):
        observers = {t.tensor: _activation_observer(preset.activation, config, t.tensor)
                     for t in plan.activations}
        summary = collect(
            prepared, observers,
            data_mod.iter_batches(calib, inputs, config.batch_size),
            providers=config.providers, threads=config.threads,
            on_batch=_stage_progress(progress, "calibrate", calib.num_samples()),
        )

    with timings.stage("qparams"):
        records = _activation_records(plan, observers, preset.activation, config, opset)
        weights, weight_records = _quantize_weights(prepared, plan, preset.weight, config, opset)
        records.update(weight_records)

    with timings.stage("qdq"):
        act_params = {name: rec.onnx for name, rec in records.items() if rec.role == "activation"}
        result = InsertQDQ(plan, act_params, weights)(prepared)
        quant_model = result.model
        records.update(_bias_records(quant_model, plan))

    comparison = None
    with timings.stage("evaluate"):
        source = eval_source if eval_source is not None else calib
        comparison = compare_models(
            prepared, quant_model, data_mod.iter_batches(source, inputs, config.batch_size),
            labels=labels if eval_source is not None or config.labels else None,
            providers=config.providers, threads=config.threads,
            on_batch=_stage_progress(progress, "evaluate", source.num_samples()),
        )

    model_bytes = quant_model.SerializeToString()
    report = build_report(
        config=config, preset=preset, loaded=loaded, steps=steps, plan=plan, records=records,
        calib=calib, calib_samples=summary.samples, eval_source=eval_source,
        labels_path=labels_path, comparison=comparison, output=output, model_bytes=model_bytes,
        timings=timings.seconds,
    )
    if output is not None:
        write_atomic(output, model_bytes)
    if report_path is not None:
        from qcal.report import dump_report

        write_atomic(report_path, dump_report(report))
    return CalibrationResult(quant_model, report, comparison, output, report_path)


def _default_opset(model: onnx.ModelProto) -> int:
    return int(next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))


def _stage_progress(progress: Progress | None, stage: str, total: int | None) -> Callable[[int], None] | None:
    if progress is None:
        return None
    progress(stage, 0, total)
    return lambda n: progress(stage, n, total)


def _check_overrides(config: CalibrationConfig, plan: QuantPlan) -> None:
    known = {t.tensor for t in plan.activations}
    for name, override in sorted(config.tensors.items()):
        if override.method is not None and name not in known:
            raise ConfigError(f"tensors.{name}: not a quantized activation of this model")


def _activation_observer(recipe: TensorRecipe, config: CalibrationConfig, tensor: str) -> Observer:
    return new_observer(recipe, config.method_for(tensor), PerTensor(), config)


def _activation_records(
    plan: QuantPlan, observers: Mapping[str, Observer], recipe: TensorRecipe,
    config: CalibrationConfig, opset: int,
) -> dict[str, TensorRecord]:
    records: dict[str, TensorRecord] = {}
    for target in plan.activations:
        method = config.method_for(target.tensor)
        try:
            choice = choose_range(observers[target.tensor], recipe, method, config,
                                  percentile=config.percentile_for(target.tensor))
        except DataError as err:
            raise type(err)(f"tensor {target.tensor!r}: {err}") from None
        qparams = recipe.qparams(choice.stats)
        records[target.tensor] = TensorRecord(
            tensor=target.tensor, role="activation", method=method, choice=choice,
            qparams=qparams, onnx=recipe.to_onnx(qparams, opset=opset), consumers=target.consumers,
        )
    return records


def _quantize_weights(
    model: onnx.ModelProto, plan: QuantPlan, recipe: TensorRecipe, config: CalibrationConfig,
    opset: int,
) -> tuple[dict[str, QuantizedWeight], dict[str, TensorRecord]]:
    initializers = {i.name: i for i in model.graph.initializer}
    weights: dict[str, QuantizedWeight] = {}
    records: dict[str, TensorRecord] = {}
    for target in plan.weights:
        array = onnx.numpy_helper.to_array(initializers[target.tensor]).astype(np.float32)
        granularity = _weight_granularity(recipe, target.axis, config.per_channel)
        observer = new_observer(recipe, "minmax", granularity, config)
        try:
            observer.update(array)
            choice = choose_range(observer, recipe, "minmax", config)
        except DataError as err:
            raise type(err)(f"weight {target.tensor!r}: {err}") from None
        qparams = recipe.qparams(choice.stats)
        onnx_qparams = recipe.to_onnx(qparams, opset=opset)
        codes = recipe.quantize(array, qparams, opset=opset)
        weights[target.tensor] = QuantizedWeight(codes=codes, onnx=onnx_qparams)
        records[target.tensor] = TensorRecord(
            tensor=target.tensor, role="weight", method="minmax", choice=choice,
            qparams=qparams, onnx=onnx_qparams, consumers=(target.node,),
        )
    return weights, records


def _bias_records(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, TensorRecord]:
    """What the QDQ writer made of each planned bias, read back from the written graph."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers = {node.name: node for node in graph.node}
    initializers = {i.name: i for i in graph.initializer}
    records: dict[str, TensorRecord] = {}
    for bias in plan.biases:
        node = consumers.get(bias.node)
        dq = producers.get(node.input[2]) if node is not None and len(node.input) > 2 else None
        if dq is None or dq.op_type != "DequantizeLinear":
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


def _weight_granularity(recipe: TensorRecipe, axis: int | None, per_channel: bool) -> PerTensor | PerChannel:
    if not per_channel or axis is None:
        return PerTensor()
    allowed = recipe.per_channel_axes
    if allowed == "any" or (isinstance(allowed, tuple) and axis in allowed):
        return PerChannel(axis)
    return PerTensor()


def plan_model(model_path: Path, config: CalibrationConfig) -> tuple[LoadedModel, onnx.ModelProto, list[PrepStep], QuantPlan]:
    loaded = load_model(model_path)
    prepared, steps = prepare_model(loaded.model, min_opset=config.opset)
    return loaded, prepared, steps, plan_quantization(prepared, _selection_rules(config))

