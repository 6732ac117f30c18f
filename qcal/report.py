"""The JSON report: what was quantized, how, from which data, and how close it stays to float.

The layout is versioned by `schema_version` and described by `report.schema.json`, shipped in the
package. Everything but `timings_seconds` is a pure function of the inputs and options, so two
identical runs give identical reports apart from the timings.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime

from qcal._version import __version__
from qcal.accuracy.coverage import Coverage
from qcal.accuracy.evaluate import Comparison, numeric_outputs
from qcal.accuracy.fallback import FallbackResult
from qcal.accuracy.gates import GateResult
from qcal.accuracy.sensitivity import SensitivityResult
from qcal.config import CalibrationConfig
from qcal.graph.files.load import LoadedModel
from qcal.graph.files.save import ExternalFile
from qcal.graph.model import PrepStep, QuantPlan
from qcal.numerics.onnx_mapping import OnnxQParams
from qcal.numerics.presets import Preset
from qcal.numerics.ranges import RangeChoice
from qcal.numerics.schemes import QParams

__all__ = [
    "SCHEMA_VERSION", "TensorRecord", "build_report", "dump_report", "load_report",
    "reading_report", "report_schema",
]

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
    # How a weight's codes were chosen, when not by rounding to nearest (GPTQ): the method and
    # the layer's relative output error both ways.
    rounding: Mapping[str, Any] | None = None
    # Bias correction: the largest shift of the output mean taken back by the node's bias.
    bias_shift: float | None = None


def report_schema() -> dict[str, Any]:
    text = resources.files("qcal").joinpath("report.schema.json").read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def dump_report(report: Mapping[str, Any]) -> bytes:
    """The report as UTF-8 JSON: top-level keys and the entries of top-level lists and objects
    one per line, each entry on its line in compact form (one tensor, one node per line).

    json's C encoder writes the entries; indenting everything would use its pure-Python
    encoder, 3x slower (half a second for a 300-tensor model).
    """
    encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
    lines = ["{"]
    for i, (key, value) in enumerate(report.items()):
        last = "" if i == len(report) - 1 else ","
        if isinstance(value, list) and value:
            lines.append(f"  {encode(key)}: [")
            lines += [f"    {encode(v)}," for v in value]
            lines[-1] = lines[-1][:-1]
            lines.append(f"  ]{last}")
        elif isinstance(value, dict) and value:
            lines.append(f"  {encode(key)}: {{")
            lines += [f"    {encode(k)}: {encode(v)}," for k, v in value.items()]
            lines[-1] = lines[-1][:-1]
            lines.append(f"  }}{last}")
        else:
            lines.append(f"  {encode(key)}: {encode(value)}{last}")
    lines.append("}")
    return ("\n".join(lines) + "\n").encode()


def _floats(values: np.ndarray) -> list[float]:
    return np.asarray(values, dtype=np.float64).ravel().tolist()  # type: ignore[no-any-return]


def _ints(values: np.ndarray) -> list[int | float]:
    array = np.asarray(values).ravel()
    if array.dtype.kind in "iu":
        return array.tolist()  # type: ignore[no-any-return]
    # OneFlow keeps its zero point as a float; integral values are written as integers.
    return [int(v) if float(v).is_integer() else float(v) for v in array]


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
        if record.choice.histogram is not None:
            entry["histogram"] = record.choice.histogram.to_json()
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
    if record.rounding is not None:
        entry["rounding"] = dict(record.rounding)
    if record.bias_shift is not None:
        entry["bias_correction"] = {"max_abs_shift": record.bias_shift}
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


_QUOTED_NAME = re.compile(r"'[^']*'")


def reasons_by_kind(by_reason: Mapping[str, int]) -> dict[str, int]:
    """`coverage.skipped_by_reason` with the reasons that differ only in the names they quote
    (of nodes, tensors) counted as one, said by the first of them in name order and how many
    more there are: four LayerNorm statistics kept float are one line, not four (their names
    elided, "'…' kept float with output '…' of '…'" read as a placeholder left unfilled)."""
    kinds: dict[str, dict[str, int]] = {}
    for reason, count in by_reason.items():
        kinds.setdefault(_QUOTED_NAME.sub("''", reason), {})[reason] = count
    return {min(same) if len(same) == 1 else f"{min(same)} (and {len(same) - 1} more like it)":
            sum(same.values()) for same in kinds.values()}


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
    evaluation_data: str | None = None,
    compute_coverage: Coverage | None = None,
    sensitivity: SensitivityResult | None = None,
    fallback: FallbackResult | None = None,
    gates: Sequence[GateResult] = (),
    providers_used: Sequence[str] = (),
    external_data: ExternalFile | None = None,
    statistics: Mapping[str, Any] | None = None,
    weight_only: Mapping[str, Any] | None = None,
    transforms: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
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
    warnings += [f"output {o.name!r} is {'empty' if o.float_all_empty else '0'} on every "
                 "evaluation sample in the float model: its comparison with the quantized model "
                 "says nothing of it"
                 for o in (comparison.outputs if comparison is not None else ()) if o.float_all_zero]
    if comparison is not None:
        warnings += _uncompared_outputs(loaded.model)
    warnings += _accuracy_warnings(compute_coverage, fallback, gates)
    warnings += notes  # what the run changed of the options, and why
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": {
            "qcal": __version__,
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
            "external_data": None if external_data is None else {
                "path": str(external_data.path),
                "size_bytes": external_data.size_bytes,
                "sha256": external_data.sha256,
            },
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
            # Only when the statistics were read from a file (calibrate --stats).
            **({} if statistics is None else {"statistics": dict(statistics)}),
        },
        "runtime": {
            "providers_requested": list(config.providers),
            "providers_used": list(providers_used),
            "threads": config.threads,
        },
        "evaluation": None if comparison is None else {
            "data": evaluation_data or ("calibration" if eval_source is None
                                        else str(eval_source.path)),
            "labels": None if labels_path is None or eval_source is None else str(labels_path),
            **comparison.to_json(),
        },
        "coverage": {**_coverage(plan), **_compute_json(compute_coverage)},
        "sensitivity": None if sensitivity is None else {
            **sensitivity.to_json(), "data": evaluation_data or _data_name(eval_source),
        },
        "fallback": None if fallback is None else fallback_json(fallback),
        "gates": [g.to_json() for g in gates],
        # --weight-only runs alone: their 4-bit weights (other runs' reports stay as they were)
        **({} if weight_only is None else {"weight_only": dict(weight_only)}),
        "tensors": [tensor_json(records[name]) for name in sorted(records)],
        "nodes": [
            {"name": n.node, "op_type": n.op_type, "quantized": n.quantized, "reason": n.reason}
            for n in plan.nodes
        ],
        "warnings": warnings,
        "timings_seconds": dict(timings),
        # --equalize / --smooth-quant: what they changed (absent without them)
        **({"transforms": dict(transforms)} if transforms else {}),
    }


def _data_name(source: Any) -> str:
    return "calibration" if source is None else str(source.path)


def _compute_json(coverage: Coverage | None) -> dict[str, Any]:
    if coverage is None:
        return {}
    return coverage.to_json()


def fallback_json(fallback: FallbackResult) -> dict[str, Any]:
    """The fallback search: outcome, what it kept in float and why, and every model it checked."""
    return {
        "reached": fallback.reached,
        "message": fallback.message,
        "kept_float": [
            {
                **c.sensitivity.to_json(),
                "compute_lost_fraction": float(f"{c.compute_lost:.6g}"),
                "kept_with": list(c.together),
                "reason": c.reason(),
            }
            for c in fallback.kept
        ],
        "steps": [step.to_json() for step in fallback.steps],
    }


def _uncompared_outputs(model: onnx.ModelProto) -> list[str]:
    """A warning for each graph output the evaluation leaves out: not a numeric tensor."""
    compared = set(numeric_outputs(model))
    found = []
    for output in model.graph.output:
        if output.name in compared:
            continue
        kind = output.type.WhichOneof("value") or "value of no declared type"
        kind = {"tensor_type": "string tensor", "sequence_type": "sequence",
                "map_type": "map", "optional_type": "optional"}.get(kind, kind)
        found.append(f"output {output.name!r} is a {kind}, not a numeric tensor: it is not "
                     "compared with the float model, and no figure of this report covers it")
    return found


def _accuracy_warnings(
    coverage: Coverage | None, fallback: FallbackResult | None, gates: Sequence[GateResult]
) -> list[str]:
    found = []
    if coverage is not None and not coverage.anything_quantized:
        found.append("nothing was quantized: no node of this model is quantized under the "
                     "current selection and placement, or onnxruntime would run it in float "
                     "(see nodes[].reason); the output model computes exactly as the float one")
    if coverage is not None and coverage.note:
        found.append(f"coverage: {coverage.note}")
    if fallback is not None and not fallback.reached:
        found.append(f"fallback: {fallback.message}")
    found += [gate_warning(g) for g in gates if not g.passed]
    return found


def gate_warning(gate: GateResult) -> str:
    """The warning a failed gate leaves in the report."""
    return f"gate failed: {gate.describe()}"


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


# ------------------------------------------------------------------ reading a report back


def load_report(path: Path, *, what: str = "report") -> dict[str, Any]:
    """A report written by `qcal calibrate`, for `qcal report`, `qcal diff` and `--baseline`.

    Raises:
        DataError: the file is missing, not JSON, or not a qcal report of this schema version.
    """
    from qcal.numerics.errors import DataError

    try:
        report = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"{what} {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{what} {path}: cannot read it as JSON ({err})") from None
    if not isinstance(report, dict) or "schema_version" not in report:
        raise DataError(f"{what} {path}: not a qcal report (no schema_version)")
    if report["schema_version"] != SCHEMA_VERSION:
        raise DataError(f"{what} {path}: report schema {report['schema_version']!r}; this qcal "
                        f"reads schema {SCHEMA_VERSION}")
    missing = [key for key in report_schema()["required"] if key not in report]
    if missing:
        raise DataError(f"{what} {path}: not a complete qcal report (no {', '.join(missing)})")
    return report


@contextmanager
def reading_report(*paths: Path) -> Iterator[None]:
    """A field missing or of the wrong type in a report (edited by hand, or truncated) becomes
    a DataError naming the file (or files), not an internal error."""
    from qcal.numerics.errors import DataError

    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        names = " or ".join(str(p) for p in paths)
        raise DataError(f"report {names}: not a valid qcal report "
                        f"({type(err).__name__}: {err})") from None
