"""`qcal presets`."""

from __future__ import annotations

import json
from typing import Any

import click

from qcal._cli_output import stdout
from qcal.cli._app import main, reports_errors


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the presets as JSON.")
@reports_errors
def presets(as_json: bool) -> None:
    """List every preset with its parameters and their defaults."""
    from qcal.numerics.presets import PRESETS

    listing: dict[str, dict[str, Any]] = {
        name: {"description": spec.description, "options": dict(spec.knobs)}
        for name, spec in sorted(PRESETS.items())
    }
    if as_json:
        stdout.print_json(json.dumps(listing, default=str))
        return
    for name, entry in listing.items():
        stdout.print(f"[bold]{name}[/]: {entry['description']}")
        options = ", ".join(f"{k}={v}" for k, v in entry["options"].items())
        stdout.print(f"    options: {options}")
