"""`qcal diff`, and the drift options `qcal calibrate --baseline` shares with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from qcal._cli_output import _drift_table, stdout
from qcal.cli._app import _existing, main, reports_errors
from qcal.cli._options import _key_values
from qcal.drift import THRESHOLDS, UNITS, Drift
from qcal.numerics.errors import DriftGateError

F = TypeVar("F", bound=Callable[..., Any])

_THRESHOLD_HELP = ", ".join(f"{name}={default:g}{UNITS[name]}"
                            for name, (default, _) in THRESHOLDS.items())


def drift_options(command: F) -> F:
    """--drift-threshold and --fail-on-drift, for every command that compares with a report."""
    command = click.option(
        "--fail-on-drift", is_flag=True,
        help="Exit 7 when a figure moved more than its threshold.")(command)
    return click.option(
        "--drift-threshold", "drift_threshold", multiple=True, metavar="MEASURE=VALUE",
        help=f"How far a figure may move, repeatable [defaults: {_THRESHOLD_HELP}; see "
             "the README].")(command)


def parse_thresholds(values: tuple[str, ...]) -> dict[str, float]:
    """The --drift-threshold items (checked by `qcal.drift.drift_thresholds`)."""
    return _key_values(values, "--drift-threshold", "MEASURE=VALUE")


def show_drift(drift: Drift, title: str, *, every_row: bool = False) -> None:
    for note in drift.notes:
        stdout.print(f"  differs: {note}", soft_wrap=True)
    if drift.moves:
        stdout.print(_drift_table(drift, title, None if every_row else 25))
    style = "bold red" if drift.over else "green"
    stdout.print(f"[{style}]drift:[/] {drift.describe()}", soft_wrap=True)


def raise_for_drift(drift: Drift, fail_on_drift: bool) -> None:
    if fail_on_drift and drift.over:
        raise DriftGateError(drift.describe())


@main.command()
@click.argument("old", metavar="OLD.json", type=_existing)
@click.argument("new", metavar="NEW.json", type=_existing)
@drift_options
@click.option("--all", "every_row", is_flag=True, help="List every figure that moved.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def diff(old: Path, new: Path, drift_threshold: tuple[str, ...], fail_on_drift: bool,
         every_row: bool, as_json: bool, debug: bool) -> None:
    """Compare two reports of the same model: scales and zero points per tensor, the tensors
    quantized, coverage and per output quality; what moved, and whether it moved too far."""
    from qcal.drift import compare_reports
    from qcal.report import load_report, reading_report

    thresholds = parse_thresholds(drift_threshold)
    before, after = load_report(old), load_report(new)
    with reading_report(old, new):
        drift = compare_reports(before, after, thresholds)
    if as_json:
        stdout.print_json(json.dumps({"old": str(old), "new": str(new), **drift.to_json()}))
    else:
        show_drift(drift, f"{old} -> {new}", every_row=every_row)
    raise_for_drift(drift, fail_on_drift)
