"""`collect`: run the float model over the calibration data and keep the statistics as a file.

The same preparation and plan as `calibrate` (so the file fits a later `calibrate --stats` with
the same options), then the collection loop over the data, in chunks when checkpointing: after
each chunk the statistics so far are written atomically with the number of samples consumed, and
a run given the same checkpoint file verifies and skips those samples and goes on from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from qcal._inputs import _check_overrides, _exact_runs, _selection_rules
from qcal._quantize_tensors import _observed, blame_nan_weights
from qcal._stages import Progress
from qcal.calibration import data as data_mod
from qcal.calibration.collect import collect
from qcal.calibration.statistics import (
    HISTOGRAM,
    Fingerprint,
    FingerprintedSource,
    ObserverPair,
    Statistics,
    observer_pair,
    read_statistics,
    split,
)
from qcal.calibration.value_types import onnxruntime_steps
from qcal.config import CalibrationConfig
from qcal.graph.files.atomic import check_output_path, write_atomic
from qcal.graph.files.large import WeightFile
from qcal.graph.files.load import LoadedModel, load_model
from qcal.graph.files.save import weights_in_files
from qcal.graph.model import QuantPlan, model_inputs, plan_quantization, prepare_model
from qcal.numerics.errors import ConfigError, DataError, StatisticsError
from qcal.numerics.histogram import HistogramObserver
from qcal.numerics.observers import Observer, PerTensor
from qcal.numerics.presets import build_preset
from qcal.numerics.ranges import HISTOGRAM_METHODS

__all__ = ["CHECKPOINT_EVERY", "CollectionInputs", "collect_statistics", "plan_header",
           "prepare_collection"]

# Samples between two checkpoints: each chunk opens its own onnxruntime session (well under a
# second for the sample and PP-OCR models), so a checkpoint costs little against the chunk.
CHECKPOINT_EVERY = 1024


@dataclass(frozen=True)
class CollectionInputs:
    """What a collection needs, checked before the model runs."""

    loaded: LoadedModel
    model: onnx.ModelProto
    plan: QuantPlan
    source: Any
    inputs: Any
    weight_file: WeightFile | None


def plan_header(config: CalibrationConfig, histograms: bool) -> dict[str, Any]:
    """The options that decide which tensors are observed and what their observers keep."""
    values = config.to_json()
    keys = ("preset", "preset_options", "method", "tensors", "op_types", "exclude_op_types",
            "exclude_nodes", "exclude_tensors", "default_exclusions", "opset", "batch_size")
    header = {key: values[key] for key in keys}
    header["placement"] = config.placement_mode
    header["histograms"] = histograms
    # Min/max and histograms do not see how samples are batched: files of any batch size merge.
    header["batch_size"] = config.batch_size if config.averages_batches() else None
    return header


def range_method(method: str) -> str:
    """The range observer kept for `method`: its own, or min/max beside a histogram method's."""
    return "minmax" if method in HISTOGRAM_METHODS else method


def prepare_collection(
    model_path: Path, config: CalibrationConfig, *, reads: tuple[Path, ...] = ()
) -> CollectionInputs:
    """Load, prepare and plan as `calibrate` does, and open the data."""
    build_preset(config.preset, config.preset_options)  # a bad preset option fails first
    loaded = load_model(model_path)
    prepared, _ = prepare_model(loaded.model, min_opset=config.opset, in_place=True,
                                 for_speed=config.places_for_speed)
    weight_file = None
    if weights_in_files(prepared):
        weight_file = WeightFile()
        prepared = weight_file.offload(prepared)
        loaded = dataclasses.replace(loaded, model=prepared)
    onnxruntime_steps(prepared, providers=config.providers)  # as `calibrate` prepares
    inputs = model_inputs(prepared)
    source = data_mod.open_data(config.data, model_path=model_path, inputs=inputs,
                                synthetic=config.synthetic, limit=config.limit, seed=config.seed)
    data_mod.validate_data(source, inputs)
    # Relu/Clip inputs observed as well, whatever the preset: a statistics file serves presets
    # that fuse them into the Conv/Gemm/MatMul before and those that do not.
    rules = dataclasses.replace(_selection_rules(config), fuse_activations=False)
    plan = plan_quantization(prepared, rules)
    _check_overrides(config, plan)
    return CollectionInputs(loaded, prepared, plan, source, inputs, weight_file)


def _new_observers(
    plan: QuantPlan, config: CalibrationConfig, histograms: bool
) -> dict[str, Observer]:
    recipe = build_preset(config.preset, config.preset_options).activation
    observers: dict[str, Observer] = {}
    for target in plan.activations:
        if not _observed(target, config):
            continue
        method = config.method_for(target.tensor)
        histogram = HistogramObserver(PerTensor())
        if method in HISTOGRAM_METHODS and not histograms:
            observers[target.tensor] = histogram  # what the method needs, alone
            continue
        observer = recipe.observer(range_method(method), PerTensor())
        observers[target.tensor] = observer_pair(observer, histogram) if histograms else observer
    return observers


