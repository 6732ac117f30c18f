"""The JSON report: what was quantized, how, from which data, and how close it stays to float.

The layout is versioned by `schema_version` and described by `report.schema.json`, shipped in the
package. Everything but `timings_seconds` is a pure function of the inputs and options, so two
identical runs give identical reports apart from the timings.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime

import qcal
from qcal.config import CalibrationConfig
from qcal.evaluate import Comparison
from qcal.model import LoadedModel, PrepStep, QuantPlan
from qcal.onnx_mapping import OnnxQParams
from qcal.presets import Preset
from qcal.ranges import RangeChoice
from qcal.schemes import QParams

__all__ = ["SCHEMA_VERSION", "TensorRecord", "build_report", "dump_report", "report_schema"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TensorRecord:
    tensor: str
    role: str  # "activation" | "weight" | "bias"
    method: str
    choice: RangeChoice | None
    qparams: QParams | None
    onnx: OnnxQParams
    consumers: tuple[str, ...]


def report_schema() -> dict[str, Any]:
    text = resources.files("qcal").joinpath("report.schema.json").read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def dump_report(report: Mapping[str, Any]) -> bytes:
    return (json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _floats(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]


def _ints(values: np.ndarray) -> list[int | float]:
    # OneFlow keeps its zero point as a float; integral values are written as integers.
    return [int(v) if float(v).is_integer() else float(v) for v in np.asarray(values).ravel()]


def _onnx_type_name(dtype: int) -> str:
    return str(onnx.TensorProto.DataType.Name(dtype)).lower()


def tensor_json(record: TensorRecord) -> dict[str, Any]:
    q = record.onnx
    entry: dict[str, Any] = {
        "name": record.tensor,
        "role": record.role,
        "method": record.method,
        "consumers": list(record.consumers),
    }
    if record.choice is not None:
        entry["statistics"] = {
            "min": _floats(record.choice.observed.min),
            "max": _floats(record.choice.observed.max),
        }
        entry["range"] = {
            "min": _floats(record.choice.stats.min),
            "max": _floats(record.choice.stats.max),
            **record.choice.summary,
        }
    if record.qparams is not None:
        entry["qparams"] = {
            "scale": _floats(record.qparams.scale),
            "zero_point": _ints(record.qparams.zero_point),
            "quant_min": record.qparams.quant_min,
            "quant_max": record.qparams.quant_max,
            "axis": record.qparams.axis,
        }
    entry["onnx"] = {
        "type": _onnx_type_name(q.dtype),
        "scale": _floats(q.scale),
        "zero_point": _ints(q.zero_point),
        "axis": q.axis,
        "clip": None if q.clip_min is None or q.clip_max is None
        else {"min": _floats(q.clip_min), "max": _floats(q.clip_max)},
        "exact": q.exact,
        "deviations": list(q.deviations),
        "replacement": q.replacement,
    }
    return entry


def _coverage(plan: QuantPlan) -> dict[str, Any]:
    quantized = [n for n in plan.nodes if n.quantized]
    skipped_by_reason: dict[str, int] = {}
    for node in plan.nodes:
        if not node.quantized:
            skipped_by_reason[node.reason] = skipped_by_reason.get(node.reason, 0) + 1
    return {
        "nodes": len(plan.nodes),
        "quantized": len(quantized),
        "skipped": len(plan.nodes) - len(quantized),
        "skipped_by_reason": dict(sorted(skipped_by_reason.items())),
    }


def build_report(
    *,
    config: CalibrationConfig,
    preset: Preset,
    loaded: LoadedModel,
    steps: Sequence[PrepStep],
    plan: QuantPlan,
    records: Mapping[str, TensorRecord],
    calib: Any,
    calib_samples: int,
    eval_source: Any,
    labels_path: Path | None,
    comparison: Comparison | None,
    output: Path | None,
    model_bytes: bytes,
    timings: Mapping[str, float],
) -> dict[str, Any]:
    import hashlib

    warnings: list[str] = []
    if calib.is_synthetic:
        warnings.append(
            "calibrated on SYNTHETIC random data, not on real data: the ranges, and so the "
            "accuracy of the quantized model, mean nothing for real inputs"
        )
    if any(not r.onnx.exact for r in records.values()):
        warnings.append(
            f"the QDQ model deviates from the {preset.name} fake-quant for some tensors "
            "(see tensors[].onnx.deviations)"
        )
    if any(r.onnx.replacement for r in records.values()):
        warnings.append("degenerate quantization parameters were replaced (see tensors[].onnx.replacement)")
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": {
            "qcal": qcal.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "input_model": {
            "path": str(loaded.path),
            "sha256": loaded.sha256,
            "preparation": [{"step": s.name, "detail": s.detail} for s in steps],
        },
        "output_model": None if output is None else {
            "path": str(output),
            "size_bytes": len(model_bytes),
            "sha256": hashlib.sha256(model_bytes).hexdigest(),
        },
        "config": config.to_json(),
        "preset": {"name": preset.name, "knobs": _jsonable(preset.knobs),
                   "native_method": preset.native_method},
        "data": {
            "kind": calib.kind,
            "path": None if calib.path is None else str(calib.path),
            "synthetic": bool(calib.is_synthetic),
            "samples": calib_samples,
            "batch_size": config.batch_size,
        },
        "evaluation": None if comparison is None else {
            "data": "calibration" if eval_source is None else str(eval_source.path),
            "labels": None if labels_path is None or eval_source is None else str(labels_path),
            **comparison.to_json(),
        },
        "coverage": _coverage(plan),
        "tensors": [tensor_json(records[name]) for name in sorted(records)],
        "nodes": [
            {"name": n.node, "op_type": n.op_type, "quantized": n.quantized, "reason": n.reason}
            for n in plan.nodes
        ],
        "warnings": warnings,
        "timings_seconds": dict(timings),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value
