"""`calibrate`: the whole run, stage after stage, with each stage's work done by its own module.

config -> model (load, prepare, plan) -> data -> collect (observers) -> qparams -> qdq -> evaluate
-> report. Everything cheap is checked before onnxruntime starts: options, preset, model, data
headers and output paths.

The supporting steps live beside it: `qcal._inputs` resolves and checks what the run reads,
`qcal._quantize_tensors` turns observers and weights into records and codes (the qparams stage),
`qcal._accuracy_stage` checks the accuracy floor and runs the fallback, `qcal._stages` holds the
progress callback and the stage timings.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import onnx

from qcal._accuracy_stage import (
    _Accuracy,
    _compute_macs,
    _confirm_samples,
    _confirmation,
    _improve_accuracy,
)
from qcal._inputs import (
    _accuracy_sources,
    _check_agreement_options,
    _check_overrides,
    _eval_source_path,
    _exact_runs,
    _labels_path,
    _min_opset,
    _replan,
    _selection_rules,
    check_outputs,
    data_described,
    load_labels,
    with_product_sizes,
)
from qcal._quantize_tensors import (
    _activation_observer,
    _activation_records,
    _bias_records,
    _observed,
    _planned_records,
    _quantize_weights,
    blame_nan_weights,
    build_quantized,
    layer_input_targets,
    refuse_non_finite_scales,
    unrepresentable_ranges,
)
from qcal._reuse import reuse_statistics
from qcal._stages import Progress, _stage_progress, _Timings
from qcal._transforms import apply_transforms
from qcal._users_model import (
    PREPARED_CHECK_SAMPLES,
    prepared_model_drift,
    time_against_users_model,
)
from qcal._weight_only import (
    WeightOnlyResult,
    check_weight_only_config,
    quantize_weight_only,
    weight_only_plan,
)
from qcal.accuracy.coverage import measure_coverage
from qcal.accuracy.evaluate import Comparison, compare_models, numeric_outputs
from qcal.accuracy.gates import GateResult, check_gates, raise_for_failed
from qcal.accuracy.reference import FloatReference
from qcal.accuracy.runnable import make_runnable, noted_as_integer, quantized_by_onnxruntime
from qcal.calibration import data as data_mod
from qcal.calibration.collect import CollectionSummary, OutputSink, collect
from qcal.calibration.hessians import collect_hessians
from qcal.calibration.statistics import Statistics
from qcal.calibration.value_types import onnxruntime_steps
from qcal.config import CalibrationConfig
from qcal.graph.files.atomic import check_output_path, stage_file
from qcal.graph.files.large import (
    WeightFile,
    load_external_data,
    weight_bytes,
)
from qcal.graph.files.load import LoadedModel, load_model
from qcal.graph.files.save import data_path, needs_external_data, stage_model, weights_in_files
from qcal.graph.model import (
    PrepStep,
    QuantPlan,
    leave_unobserved_float,
    model_inputs,
    plan_quantization,
    prepare_model,
)
from qcal.graph.output_side import output_side_tensors
from qcal.graph.random_draws import random_draws_note
from qcal.graph.structure import default_opset
from qcal.graph.training_mode import batch_statistics_note
from qcal.numerics.errors import ConfigError, DataError, OutputError
from qcal.numerics.presets import build_preset
from qcal.report import build_report, dump_report

__all__ = [
    "CalibrationResult", "Progress", "calibrate", "default_output_paths", "load_labels",
    "plan_model", "report_beside",
]



@dataclass(frozen=True)
class CalibrationResult:
    model: onnx.ModelProto
    report: dict[str, Any]
    comparison: Comparison | None
    output: Path | None
    report_path: Path | None
    gates: tuple[GateResult, ...] = ()



def default_output_paths(model_path: Path, cwd: Path | None = None) -> tuple[Path, Path]:
    """`<stem>.qdq.onnx` and `<stem>.qcal.json` in the current directory (never beside the input)."""
    output = (cwd or Path.cwd()) / f"{model_path.stem}.qdq.onnx"
    return output, report_beside(output)


def report_beside(output: Path) -> Path:
    """The report of a model written to `output`, beside it (`out/m.int8.onnx` ->
    `out/m.int8.qcal.json`, `m.qdq.onnx` -> `m.qcal.json`): each report sits with its model."""
    stem = output.name.removesuffix(".onnx").removesuffix(".qdq")
    return output.with_name(f"{stem}.qcal.json")


def calibrate(
    model_path: Path,
    config: CalibrationConfig,
    *,
    output: Path | None = None,
    report_path: Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
    enforce_gates: bool = True,
    statistics: Path | Statistics | None = None,
) -> CalibrationResult:
    """Calibrate the model at `model_path`; write the QDQ model and report when paths are given.

    With `enforce_gates` (the default), a failed accuracy or coverage gate raises
    AccuracyGateError after both files are written; otherwise the caller checks
    `CalibrationResult.gates` (the CLI does, after printing its summary). With `statistics`,
    the observers come from that statistics or ranges file (`qcal collect`), or from statistics
    collected elsewhere for this run (on Ray), and the model does not run to collect them.
    """
    timings = _Timings()
    with timings.stage("validate"):
        preset = build_preset(config.preset, config.preset_options)
        # Before the model loads (a large one takes seconds and gigabytes): the outputs against
        # the files known now; once loaded, against its external data files too (below).
        check_outputs((output, report_path), [model_path], force)
        loaded = load_model(model_path)
        # A large model is calibrated with its large weights in files (its own external data,
        # or a temporary file for those in memory): onnxruntime maps them and qcal reads one
        # at a time, so memory stays close to one copy of the weights. The user's model is
        # kept as given (the prepared-model gate and the timing run it at the end), its
        # weights in the same files: a BERT-base read again there took 2.0 GB at its peak.
        weight_file = WeightFile() if weights_in_files(loaded.model) else None
        users = loaded.model if weight_file is None else weight_file.offload(loaded.model)
        prepared, steps = prepare_model(users, min_opset=_min_opset(config),
                                        for_speed=config.places_for_speed)
        if weight_file is None and weights_in_files(prepared):  # float16 weights widened
            weight_file = WeightFile()
        if weight_file is not None:  # the weights the preparation wrote (folds) go there too
            prepared = weight_file.offload(prepared)
        loaded = dataclasses.replace(loaded, model=prepared)  # only its path and hash are read
        steps += onnxruntime_steps(prepared, providers=config.providers)
        # a model that imports no ai.onnx opset (ai.onnx.ml only) gets Q/DQ at the one asked for
        opset = default_opset(prepared) or config.opset
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
        # The samples ranked by their content: what is held out, and the samples checks and
        # shape probes run on, are the same whatever order the data comes in. The first few
        # are kept from that pass for the checks that run on them.
        order = data_mod.content_order(calib, keep=PREPARED_CHECK_SAMPLES)
        all_calib = calib
        calib, eval_source, eval_label = _accuracy_sources(config, calib, order, eval_source,
                                                           collected=statistics is not None)
        macs, body_macs = _compute_macs(prepared, all_calib, order, inputs, config)
        rules = with_product_sizes(_selection_rules(config), {**macs, **body_macs}, config)
        plan = plan_quantization(prepared, rules)
        _check_overrides(config, plan)
        reused = None if statistics is None else reuse_statistics(
            statistics, loaded.sha256, plan, preset, config)
        if statistics is not None and (config.equalize or config.smooth_quant is not None):
            raise ConfigError("equalize, smooth-quant: they change the model, so they go with no "
                              "statistics collected beforehand (--stats, --checkpoint, --ray)")
        _check_agreement_options(config, prepared)
        check_weight_only_config(config, statistics=statistics is not None)
        written = [p for p in (output, report_path) if p is not None]
        # No output may replace a file the run reads, --force or not.
        read = [model_path, *loaded.external_files]
        read += [p for p in (calib.path, eval_path, labels_path) if p is not None]
        read += [statistics] if isinstance(statistics, Path) else []
        check_outputs((output, report_path), read, force)
        if output is not None and loaded.external_files:  # written with external data too
            check_output_path(data_path(output), inputs=read, force=force, what="output data")
        if len(written) == 2 and written[0].resolve() == written[1].resolve():
            raise ConfigError(f"report: {report_path} is the same path as the output")

    config, exactness_notes = _exact_runs(prepared, calib, inputs, config, macs)
    for note_of in (batch_statistics_note, random_draws_note):
        exactness_notes += [note] if (note := note_of(prepared.graph)) else []
    calib_batches = partial(data_mod.iter_batches, calib, inputs, config.batch_size)
    # The first sample: the quantized model's runnable check (a node onnxruntime cannot run
    # quantized is kept float) and the latency measurement run on it.
    first_feed = order.leading[0]
    # Weights-only rewrites (the plan above holds): the float model keeps its outputs.
    transforms, transform_steps = apply_transforms(
        prepared, config, preset, calib_batches,
        samples=calib.num_samples(), timings=timings, progress=progress)
    steps = [*steps, *transform_steps]

    source = eval_source if eval_source is not None else calib
    reference = FloatReference()  # every evaluation below compares with the same float run
    # the calibration samples the floor met on those held out is checked on too
    # (`_confirmation`), their float outputs kept from the collection when all are
    confirm_on = _confirm_samples(calib, all_calib, order) if eval_label is not None and (
        config.fallback or config.has_fallback_target) else None
    calib_reference = FloatReference() if confirm_on is calib else None
    # evaluated on the calibration data, or confirmed on it: its float outputs come from there
    kept_by_collection = reference if source is calib else calib_reference
    weight_only: WeightOnlyResult | None = None
    if config.weight_only is None:
        with timings.stage("collect"):
            if reused is not None:  # read from a file: the model does not run for statistics
                observers, summary = reused.observers, reused.summary
            else:
                observers = {t.tensor: _activation_observer(preset.activation, config, t.tensor)
                             for t in plan.activations if _observed(t, config)}
                try:
                    summary = collect(
                        prepared, observers, calib_batches(),
                        providers=config.providers, threads=config.threads,
                        on_batch=_stage_progress(progress, "calibrate", calib.num_samples()),
                        expected_samples=calib.num_samples(),
                        outputs=None if kept_by_collection is None else
                        _output_sink(prepared, kept_by_collection),
                        name_samples=partial(data_mod.name_samples, calib),
                    )
                except DataError as err:
                    blame_nan_weights(prepared)  # a NaN inside the model is the model's fault
                    raise DataError(f"{data_described(calib)}: {err}") from None

        with timings.stage("qparams"):
            records = _activation_records(plan, observers, preset.activation, config, opset,
                                          output_side=output_side_tensors(prepared.graph))
            # Tensors that received no values (If branches not taken, ...) stay float, and so
            # do those whose values are below the preset's smallest step.
            unobserved = {t.tensor for t in plan.activations} - records.keys()
            unrepresentable = unrepresentable_ranges(records, preset.activation)
            for name in unrepresentable:
                del records[name]
            plan = leave_unobserved_float(prepared, plan, unobserved, unrepresentable)
            act_params = {name: rec.onnx for name, rec in records.items()}  # activations only yet
            targets = layer_input_targets(prepared, plan, act_params, config)
        layer_inputs = None
        if targets:  # GPTQ's Hessians and bias correction's sums, in one pass
            with timings.stage("layer inputs"):  # a second pass, with the activations' parameters
                layer_inputs = collect_hessians(
                    prepared, targets, calib_batches, providers=config.providers,
                    threads=config.threads,
                    on_batch=_stage_progress(progress, "layer inputs", calib.num_samples()))
        with timings.stage("qparams"):
            weights, weight_records = _quantize_weights(
                prepared, plan, preset.weight, config, opset, operand_recipe=preset.activation,
                layer_inputs=layer_inputs,
            )
            del layer_inputs
            records.update(weight_records)
            refuse_non_finite_scales(records, preset.name)

        with timings.stage("qdq"):
            build = partial(build_quantized, prepared, act_params, weights, weight_file,
                            declared_shapes=loaded.declared_shapes)
            # Its session (COMPARE_THREADS threads) is the first evaluation's.
            runnable = make_runnable(prepared, plan, build, first_feed, providers=config.providers,
                                     replan=_replan(prepared, rules, config))
            del build
            plan, quant_model = runnable.plan, runnable.model
            if runnable.repaired:
                records = _planned_records(records, plan, quant_model)
            records.update(_bias_records(quant_model, plan))
            # The first evaluation of this model runs in the session that checked it (a large
            # model's is closed instead: it would stay open through every later stage).
            checked = [(quant_model, runnable.session)] if weight_file is None else []
            del runnable
    else:  # MatMul/Gemm weights alone, activations float: no Q/DQ, so no fallback either
        with timings.stage("weight-only"):
            weight_only = quantize_weight_only(
                prepared, config, calib_batches,
                progress=progress, samples=calib.num_samples(),
                declared_shapes=loaded.declared_shapes)
        quant_model, plan = weight_only.model, weight_only_plan(plan, weight_only.section)
        summary = weight_only.summary or CollectionSummary(0, 0, 0.0)
        records, act_params, weights, checked = {}, {}, {}, []

    eval_labels = labels if eval_source is not None or config.labels else None

    def evaluate(model: onnx.ModelProto, stage: str = "evaluate") -> Comparison:
        session = checked.pop()[1] if checked and checked[0][0] is model else None
        return compare_models(
            prepared, model, data_mod.iter_batches(source, inputs, config.batch_size),
            labels=eval_labels, providers=config.providers,
            on_batch=_stage_progress(progress, stage, source.num_samples()), reference=reference,
            quant_session=session,
        )

    accuracy = _Accuracy(None, None) if weight_only is not None else _improve_accuracy(
        prepared, plan, quant_model, act_params, weights, config=config, inputs=inputs,
        source=source, macs=macs, evaluate=evaluate, timings=timings, progress=progress,
        declared_shapes=loaded.declared_shapes, confirm=None if confirm_on is None else
        _confirmation(prepared, confirm_on, inputs, config, calib_reference, progress, timings),
    )
    del weights  # the codes live on in the quantized model
    if accuracy.fallback is not None:
        plan, quant_model = accuracy.fallback.plan, accuracy.fallback.model
        comparison = accuracy.fallback.comparison  # on the same data as the evaluation below
        records = _planned_records(records, plan, quant_model)
    elif accuracy.comparison is not None:
        comparison = accuracy.comparison
    else:
        with timings.stage("evaluate"):
            comparison = evaluate(quant_model)
    reference.release()
    missed = None if accuracy.fallback is None else accuracy.fallback.missed
    unconfirmed = None if missed is None else (missed.samples, missed.words)
    if calib_reference is not None:
        calib_reference.release()
    # A float Conv between quantized neighbours runs in integers all the same: say so, count it.
    integer_anyway = quantized_by_onnxruntime(quant_model) if config.cpu_provider_only else []
    plan, warning = noted_as_integer(plan, integer_anyway)
    if warning is not None:
        exactness_notes = [*exactness_notes, warning]
    coverage = measure_coverage(prepared, plan, macs, integer_anyway)
    speed = drift = None
    # A model of over 1 GiB of weights is timed only for the --fail-if-slower gate: two more
    # sessions would hold its weights twice more (so the built-in not-slower gate is not
    # checked on it).
    if config.fail_if_slower is not None or weight_bytes(prepared) <= _TIMED_WEIGHT_BYTES:
        with timings.stage("prepared check"):  # the user's model as given, run beside ours
            # a float16 model widened to float32 computes more precisely than the user's
            widened = any(step.name == "widen-half" for step in steps)
            drift = None if widened else prepared_model_drift(
                users, prepared, order.leading, config)
        # A model with nothing quantized is the float model: its coverage gate fails, and
        # timing the two took seconds of a run of a few (a 1-token decoder step: 4 s of 7.5).
        if coverage.anything_quantized or weight_only is not None \
                or config.fail_if_slower is not None:
            with timings.stage("latency"):
                speed, stand_in = time_against_users_model(users, prepared, loaded, quant_model,
                                                           order.leading, config)
            timings.seconds.update(speed.figures)
            exactness_notes += [stand_in] if stand_in else []
    del users, first_feed
    gates = check_gates(config.gates(), comparison, coverage,
                        None if accuracy.fallback is None else accuracy.fallback.reached, speed,
                        unconfirmed)
    if drift is not None and not drift.passed:
        gates.append(drift)

    # Large models (or inputs with external data) are written with external data,
    # <output>.data, staged beside the output before the report, which records both files.
    # Weights qcal kept in files while calibrating count as the bytes they are.
    external = output is not None and (
        bool(loaded.external_files) or needs_external_data(quant_model))
    if weight_file is not None and not external:  # written inline: its weights come back now
        load_external_data(quant_model)
    if external:
        assert output is not None
        check_output_path(data_path(output), inputs=read, force=force, what="output data")
    with stage_model(quant_model, output, external=external) if output is not None \
            else nullcontext(None) as staged:
        report = build_report(
            config=config, preset=preset, loaded=loaded, steps=steps, plan=plan, records=records,
            calib=calib, calib_samples=summary.samples, eval_source=eval_source,
            labels_path=labels_path, comparison=comparison, output=output,
            model_bytes=staged.model_bytes if staged is not None else b"",
            timings=timings.seconds, evaluation_data=eval_label, compute_coverage=coverage,
            sensitivity=accuracy.sensitivity, fallback=accuracy.fallback, gates=gates,
            providers_used=summary.providers,
            external_data=staged.external if staged is not None else None,
            statistics=None if reused is None else reused.source,
            weight_only=None if weight_only is None else weight_only.section,
            transforms=transforms.to_json(), notes=exactness_notes,
        )
        # Both files are written whole under temporary names before either gets its own: a
        # failed write (a full disk) leaves neither.
        with (stage_file(report_path, dump_report(report)) if report_path is not None
              else nullcontext(None)) as staged_report:
            if staged is not None:
                staged.commit()
            if staged_report is not None:
                try:
                    staged_report.commit()
                except OutputError:
                    if staged is not None:
                        staged.remove_committed()
                    raise
    if weight_file is not None:  # the caller gets the model whole, as for any model
        load_external_data(quant_model)
        weight_file.close()
    if enforce_gates:  # after writing: a failed gate leaves the model and report as evidence
        raise_for_failed(gates, report_path)
    return CalibrationResult(quant_model, report, comparison, output, report_path, tuple(gates))


def _output_sink(model: onnx.ModelProto, reference: FloatReference) -> OutputSink:
    names = numeric_outputs(model)
    return OutputSink(tuple(names), partial(reference.keep, names))


_TIMED_WEIGHT_BYTES = 1 << 30  # float weights up to which a model is timed


def plan_model(model_path: Path, config: CalibrationConfig) -> tuple[LoadedModel, onnx.ModelProto, list[PrepStep], QuantPlan]:
    loaded = load_model(model_path)
    prepared, steps = prepare_model(loaded.model, min_opset=config.opset,
                                   for_speed=config.places_for_speed)
    steps += onnxruntime_steps(prepared, providers=config.providers)
    return loaded, prepared, steps, plan_quantization(prepared, _selection_rules(config))

