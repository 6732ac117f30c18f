"""The float-equivalent rewrites a run may make before it plans quantization: equalization
(`--equalize`: with per-tensor weights, the weights of Conv pairs; with per-channel weights, the
channel ranges of depthwise inputs, from a statistics pass) and SmoothQuant (`--smooth-quant`, a
statistics pass over the calibration data first). They keep the float model's outputs to
float32 rounding (the depthwise inputs: on the calibration data); what they changed goes to the
report's ``transforms``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from qcal._stages import Progress, _stage_progress, _Timings
from qcal.calibration.channel_stats import collect_channel_extremes, collect_channel_stats
from qcal.config import CalibrationConfig
from qcal.graph.files.large import tensor_array
from qcal.graph.model import PrepStep
from qcal.graph.passes.equalize import EqualizedPair, EqualizeLayers
from qcal.graph.passes.equalize_depthwise import (
    apply_depthwise_scales,
    depthwise_scales,
    find_depthwise_inputs,
    input_magnitudes,
    range_ratio,
)
from qcal.graph.passes.smooth_quant import SmoothTarget, apply_smoothing, find_smooth_targets
from qcal.numerics.presets import Preset
from qcal.numerics.smoothing import ALPHA_GRID, LayerProblem, layer_error, smoothing_scales


@dataclass(frozen=True)
class SmoothedLayer:
    """What SmoothQuant did to one activation and its layers.

    Attributes:
        alpha: the migration strength used; None when `auto` found no alpha that lowers the
            error (the layers are left as they were).
        max_scale: the largest per-channel divisor of the activation (1 when left alone).
        error_before, error_after: the layers' relative squared output error with both operands
            quantized, without and with the smoothing, on the row sample.
    """

    activation: str
    layers: tuple[str, ...]
    alpha: float | None
    max_scale: float
    error_before: float
    error_after: float

    def to_json(self) -> dict[str, Any]:
        return {"activation": self.activation, "layers": list(self.layers), "alpha": self.alpha,
                "max_scale": self.max_scale, "output_error_before": self.error_before,
                "output_error_after": self.error_after}


@dataclass(frozen=True)
class EqualizedInput:
    """One depthwise input whose channel ranges `--equalize` evened out.

    Attributes:
        first: the Conv whose output channels were multiplied.
        through: the activation on the way ("" when none).
        depthwise: the depthwise Convs whose weights were divided.
        max_scale: the largest channel multiplier (1: left as it was).
        range_ratio_before, range_ratio_after: the largest over the smallest channel magnitude
            of the quantized values on the calibration data (dead channels aside); 1 is even.
    """

    first: str
    through: str
    depthwise: tuple[str, ...]
    max_scale: float
    range_ratio_before: float
    range_ratio_after: float

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "through": self.through, "depthwise": list(self.depthwise),
                "max_scale": self.max_scale, "range_ratio_before": self.range_ratio_before,
                "range_ratio_after": self.range_ratio_after}


@dataclass(frozen=True)
class Transforms:
    """What the rewrites changed (None: not asked for)."""

    equalized: tuple[EqualizedPair, ...] | None = None
    smoothed: tuple[SmoothedLayer, ...] | None = None
    equalized_inputs: tuple[EqualizedInput, ...] | None = None

    def to_json(self) -> dict[str, Any] | None:
        """The report's ``transforms``; None when neither ran (the report then has none)."""
        out: dict[str, Any] = {}
        if self.equalized is not None:
            out["equalize"] = {"pairs": [p.to_json() for p in self.equalized]}
            if self.equalized_inputs is not None:
                out["equalize"]["depthwise_inputs"] = [
                    e.to_json() for e in self.equalized_inputs]
        if self.smoothed is not None:
            out["smooth_quant"] = {"layers": [s.to_json() for s in self.smoothed]}
        return out or None


def equalize(model: onnx.ModelProto) -> tuple[tuple[EqualizedPair, ...], PrepStep | None]:
    """Cross-layer equalization of `model`, in place; the preparation step when it changed it."""
    rewrite = EqualizeLayers()
    result = rewrite(model)
    return rewrite.pairs, PrepStep(rewrite.name, result.detail) if result.modified else None


def equalize_depthwise_inputs(
    model: onnx.ModelProto, config: CalibrationConfig,
    batches: Iterable[tuple[Mapping[str, np.ndarray], int]],
    on_batch: Callable[[int], None] | None = None,
) -> tuple[EqualizedInput, ...]:
    """Even out the channel ranges of `model`'s depthwise inputs, in place, from one statistics
    pass over `batches` (`qcal.graph.passes.equalize_depthwise`)."""
    targets = find_depthwise_inputs(model)
    if not targets:
        return ()
    extremes = collect_channel_extremes(
        model, [v for t in targets for v in t.values], batches,
        providers=config.providers, threads=config.threads, on_batch=on_batch)
    initializers = {t.name: t for t in model.graph.initializer}
    done = []
    for target in targets:
        if not all(v in extremes and extremes[v][0].shape == (target.channels,)
                   for v in target.values):
            continue  # no values reached it (a branch not taken), or not NCHW channels
        low = np.stack([extremes[v][0] for v in target.values])
        high = np.stack([extremes[v][1] for v in target.values])
        scale = depthwise_scales(target, low, high)
        if np.all(scale == 1.0):
            continue
        apply_depthwise_scales(initializers, target, scale)
        before = input_magnitudes(target, low, high)
        done.append(EqualizedInput(
            target.first, target.through, target.depthwise, float(scale.max()),
            range_ratio(before), range_ratio(before * scale)))
    return tuple(done)


