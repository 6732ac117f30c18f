"""`qcal collect`: the statistics of a calibration as a file, for `calibrate --stats` and `merge`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from qcal._cli_output import _progress_bar, stdout
from qcal.cli._app import _existing, _path, main, reports_errors
from qcal.cli._options import _build_config, ray_options
from qcal.cli.calibrate import calibrate as calibrate_command
from qcal.numerics.errors import ConfigError

# The options of `calibrate` that decide what is collected, shared as they are (same help).
_SHARED = (
    "data", "synthetic", "limit", "batch_size", "seed", "preset", "preset_option", "method",
    "op_types", "exclude_op_types", "exclude_nodes", "exclude_tensors", "opset", "provider",
    "threads", "default_exclusions", "placement", "config",
)


@main.command()
@click.argument("model", type=_existing)
@click.option("-o", "--output", type=_path, required=True, help="Statistics file to write.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--histograms/--no-histograms", default=True, show_default=True,
              help="Keep a histogram of every tensor beside its min/max, so that every range "
                   "method can be chosen later (--no-histograms: only what --method needs, "
                   "min/max for minmax and moving-average, the histogram for the others; the "
                   "file then serves that method only).")
@click.option("--checkpoint", type=_path,
              help="Write the statistics so far to this file as the collection goes, and "
                   "resume from it if it exists.")
@click.option("--checkpoint-every", type=int, default=1024, show_default=True, metavar="N",
              help="Samples between two checkpoints.")
@ray_options
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def collect(**params: Any) -> None:
    """Run MODEL on calibration data and write its statistics (observer states) to a file."""
    from qcal._collection import collect_statistics

    ctx = click.get_current_context()
    histograms = params.pop("histograms")
    checkpoint = params.pop("checkpoint")
    every = params.pop("checkpoint_every")
    ray_address, workers = params.pop("ray_address"), params.pop("workers")
    if ray_address is not None and checkpoint is not None:
        raise ConfigError("--ray and --checkpoint: choose one (a failed shard is run again)")
    config, outputs = _build_config(ctx, {**params, "report": None})
    output = Path(outputs["output"])
    show_progress = not params["quiet"] and sys.stderr.isatty()
    with _progress_bar(show_progress) as progress:
        if ray_address is not None:
            from qcal._ray_shards import collect_on_ray

            stats = collect_on_ray(params["model"], config, output=output,
                                   force=bool(outputs.get("force")), histograms=histograms,
                                   address=ray_address, workers=workers, progress=progress)
        else:
            stats = collect_statistics(params["model"], config, output=output,
                                       force=bool(outputs.get("force")), histograms=histograms,
                                       checkpoint=checkpoint, checkpoint_every=every,
                                       progress=progress)
    if not params["quiet"]:
        stdout.print(f"wrote {output}: {len(stats.observers)} tensors, {stats.samples} samples, "
                     f"data fingerprint {stats.fingerprint.hex()[:16]}", soft_wrap=True)


collect.params[2:2] = [p for p in calibrate_command.params if p.name in _SHARED]