def collect_statistics(
    model_path: Path,
    config: CalibrationConfig,
    *,
    output: Path | None = None,
    force: bool = False,
    histograms: bool = True,
    checkpoint: Path | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
    shard: tuple[int, int | None] = (0, None),
    progress: Progress | None = None,
) -> Statistics:
    """Collect the statistics of `model_path` on samples [shard) of the configured data.

    With `checkpoint`, the statistics so far are written there every `checkpoint_every` samples
    (and at the end); a checkpoint already there, of this model and these options, is resumed.
    `output` is written at the end (atomically); nothing is written on failure or interrupt
    but the last checkpoint.
    """
    if checkpoint_every < 1:
        raise ConfigError(f"checkpoint-every: {checkpoint_every} must be at least 1")

    def check_outputs(read: list[Path]) -> None:
        if output is not None:
            same = checkpoint is not None and output.resolve() == checkpoint.resolve()
            check_output_path(output, inputs=read, force=force or same, what="output")
        if checkpoint is not None:
            check_output_path(checkpoint, inputs=read, force=True, what="checkpoint")

    check_outputs([model_path])  # before a large model takes seconds to load
    run = prepare_collection(model_path, config)
    config = _exact_runs(run.model, run.source, run.inputs, config)[0]
    read = [model_path, *run.loaded.external_files]
    check_outputs(read + [p for p in (run.source.path,) if p is not None])
    plan = plan_header(config, histograms)
    observers = _new_observers(run.plan, config, histograms)
    methods = {t: range_method(config.method_for(t)) for t in observers}
    start, stop = shard
    source = FingerprintedSource(run.source, start, stop)
    done = Fingerprint()
    providers: tuple[str, ...] = ()
    if checkpoint is not None and checkpoint.exists():
        done, providers = _resume(checkpoint, run.loaded.sha256, plan, observers, methods, source)
    every = max(config.batch_size, checkpoint_every - checkpoint_every % config.batch_size)
    total = source.num_samples()
    on_batch = None
    if progress is not None:
        progress("collect", done.samples, total)
        on_batch = lambda n: progress("collect", n, total)

    def statistics(complete: bool) -> Statistics:
        found = {t: split(o, methods[t]) for t, o in observers.items()}
        return Statistics(run.loaded.sha256, plan, source.fingerprint, providers, found,
                          synthetic=bool(run.source.is_synthetic), complete=complete)

    source.fingerprint = done
    try:
        while not source.exhausted():
            chunk = source.take(every if checkpoint is not None else None)
            try:
                summary = collect(
                    run.model, observers, data_mod.iter_batches(chunk, run.inputs,
                                                                config.batch_size),
                    providers=config.providers, threads=config.threads, on_batch=on_batch)
            except DataError:
                blame_nan_weights(run.model)
                raise
            providers = summary.providers
            if checkpoint is not None:
                write_atomic(checkpoint, statistics(source.exhausted()).to_bytes())
    finally:
        if run.weight_file is not None:
            run.weight_file.close()
    if source.fingerprint.samples == 0:
        raise DataError("calibration data has no samples")
    result = statistics(True)
    if output is not None:
        write_atomic(output, result.to_bytes())
    return result


def _resume(
    checkpoint: Path, model_sha256: str, plan: dict[str, Any], observers: dict[str, Observer],
    methods: dict[str, str], source: FingerprintedSource,
) -> tuple[Fingerprint, tuple[str, ...]]:
    """Load the checkpoint's observers into `observers`, check and skip the samples it holds."""
    saved = read_statistics(checkpoint)
    if saved.model_sha256 != model_sha256:
        raise StatisticsError(f"{checkpoint}: a checkpoint of another model; remove it or choose "
                              "another --checkpoint path")
    if saved.plan != plan:
        keys = sorted(k for k in {*plan, *saved.plan} if plan.get(k) != saved.plan.get(k))
        raise StatisticsError(f"{checkpoint}: a checkpoint collected with other options "
                              f"({', '.join(keys)}); use them again or another --checkpoint path")
    for tensor, observer in list(observers.items()):
        kept = saved.observers.get(tensor, {})
        expected = split(observer, methods[tensor])
        if set(kept) != set(expected):
            raise StatisticsError(f"{checkpoint}: tensor {tensor!r} has other observers")
        if isinstance(observer, ObserverPair):
            histogram = kept[HISTOGRAM]
            assert isinstance(histogram, HistogramObserver)
            observers[tensor] = observer_pair(kept[methods[tensor]], histogram)
        else:
            observers[tensor] = next(iter(kept.values()))
    skipped = source.take(saved.samples)
    for _ in skipped.samples():
        pass
    if source.fingerprint.samples != saved.samples or \
            source.fingerprint.total != saved.fingerprint.total:
        raise StatisticsError(
            f"{checkpoint}: the first {saved.samples} samples of the data are not those the "
            "checkpoint was collected on; remove it or give the same data")
    return saved.fingerprint, saved.providers
