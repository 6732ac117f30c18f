"""`qcal report`."""

from __future__ import annotations

from pathlib import Path

import click

from qcal._cli_output import stdout
from qcal.cli._app import _existing, _path, main, reports_errors


@main.command("report")
@click.argument("report_json", metavar="REPORT.json", type=_existing)
@click.option("-o", "--output", type=_path,
              help="HTML file to write [default: ./<REPORT name with .html for .json>].")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def report_command(report_json: Path, output: Path | None, force: bool, debug: bool) -> None:
    """Write the JSON report of a run as one self-contained HTML page with plots (needs the
    extra qcal[report])."""
    from qcal.graph.files.atomic import check_output_path, write_atomic
    from qcal.html_report import render_html, require_plotting
    from qcal.report import load_report, reading_report

    require_plotting("qcal report")
    target = output if output is not None else Path.cwd() / f"{report_json.stem}.html"
    check_output_path(target, inputs=[report_json], force=force, what="--output")
    report = load_report(report_json)
    with reading_report(report_json):
        page = render_html(report)
    write_atomic(target, page)
    stdout.print(f"wrote {target}")
