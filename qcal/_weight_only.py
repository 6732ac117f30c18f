"""The weight-only run (`--weight-only int4`): MatMul/Gemm weights to 4 bits in blocks along their
inputs, activations float, written as MatMulNBits or int4 QDQ (`qcal.graph.weight_only`).

Rounding to nearest needs no data. GPTQ (`--weight-rounding gptq`, or `auto`: every weight here
is a MatMul/Gemm one) needs each layer's float input's second moments: a first pass over the
calibration data finds each input's range, a second measures ``H = sum x x^T`` on the input
quantized to 16 bits on that range (integers, so the sums are exact and the same whatever the
batch split or data order; `qcal.calibration.hessians`); 16 bits keep every input within
1/65534 of its largest magnitude.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from qcal._stages import Progress, _stage_progress
from qcal.calibration.collect import CollectionSummary, collect
from qcal.calibration.hessians import LayerInputs, collect_hessians, hessian_target
from qcal.config import CalibrationConfig
from qcal.graph.files.large import tensor_array
from qcal.graph.model import NodeDecision, QuantPlan
from qcal.graph.structure import keep_declared_shapes
from qcal.graph.weight_only import WeightOnlyTarget, weight_only_targets, write_weight_only
from qcal.numerics.blockwise import BITS, BlockQuant, quantize_rtn
from qcal.numerics.errors import ConfigError, EmptyStatisticsError
from qcal.numerics.gptq_blocks import gptq_blocks
from qcal.numerics.observers import MinMaxObserver, PerTensor
from qcal.numerics.onnx_mapping import OnnxQParams

__all__ = [
    "WeightOnlyResult", "check_weight_only_config", "quantize_weight_only", "weight_only_plan",
]

Batches = Callable[[], Iterable[tuple[Mapping[str, np.ndarray], int]]]
_MEASURE_CODE = 32767  # the inputs are measured as int16 codes (symmetric)


@dataclass(frozen=True)
class WeightOnlyResult:
    """The weight-only model, the report's `weight_only` section, and the calibration pass's
    summary (None when no data was read: rounding to nearest)."""

    model: onnx.ModelProto
    section: dict[str, Any]
    summary: CollectionSummary | None


def check_weight_only_config(config: CalibrationConfig, *, statistics: bool) -> None:
    """ConfigError for the options a weight-only run has no use for (no activation is
    quantized, so there is nothing to read ranges for or keep float; bias correction, on by
    default, has no quantized bias to correct and is left out)."""
    if config.weight_only is None:
        return
    unused = [name for name, given in (
        ("--stats", statistics), ("--sensitivity", config.sensitivity),
        ("--target-sqnr/--max-agreement-drop", config.has_fallback_target)) if given]
    if unused:
        raise ConfigError(f"weight-only: activations stay float; it goes with none of "
                          f"{', '.join(unused)}")


def _measure_inputs(
    model: onnx.ModelProto, targets: list[WeightOnlyTarget], config: CalibrationConfig,
    batches: Batches, progress: Progress | None, samples: int | None,
) -> tuple[dict[str, LayerInputs], CollectionSummary]:
    nodes = {n.name: n for n in model.graph.node}
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    observers = {nodes[t.node].input[0]: MinMaxObserver(PerTensor()) for t in targets}
    summary = collect(model, observers, batches(), providers=config.providers,
                      threads=config.threads,
                      on_batch=_stage_progress(progress, "calibrate", samples),
                      expected_samples=samples)
    measured = []
    for target in targets:
        node = nodes[target.node]
        try:
            stats = observers[node.input[0]].state()
        except EmptyStatisticsError:
            continue  # the input received no values: the weight rounds to nearest
        largest = float(max(np.max(np.abs(stats.min)), np.max(np.abs(stats.max))))
        if not np.isfinite(largest) or largest <= 0:
            continue
        codes = OnnxQParams(
            dtype=onnx.TensorProto.INT16, scale=np.float32(largest / _MEASURE_CODE),
            zero_point=np.int16(0), axis=None, clip_min=None, clip_max=None, exact=True,
            deviations=(), replacement=None, min_opset=21)
        found = hessian_target(node, dims[target.weight], codes)
        if found is not None:
            measured.append(found)
    hessians = collect_hessians(model, measured, batches, providers=config.providers,
                                threads=config.threads,
                                on_batch=_stage_progress(progress, "layer inputs", samples))
    return hessians, summary


def _model_bytes(model: onnx.ModelProto) -> int:
    """The serialized model's size plus the external data its tensors point to."""
    external = 0
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "length":
                external += int(entry.value)
    return int(model.ByteSize()) + external


