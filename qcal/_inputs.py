"""What a run reads, resolved and checked in calibrate's first stage, before onnxruntime
starts: the selection rules and per-tensor overrides of the config, the evaluation data and
labels found beside the model, the options that need a classifier-like output, the part of
the calibration data held out for sensitivity and fallback, the batch size the data can be
joined at (the one check here that runs the model), the opset the model is upgraded to, and
how the plan is made again with nodes left float.
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qcal.accuracy.decisions import decision_rules
from qcal.accuracy.macs import compute_macs
from qcal.calibration import data as data_mod
from qcal.calibration.batch_check import exact_batch_size, exact_threads
from qcal.config import CalibrationConfig
from qcal.graph.files.atomic import check_output_path
from qcal.graph.model import QuantPlan, SelectionRules, plan_quantization
from qcal.graph.weight_only import QDQ_OPSET
from qcal.numerics.errors import ConfigError, DataError
from qcal.numerics.observers import MinMaxStats
from qcal.numerics.onnx_mapping import OnnxQParams
from qcal.numerics.presets import build_preset

_NEWEST_TYPES_OPSET = 21  # int4/uint4/int16/uint16 QuantizeLinear


def _selection_rules(config: CalibrationConfig) -> SelectionRules:
    skipped = {name for name, o in config.tensors.items() if o.skip}
    unit = _unit_range_qparams(config)
    return SelectionRules(
        op_types=frozenset(config.op_types) if config.op_types else None,
        exclude_op_types=frozenset(config.exclude_op_types),
        exclude_nodes=tuple(config.exclude_nodes),
        exclude_tensors=frozenset(config.exclude_tensors) | skipped,
        per_channel=config.per_channel,
        default_exclusions=config.default_exclusions,
        placement=config.placement_mode,
        # Emulation ("all") fuses as the target does; "auto" as onnxruntime can.
        fuse_activations=config.placement_mode != "auto" or _zero_at_floor(unit),
        integer_forms=unit.dtype == onnx.TensorProto.UINT8,
    )


def with_product_sizes(rules: SelectionRules, macs: Mapping[str, int | None],
                       config: CalibrationConfig) -> SelectionRules:
    """`rules` with the MatMul/Gemm sizes placement "auto" weighs (`SelectionRules`), when Q/DQ
    serves onnxruntime's integer kernels (not where it emulates a target's arithmetic)."""
    if not config.places_for_speed:
        return rules
    sizes = tuple(sorted((name, count) for name, count in macs.items() if count is not None))
    return dataclasses.replace(rules, run_macs=sizes, min_product_macs=config.min_product_macs)


def _zero_at_floor(onnx_qparams: OnnxQParams) -> bool:
    """Whether the preset's parameters for [0, 1] (`_unit_range_qparams`) have the lowest code as
    zero point, as onnxruntime needs to drop a Relu/Clip before a QuantizeLinear
    (`SelectionRules`)."""
    lowest = 0 if onnx_qparams.dtype == onnx.TensorProto.UINT8 else -128
    return onnx_qparams.dtype in (onnx.TensorProto.UINT8, onnx.TensorProto.INT8) and bool(
        np.all(np.asarray(onnx_qparams.zero_point) == lowest))


def data_described(source: Any) -> str:
    """Calibration data as an error names it."""
    if source.is_synthetic:  # its free dimensions are 1: a model may need others
        return "synthetic data (every free dimension 1; pass --data PATH)"
    return str(source.path) if source.path is not None else "calibration data"


def _unit_range_qparams(config: CalibrationConfig) -> OnnxQParams:
    """The ONNX parameters the preset gives activations in [0, 1], at the newest opset the run
    may take (a 16-bit preset has no type of its own below opset 21, where the run itself says
    so, if it comes to that: this only tells 8-bit parameters apart)."""
    recipe = build_preset(config.preset, config.preset_options).activation
    stats = MinMaxStats(np.array(0.0, np.float32), np.array(1.0, np.float32))
    return recipe.to_onnx(recipe.qparams(stats), opset=max(config.opset, _NEWEST_TYPES_OPSET))


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
    if not isinstance(labels, np.ndarray):  # an .npz archive: several arrays, not one
        labels.close()
        raise DataError(f"{path}: labels must be one .npy array of class indices, not an "
                        ".npz archive")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    return np.asarray(labels, dtype=np.int64)


def _check_overrides(config: CalibrationConfig, plan: QuantPlan) -> None:
    known = {t.tensor for t in plan.activations}
    for name, override in sorted(config.tensors.items()):
        if override.method is not None and name not in known:
            raise ConfigError(f"tensors.{name}: not a quantized activation of this model")


def _check_agreement_options(config: CalibrationConfig, model: onnx.ModelProto) -> None:
    """Agreement options need a classifier-like output; say so before anything runs."""
    asked = [key for key, value in (("fail-under-agreement", config.fail_under_agreement),
                                    ("max-agreement-drop", config.max_agreement_drop))
             if value is not None]
    if not asked:
        return
    rules = decision_rules(model)
    shapes = {o.name: o.type.tensor_type.shape for o in model.graph.output
              if o.type.tensor_type.HasField("shape")}
    # An unknown dimension could be anything from 2 on; an unknown rank could be any rank.
    if not any(name not in shapes or rule.applies(tuple(
                   d.dim_value if d.HasField("dim_value") else 2 for d in shapes[name].dim))
               for name, rule in rules.items()):
        raise ConfigError(
            f"{asked[0]}: no model output holds decisions ([N, classes] scores, a softmax over "
            "the last axis, a sigmoid), so top-1 agreement is not measured; use a SQNR option "
            "instead"
        )


def _accuracy_sources(
    config: CalibrationConfig, calib: Any, order: data_mod.ContentOrder, eval_source: Any, *,
    collected: bool = False,
) -> tuple[Any, Any, str | None]:
    """(calibration, evaluation, evaluation label): without evaluation data, the accuracy
    floor's check (and sensitivity and fallback) hold out a quarter of the calibration samples
    (at most 256) to measure on: the samples the ranges were fitted on flatter a model
    (silero-vad kept 99.1 % of its decisions on them and 97.0 % on other speech). They are the
    first of the samples in their content's `order` (`data.content_order`), not the last in the
    data's, so the same samples in any order calibrate on the same ones and write the same
    model; and only samples whose numbers are all finite: calibration refuses NaN and infinite
    values where an observed tensor meets them, which an evaluation cannot tell. Statistics
    `collected` beforehand (`--stats`) saw every sample: nothing is held out then."""
    if eval_source is not None or not config.checks_accuracy or collected:
        return calib, eval_source, None
    held = min(len(order.positions) // 4, order.finite, 256)
    if held < 1:
        return calib, None, None  # too few to split: measured on the calibration data itself
    label = "a quarter of the calibration samples, chosen by their content, held out from calibration"
    return (data_mod.SampleSubset(calib, sorted(order.positions[held:])),
            data_mod.SampleSubset(calib, sorted(order.positions[:held])), label)


# About two milliseconds of float work per sample on one core (see `_exact_runs`).
_ONE_THREAD_MACS = 20_000_000


def _exact_runs(
    model: onnx.ModelProto, source: Any, inputs: Any, config: CalibrationConfig,
    macs: Mapping[str, int | None] | None = None,
) -> tuple[CalibrationConfig, list[str]]:
    """`config` with the thread count and batch size its passes run at, and why they are not
    the ones asked for: a sample must compute at the thread count as at one thread
    (`exact_threads`), and joined samples as they do alone (`exact_batch_size`), unless a
    moving average, which depends on the batching by design, observes a tensor.

    A model of less than _ONE_THREAD_MACS multiply-accumulates per sample (`macs`, the first
    sample's, computed here when not given) runs its passes on one thread unchecked: more
    threads save it less than the check would cost, and one thread is the check's reference."""
    if macs is None:
        first = next(iter(source.samples()), None)
        macs = compute_macs(model, first) if first is not None else {}
    small = bool(macs) and all(v is not None for v in macs.values()) and \
        sum(v or 0 for v in macs.values()) < _ONE_THREAD_MACS
    threads, thread_note = (1, None) if small else exact_threads(
        model, source, inputs, config.threads, providers=config.providers)
    config = dataclasses.replace(config, threads=threads)
    notes = [thread_note] if thread_note else []
    if config.averages_batches():
        return config, notes
    size, note = exact_batch_size(model, source, inputs, config.batch_size,
                                  providers=config.providers, threads=config.threads)
    return dataclasses.replace(config, batch_size=size), notes + ([note] if note else [])


def _replan(
    prepared: onnx.ModelProto, rules: SelectionRules, config: CalibrationConfig
) -> Callable[[frozenset[str]], QuantPlan] | None:
    """The plan again with some nodes left float, for the check that what is planned runs in
    integers (`qcal.accuracy.runnable`); None where Q/DQ emulates a target (placement "all",
    --op-types) instead of serving onnxruntime's integer kernels, and for providers other than
    the CPU provider alone."""
    if not config.places_for_speed or not config.cpu_provider_only:
        # Other providers compile the graph their own way (and some cannot write it out).
        return None

    def replan(nodes: frozenset[str]) -> QuantPlan:
        floated = tuple(sorted(glob.escape(n) for n in nodes))
        return plan_quantization(
            prepared, dataclasses.replace(rules, exclude_nodes=rules.exclude_nodes + floated))

    return replan


def _min_opset(config: CalibrationConfig) -> int:
    """The opset the model is upgraded to: the asked one, and 21 for weight-only int4 QDQ."""
    if config.weight_only is not None and config.weight_only_format == "qdq":
        return max(config.opset, QDQ_OPSET)
    return config.opset


def check_outputs(outputs: tuple[Path | None, Path | None], read: list[Path],
                   force: bool) -> None:
    """The output model's and the report's paths (None: not written), against the files the run
    reads (`check_output_path`)."""
    for path, what in zip(outputs, ("output", "report")):
        if path is not None:
            check_output_path(path, inputs=read, force=force, what=what)
