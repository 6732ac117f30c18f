"""A run's verdict for CI: a Markdown summary for the job's page (`--summary-md`, and
`$GITHUB_STEP_SUMMARY`), and one line of JSON for scripts (`--json`). Both read the report."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from qcal._verdict import agreement_cell, other_warnings, quality_verdict, sqnr_cell
from qcal.accuracy.gates import GateResult
from qcal.drift import Drift

__all__ = ["machine_summary", "markdown_summary"]

_DRIFT_ROWS = 15


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _failed(report: Mapping[str, Any], drift: Drift | None, fail_on_drift: bool) -> list[str]:
    failed = [g["option"] for g in report["gates"] if not g["passed"]]
    if drift is not None and fail_on_drift and drift.over:
        failed.append("fail-on-drift")
    return failed


def markdown_summary(report: Mapping[str, Any], *, drift: Drift | None = None,
                     fail_on_drift: bool = False, html: Path | None = None) -> str:
    model = PurePath(report["input_model"]["path"]).name
    verdict = quality_verdict(report)
    failed = _failed(report, drift, fail_on_drift)
    status = "FAIL" if failed or (verdict is not None and not verdict.ok) else "PASS"
    lines = [f"### qcal {_cell(model)}: {status}", ""]
    if verdict is not None:
        lines += [_cell(verdict.text), ""]
    cov, data = report["coverage"], report["data"]
    coverage = f"{cov['quantized']} of {cov['nodes']} nodes quantized"
    if "macs_quantized_fraction" in cov:
        coverage += f", {cov['macs_quantized_fraction']:.1%} of Conv/MatMul/Gemm compute"
    facts = [
        ("preset", f"{report['preset']['name']}, method {report['config']['method']}"),
        ("calibration data", f"{data['kind']} {data['path'] or ''}, {data['samples']} samples"
                             + (" (SYNTHETIC)" if data["synthetic"] else "")),
        ("coverage", coverage),
    ]
    timings = report["timings_seconds"]
    float_s, quant_s = (timings.get("latency_float_1_thread"),
                        timings.get("latency_quantized_1_thread"))
    if float_s and quant_s is not None:
        latency = (f"quantized {1000 * quant_s:.3g} ms, float {1000 * float_s:.3g} ms "
                   f"({quant_s / float_s:.2f}x)")
        facts.append(("latency, 1 thread", latency))
    if report["output_model"] is not None:
        facts.append(("model written", f"`{report['output_model']['path']}`"))
    if html is not None:
        facts.append(("HTML report", f"`{html}`"))
    lines += ["| | |", "| --- | --- |", *(f"| {k} | {_cell(v)} |" for k, v in facts), ""]
    evaluation = report["evaluation"]
    if evaluation:
        lines += ["| output | SQNR dB | top-1 agreement | accuracy float | accuracy quantized |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {_cell(o['name'])} | {sqnr_cell(o)} | "
                  f"{agreement_cell(o)} | {_fmt(o['float_accuracy'], '.2%')} | "
                  f"{_fmt(o['quantized_accuracy'], '.2%')} |" for o in evaluation["outputs"]]
        lines.append("")
    if report["gates"]:
        # worded as the terminal's "gate:" lines (a yes/no gate read "(1 yes, 0 no) 0,
        # threshold 0")
        lines += [f"- {'passed' if g['passed'] else '**FAILED**'}: {_cell(g['option'])}: "
                  f"{_cell(GateResult(**g).describe())}" for g in report["gates"]]
        lines.append("")
    if drift is not None:
        lines += _drift_lines(drift)
    warnings = other_warnings(report)
    if warnings:
        lines += [f"- warning: {_cell(w)}" for w in warnings] + [""]
    return "\n".join(lines) + "\n"


def _drift_lines(drift: Drift) -> list[str]:
    lines = [f"**Drift from the baseline**: {_cell(drift.describe())}", ""]
    lines += [f"- differs: {_cell(n)}" for n in drift.notes]
    if drift.moves:
        lines += ["", "| tensor / output | measure | old | new | change | threshold | |",
                  "| --- | --- | --- | --- | ---: | ---: | --- |"]
        for move in drift.moves[:_DRIFT_ROWS]:
            change = "changed" if abs(move.change) == float("inf") else f"{move.change:.4g}"
            lines.append(f"| {_cell(move.name)} | {move.measure} | {_cell(move.old)} | "
                         f"{_cell(move.new)} | {change} | {move.threshold:g} | "
                         f"{'**over**' if move.over else 'ok'} |")
        if len(drift.moves) > _DRIFT_ROWS:
            lines.append(f"\n{len(drift.moves) - _DRIFT_ROWS} more moved (see `qcal diff`).")
    return [*lines, ""]


def machine_summary(report: Mapping[str, Any], *, drift: Drift | None = None,
                    fail_on_drift: bool = False, report_path: Path | None = None,
                    html: Path | None = None) -> dict[str, Any]:
    """The run in one JSON object; `exit_code` is what the command exits with."""
    verdict = quality_verdict(report)
    failed = _failed(report, drift, fail_on_drift)
    cov, fallback = report["coverage"], report["fallback"]
    evaluation = report["evaluation"]
    return {
        "model": report["input_model"]["path"],
        "output": None if report["output_model"] is None else report["output_model"]["path"],
        "report": None if report_path is None else str(report_path),
        "html": None if html is None else str(html),
        "preset": report["preset"]["name"],
        "method": report["config"]["method"],
        "samples": report["data"]["samples"],
        "synthetic": report["data"]["synthetic"],
        "nodes": cov["nodes"],
        "quantized_nodes": cov["quantized"],
        "compute_quantized": cov.get("macs_quantized_fraction"),
        "quality": None if verdict is None else verdict.level,
        "outputs": [] if not evaluation else [
            {"name": o["name"], "sqnr_db": o["sqnr_db"], "top1_agreement": o["top1_agreement"]}
            for o in evaluation["outputs"]],
        "fallback_reached": None if fallback is None else fallback["reached"],
        "failed": failed,
        "drift_over": None if drift is None else len(drift.over),
        "warnings": len(report["warnings"]),
        "exit_code": 7 if failed else 0,
        **_weight_only(report),
    }


def _weight_only(report: Mapping[str, Any]) -> dict[str, Any]:
    """--weight-only runs: the weights written at 4 bits and the model's size before and after."""
    section = report.get("weight_only")
    if not section:
        return {}
    return {"weight_only": {key: section[key] for key in (
        "bits", "block_size", "format", "rounding", "weights_quantized", "model_bytes_before",
        "model_bytes_after", "mean_output_error_nearest", "mean_output_error")}}