def quantize_weight_only(
    model: onnx.ModelProto, config: CalibrationConfig, batches: Batches, *,
    declared_shapes: frozenset[str], progress: Progress | None = None, samples: int | None = None,
) -> WeightOnlyResult:
    """`model` with its qualifying MatMul/Gemm weights at 4 bits, per `config`, stating the
    shapes the user's model states (`declared_shapes`); `batches()` gives the calibration data
    (`samples` of them, when known), read by GPTQ alone."""
    targets = weight_only_targets(model, op_types=config.op_types,
                                  exclude_op_types=config.exclude_op_types,
                                  exclude_nodes=config.exclude_nodes)
    excluded = set(config.exclude_tensors)
    targets = [t for t in targets if t.weight not in excluded]
    rounded = [t for t in targets if config.rounds_with_gptq(t.op_type)]
    hessians: dict[str, LayerInputs] = {}
    summary = None
    if rounded:
        hessians, summary = _measure_inputs(model, rounded, config, batches, progress, samples)
    initializers = {i.name: i for i in model.graph.initializer}
    quants: dict[str, BlockQuant] = {}
    entries = []
    for target in targets:
        array = tensor_array(initializers[target.weight]).astype(np.float32, copy=False)
        rows = array if target.transposed else array.T  # (N, K)
        measured = hessians.get(target.node)
        entry: dict[str, Any] = {
            "weight": target.weight, "node": target.node, "op_type": target.op_type,
            "inputs": target.inputs, "outputs": target.outputs, "bits": BITS,
            "block_size": config.block_size, "format": config.weight_only_format,
            "rounding": "nearest",
        }
        if measured is not None and measured.hessian is not None:
            result = gptq_blocks(rows, measured.hessian[0], config.block_size)
            quants[target.node] = result.quant
            entry.update(rounding="gptq", output_error_nearest=result.error_nearest,
                         output_error=result.error_gptq)
        else:
            quants[target.node] = quantize_rtn(rows, config.block_size)
        entries.append(entry)
    written = write_weight_only(model, targets, quants, config.weight_only_format)
    keep_declared_shapes(written.graph, declared_shapes)
    errors = [(e["output_error_nearest"], e["output_error"]) for e in entries
              if "output_error" in e]
    section: dict[str, Any] = {
        "bits": BITS, "block_size": config.block_size, "format": config.weight_only_format,
        "rounding": config.weight_rounding,
        "weights_quantized": len(entries),
        "model_bytes_before": _model_bytes(model), "model_bytes_after": _model_bytes(written),
        "mean_output_error_nearest": float(np.mean([e[0] for e in errors])) if errors else None,
        "mean_output_error": float(np.mean([e[1] for e in errors])) if errors else None,
        "weights": entries,
    }
    return WeightOnlyResult(written, section, summary)


def weight_only_plan(plan: QuantPlan, section: Mapping[str, Any]) -> QuantPlan:
    """`plan` as the weight-only run carried it out: only the nodes whose weight went to 4 bits
    are quantized, no tensor gets Q/DQ."""
    done = {e["node"] for e in section["weights"]}
    reason = f"weight-only int{BITS}, block {section['block_size']}, {section['format']}"
    nodes = tuple(
        NodeDecision(n.node, n.op_type, True, reason) if n.node in done
        else NodeDecision(n.node, n.op_type, False, "weight-only: stays float")
        for n in plan.nodes)
    return QuantPlan(activations=(), weights=(), biases=(), nodes=nodes)