def _per_channel_conv_weights(config: CalibrationConfig, preset: Preset) -> bool:
    """Whether Conv weights are quantized per output channel (axis 0) in this run."""
    allowed = preset.weight.per_channel_axes
    return config.per_channel and (allowed == "any" or 0 in allowed)


def smooth(
    model: onnx.ModelProto, config: CalibrationConfig, preset: Preset,
    batches: Iterable[tuple[Mapping[str, np.ndarray], int]],
    on_batch: Callable[[int], None] | None = None,
) -> tuple[SmoothedLayer, ...]:
    """SmoothQuant on `model`, in place, with `config.smooth_quant` (an alpha, or "auto")."""
    targets = find_smooth_targets(model)
    if not targets:
        return ()
    stats = collect_channel_stats(
        model, {t.activation: t.channels for t in targets}, batches,
        providers=config.providers, threads=config.threads, on_batch=on_batch)
    initializers = {t.name: t for t in model.graph.initializer}
    done = []
    for target in targets:
        seen = stats[target.activation]
        if not np.all(np.isfinite(seen.min)):
            continue  # the activation received no values
        problem = LayerProblem(seen.rows, seen.min.astype(np.float64), seen.max.astype(np.float64),
                               [_as_rows(initializers[name], transposed)
                                for name, transposed in target.weights])
        layer, scale = _choose(target, problem, config, preset)
        if layer.alpha is not None:
            apply_smoothing(model, target, scale)
        done.append(layer)
    return tuple(done)


def _choose(target: SmoothTarget, problem: LayerProblem, config: CalibrationConfig,
            preset: Preset) -> tuple[SmoothedLayer, np.ndarray]:
    """The layer's smoothing and its per-channel divisors (ones when left alone)."""
    # Per output channel as the run quantizes the weights: where asked and the API allows the
    # axis ((K, N): 1; stored transposed: 0).
    allowed = preset.weight.per_channel_axes
    per_channel = config.per_channel and (allowed == "any" or all(
        (0 if transposed else 1) in allowed for _, transposed in target.weights))

    def error(scale: np.ndarray) -> float:
        return layer_error(problem, scale, activation=preset.activation, weight=preset.weight,
                           per_channel=per_channel)

    before = error(np.ones(target.channels))
    alpha_set = config.smooth_quant
    alphas = (alpha_set,) if isinstance(alpha_set, float) else ALPHA_GRID
    best: tuple[float, float, np.ndarray] | None = None
    for alpha in alphas:
        scale = smoothing_scales(problem.x_absmax, problem.w_absmax, alpha)
        measured = error(scale)
        if best is None or measured < best[1]:
            best = (alpha, measured, scale)
    assert best is not None
    alpha, after, scale = best
    if config.smooth_quant == "auto" and not after < before:
        unchanged = np.ones(target.channels)
        return SmoothedLayer(target.activation, target.layers, None, 1.0, before, before), unchanged
    return (SmoothedLayer(target.activation, target.layers, alpha, float(scale.max()), before,
                          after), scale)


def _as_rows(tensor: onnx.TensorProto, transposed: bool) -> np.ndarray:
    weight = tensor_array(tensor).astype(np.float64)
    return weight.T if transposed else weight


def apply_transforms(
    model: onnx.ModelProto, config: CalibrationConfig, preset: Preset,
    batches: Callable[[], Iterable[tuple[Mapping[str, np.ndarray], int]]], *,
    samples: int | None, timings: _Timings, progress: Progress | None,
) -> tuple[Transforms, list[PrepStep]]:
    """The transforms `config` asks for, on `model` in place, and the preparation steps they add.

    Neither adds, removes or renames a node or tensor: the quantization plan made before them
    holds after them."""
    equalized = smoothed = inputs = None
    steps = []
    if config.equalize:
        with timings.stage("equalize"):
            # Per-tensor weights need the weights' channels balanced; per-channel weights give
            # each channel its own scale already, so what is left uneven is the activations,
            # which moving factors between weights only reshapes (README, Cross-layer
            # equalization): their channels are evened out where a depthwise Conv reads them.
            if not _per_channel_conv_weights(config, preset):
                equalized, step = equalize(model)
                steps += [step] if step is not None else []
            else:
                equalized = ()
                inputs = equalize_depthwise_inputs(
                    model, config, batches(), _stage_progress(progress, "equalize", samples))
                if inputs:
                    count = len(inputs)
                    steps.append(PrepStep("equalize-depthwise",
                                          f"evened out {count} depthwise input"
                                          f"{'s' * (count != 1)}"))
    if config.smooth_quant is not None:
        with timings.stage("smooth quant"):
            smoothed = smooth(model, config, preset, batches(),
                              _stage_progress(progress, "smooth quant", samples))
    return Transforms(equalized, smoothed, inputs), steps
