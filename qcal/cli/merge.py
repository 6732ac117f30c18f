"""`qcal merge`: statistics files of disjoint parts of the data as one file."""

from __future__ import annotations

from pathlib import Path

import click

from qcal._cli_output import stdout
from qcal.cli._app import _existing, _path, main, reports_errors


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=_existing, metavar="STATS...")
@click.option("-o", "--output", type=_path, required=True, help="Merged statistics file to write.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="No summary line.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def merge(inputs: tuple[Path, ...], output: Path, force: bool, quiet: bool, debug: bool) -> None:
    """Merge statistics collected on disjoint parts of the data into one file.

    The result is byte for byte the file one collection over all the data writes. Statistics
    that depend on the order of the batches (moving averages) cannot be merged and are refused.
    """
    from qcal.calibration.statistics import merge_statistics, read_statistics
    from qcal.graph.files.atomic import check_output_path, write_atomic

    check_output_path(output, inputs=inputs, force=force, what="output")
    merged = merge_statistics([(str(path), read_statistics(path)) for path in inputs])
    write_atomic(output, merged.to_bytes())
    if not quiet:
        files = f"{len(inputs)} file{'s' if len(inputs) != 1 else ''}"
        stdout.print(f"wrote {output}: {files}, {merged.samples} samples, "
                     f"data fingerprint {merged.fingerprint.hex()[:16]}", soft_wrap=True)
