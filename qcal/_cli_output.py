"""What the `qcal` command prints: its two consoles, the progress bar and the summary and
metric tables of a run (the report's figures, formatted for a terminal)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from qcal._verdict import agreement_cell, other_warnings, padding_words, quality_verdict, sqnr_cell
from qcal.accuracy.gates import GateResult
from qcal.accuracy.latency import disturbed, looks_slower
from qcal.config import CalibrationConfig
from qcal.drift import Drift
from qcal.report import reasons_by_kind


def _console(*, stderr: bool) -> Console:
    """Plain text when NO_COLOR is set (no colour nor any other style: https://no-color.org);
    rich itself writes no control character when the stream is not a terminal. Nor does it
    wrap lines there: a CI log keeps each message on one line (grep finds the verdict whole,
    where it was cut at 80 columns), and tables are as wide as what they hold (an output or
    tensor name whole, where it was cut to "keypoint…")."""
    plain = bool(os.environ.get("NO_COLOR"))
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty()
    return Console(stderr=stderr, highlight=False, color_system=None if plain else "auto",
                   soft_wrap=piped, width=_PIPED_WIDTH if piped else None)


# Columns a Console writing to a file or pipe lays tables out in: wider than any of its lines,
# so that no name is cut (tables take the width of what they hold, not this).
_PIPED_WIDTH = 10_000


stderr = _console(stderr=True)
stdout = _console(stderr=False)


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[[str, int, int | None], None] | None]:
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("samples"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(),
    )
    tasks: dict[str, TaskID] = {}
    with Progress(*columns, console=stderr, transient=False) as bar:

        def update(stage: str, advance: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, rate="")
            task = bar.tasks[tasks[stage]]
            bar.update(tasks[stage], advance=advance)
            speed = task.finished_speed or task.speed
            if speed:
                bar.update(tasks[stage], rate=f"{speed:,.0f}/s")

        yield update


_FALLBACK_REASON = "by the accuracy fallback"
_MAX_REASONS = 12


def _float_reasons(by_reason: dict[str, int]) -> list[tuple[int, str]]:
    """The report's reasons for float nodes, most frequent first, those differing only in the
    names they quote as one; the fallback's per-tensor reasons as one line, and the rarest
    folded into one when there are many."""
    fallback = sum(n for reason, n in by_reason.items() if _FALLBACK_REASON in reason)
    rows = sorted(((n, reason) for reason, n in reasons_by_kind(by_reason).items()
                   if _FALLBACK_REASON not in reason), key=lambda row: (-row[0], row[1]))
    if fallback:
        why = (f"kept float {_FALLBACK_REASON} (each tensor's reason: the report's "
               "fallback.kept_float)")
        rows.insert(0, (fallback, why))
    if len(rows) > _MAX_REASONS:
        rest = rows[_MAX_REASONS - 1:]
        why = f"for {len(rest)} other reasons (the report's coverage.skipped_by_reason)"
        rows = rows[:_MAX_REASONS - 1] + [(sum(n for n, _ in rest), why)]
    return rows


def _transform_lines(transforms: dict[str, Any]) -> list[str]:
    """One line per graph transform of the run (`--equalize`, `--smooth-quant`)."""
    lines = []
    if "equalize" in transforms:
        pairs = transforms["equalize"]["pairs"]
        inputs = transforms["equalize"].get("depthwise_inputs")
        entries, what = (pairs, "Conv pair") if inputs is None else (
            inputs, "depthwise input")
        before = max((p["range_ratio_before"] for p in entries), default=1.0)
        after = max((p["range_ratio_after"] for p in entries), default=1.0)
        lines.append(f"equalize: {len(entries)} {what}{'s' * (len(entries) != 1)}, largest "
                     f"channel range ratio {before:.3g} -> {after:.3g}")
    if "smooth_quant" in transforms:
        layers = transforms["smooth_quant"]["layers"]
        changed = [s for s in layers if s["alpha"] is not None]
        before = sum(s["output_error_before"] for s in changed)
        after = sum(s["output_error_after"] for s in changed)
        lines.append(f"smooth-quant: {len(changed)} of {len(layers)} activations smoothed, "
                     f"summed layer output error {before:.3g} -> {after:.3g}")
    return lines


def _show_summary(result: Any) -> None:
    report = result.report
    cov = report["coverage"]
    if report.get("weight_only"):
        stdout.print(_weight_only_line(report["weight_only"]))
    else:
        stdout.print(
            f"[bold]qcal[/] {report['preset']['name']} preset, method "
            f"{report['config']['method']}: {cov['quantized']} of {cov['nodes']} nodes "
            f"quantized, {cov['skipped']} kept in float; {len(report['tensors'])} tensors; "
            f"calibrated on {report['data']['samples']} samples"
            f" with {', '.join(report['runtime']['providers_used']) or 'onnxruntime'}"
        )
    for count, reason in _float_reasons(cov["skipped_by_reason"]):
        stdout.print(f"  kept in float: {count} × {reason}")
    for line in _transform_lines(report.get("transforms") or {}):
        stdout.print(f"  {line}")
    _show_accuracy(report)
    evaluation = report["evaluation"]
    if evaluation and evaluation["outputs"]:  # none: no numeric output (the verdict says so)
        stdout.print(_metrics_table(
            f"float vs quantized on {evaluation['samples']} samples ({evaluation['data']})"
            + padding_words(evaluation.get("padding")), evaluation["outputs"]))
    for gate in report["gates"]:  # worded as in the failure message
        style = "green" if gate["passed"] else "bold red"
        stdout.print(f"[{style}]gate:[/] {GateResult(**gate).describe()}")
    _show_verdict(report)
    _show_latency(report)
    for warning in other_warnings(report):  # a failed gate's is its red "gate:" line above
        style = "bold red" if "SYNTHETIC" in warning else "yellow"
        stdout.print(f"[{style}]warning:[/] {warning}")
    if result.output is not None:
        stdout.print(f"wrote {result.output}")
    if result.report_path is not None:
        stdout.print(f"wrote {result.report_path}")


def _weight_only_line(section: dict[str, Any]) -> str:
    """--weight-only: how many weights went to 4 bits, the model's size, GPTQ's effect."""
    line = (f"[bold]qcal[/] weight-only int{section['bits']} ({section['format']}, block "
            f"{section['block_size']}, {section['rounding']}): {section['weights_quantized']} "
            f"MatMul/Gemm weights to {section['bits']} bits; model "
            f"{section['model_bytes_before'] / 1e6:.2f} MB -> "
            f"{section['model_bytes_after'] / 1e6:.2f} MB")
    if section["mean_output_error"] is not None:
        line += (f"; mean layer output error {section['mean_output_error_nearest']:.3g} "
                 f"nearest -> {section['mean_output_error']:.3g} gptq")
    return line


def _show_verdict(report: dict[str, Any]) -> None:
    """The measured quality in one sentence, and what to do when it is below the floor."""
    verdict = quality_verdict(report)
    if verdict is None:
        return
    style = {"broken": "bold red", "below-floor": "bold red", "within-floor": "green"}.get(
        verdict.level)
    headline = f"[{style}]{verdict.headline}[/]" if style else verdict.headline
    stdout.print(f"{headline}: {verdict.detail}")


def _show_accuracy(report: dict[str, Any]) -> None:
    """Compute coverage, the most sensitive tensors and what the fallback kept in float."""
    cov = report["coverage"]
    if "macs_quantized_fraction" in cov and not cov["compute_nodes"]:
        # no share to give: a model whose compute is all inside If/Loop/Scan bodies says how
        # much of that is quantized in the coverage warning
        stdout.print("  compute quantized: no Conv/MatMul/Gemm in the main graph")
    elif "macs_quantized_fraction" in cov:
        unit = "MACs" if cov["basis"] == "macs" else "nodes (shapes unknown)"
        # a recurrent layer in a Loop (as tf2onnx writes Keras RNNs) may hold most of the work
        inside = cov.get("compute_nodes_in_bodies") or 0
        where = "the main graph's " if inside else ""
        left_out = f"; {inside} more inside If/Loop/Scan bodies, not counted" if inside else ""
        if cov.get("recurrent_layers"):  # 100 % of a Linear after three LSTMs is not the model
            left_out += f"; {cov['recurrent_layers']}, float, not counted"
        stdout.print(
            f"  compute quantized: {cov['macs_quantized_fraction']:.1%} of {where}"
            f"Conv/MatMul/Gemm {unit} ({cov['quantized_compute_nodes']} of "
            f"{cov['compute_nodes']} nodes{left_out})"
        )
    sensitivity = report.get("sensitivity")
    if sensitivity and sensitivity.get("method") == "error-jump":
        table = Table(title_justify="left", title=(
            f"where the error jumps, float vs quantized ({sensitivity['samples']} samples; "
            f"all {len(sensitivity['tensors'])} in the report)"))
        for col in ("tensor", "role", "error jump (noise/signal)"):
            table.add_column(col, justify="left" if col in ("tensor", "role") else "right")
        for entry in sensitivity["tensors"][:8]:
            table.add_row(entry["tensor"], entry["role"], _fmt(entry["noise_ratio"], ".3g"))
        stdout.print(table)
    elif sensitivity:
        table = Table(title_justify="left", title=(
            f"most sensitive tensors, each quantized alone ({sensitivity['samples']} samples; "
            f"all {len(sensitivity['tensors'])} in the report)"))
        for col in ("tensor", "role", "output SQNR dB", "local SQNR dB"):
            table.add_column(col, justify="left" if col in ("tensor", "role") else "right")
        for entry in sensitivity["tensors"][:8]:
            table.add_row(entry["tensor"], entry["role"],
                          _fmt(entry["output_sqnr_db"], ".1f", "exact"),
                          _fmt(entry["local_sqnr_db"], ".1f", "exact"))
        stdout.print(table)
    fallback = report.get("fallback")
    if fallback:
        style = "green" if fallback["reached"] else "bold red"
        stdout.print(f"[{style}]fallback:[/] {fallback['message']}")
        for entry in fallback["kept_float"][:10]:
            stdout.print(f"  kept float: {entry['tensor']} ({entry['reason']})")
        if len(fallback["kept_float"]) > 10:
            stdout.print(f"  ... and {len(fallback['kept_float']) - 10} more (see the report)")


def _metrics_table(title: str, outputs: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("output", "SQNR dB", "cosine", "max |err|", "top-1 agree", "acc float", "acc quant"):
        table.add_column(col, justify="left" if col == "output" else "right")
    for out in outputs:
        table.add_row(
            out["name"], sqnr_cell(out), _fmt(out["cosine"], ".5f"),
            _fmt(out["max_abs_error"], ".4g"), agreement_cell(out),
            _fmt(out["float_accuracy"], ".2%"), _fmt(out["quantized_accuracy"], ".2%"),
        )
    return table


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


# How far apart the ratios at one and two threads may lie before the line says a timing may
# have been disturbed.
_RATIOS_APART = 2.5


def _show_latency(report: Mapping[str, Any]) -> None:
    """The measured speed of the written model (machine timings, so not in the warnings). A
    cause is named only where a gate found it slower beyond the timing noise; a median over
    the gate's ratio that its test judged noise says so (a run under load printed "1.36x:
    slower than the float model" while the gate passed it, and 0.93x was its speed)."""
    timings = report["timings_seconds"]
    weight_only = "weight_only" in report
    float_s = timings.get("latency_float_1_thread")
    quant_s = timings.get("latency_quantized_1_thread")
    if not float_s or quant_s is None:
        return
    ratio = quant_s / float_s
    line = (f"latency at 1 thread on this machine: quantized {1000 * quant_s:.3g} ms, "
            f"float {1000 * float_s:.3g} ms ({ratio:.2f}x)")
    two_float, two_quant = (timings.get("latency_float_2_threads"),
                            timings.get("latency_quantized_2_threads"))
    if two_float and two_quant is not None:
        two_ratio = two_quant / two_float
        line += f"; at 2 threads {two_ratio:.2f}x"
        if disturbed(float_s, two_float):  # timed twice so (`qcal.accuracy.latency`)
            line += (f" (the float model took {two_float / float_s:.2f}x its 1-thread time, "
                     "timed twice: other work on this machine may have held a core, or two "
                     "threads slow this model itself, so that ratio may say little)")
        elif max(ratio, two_ratio) > _RATIOS_APART * min(ratio, two_ratio):
            # a model's integer kernels gain alike at one thread and two, within a factor of
            # two (0.98x / 1.79x on a model of 0.1 ms): a run under load read 0.15x at one
            # thread where 0.55x was its speed
            line += ("; the two ratios lie far apart: other work on this machine may have "
                     "disturbed a timing, so time it again on a quiet machine")
        ratio = max(ratio, two_ratio)
    # Which of them costs more is not measured here: Q/DQ pairs around float ops on one model,
    # integer depthwise kernels slower than float ones on another.
    why = ("unpacking 4-bit weights costs more than reading them saves"
           if weight_only else "its integer kernels, with the Q/DQ and layout changes around "
           "them, take longer than the float kernels they replace")
    found = any(g["option"] in ("not-slower", "fail-if-slower") and not g["passed"]
                for g in report["gates"])
    if found:
        stdout.print(f"[yellow]{line}: slower than the float model; on this model {why}[/]")
    elif looks_slower(ratio) and _not_slower_checked(report["config"]):
        stdout.print(f"{line}: slower in this measurement, within the timing noise by the "
                     "not-slower gate's test")
    elif looks_slower(ratio):
        stdout.print(f"[yellow]{line}: slower than the float model in this measurement[/]")
    else:
        stdout.print(line)


def _not_slower_checked(config: Mapping[str, Any]) -> bool:
    """Whether the run's built-in not-slower gate judged the timings (`CalibrationConfig.gates`)."""
    return CalibrationConfig(
        preset=config["preset"], placement=config["placement"],
        allow_slower=config["allow_slower"], fail_if_slower=config["fail_if_slower"],
        weight_only=config.get("weight_only"),
    ).gates().not_slower


def _drift_table(drift: Drift, title: str, limit: int | None = 25) -> Table:
    """What moved between two reports, over its threshold first (`limit` rows; None: all)."""
    table = Table(title=title, title_justify="left")
    for col in ("tensor / output", "measure", "old", "new", "change", "threshold", ""):
        table.add_column(col, justify="right" if col in ("change", "threshold") else "left")
    shown = drift.moves if limit is None else drift.moves[:limit]
    for move in shown:
        change = "changed" if abs(move.change) == float("inf") else f"{move.change:.4g}"
        table.add_row(move.name, move.measure, move.old, move.new, change,
                      f"{move.threshold:g}", "[bold red]over[/]" if move.over else "ok")
    if len(shown) < len(drift.moves):
        table.caption = f"{len(drift.moves) - len(shown)} more moved within their thresholds " \
                        "(--all shows every one)"
    return table
