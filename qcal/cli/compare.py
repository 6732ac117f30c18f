"""`qcal compare`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from qcal._cli_output import _metrics_table, stdout
from qcal._verdict import padding_words
from qcal.cli._app import _existing, _path, main, reports_errors
from qcal.numerics.errors import ConfigError


@main.command()
@click.argument("float_model", type=_existing)
@click.argument("quant_model", type=_existing)
@click.option("--data", type=_path, help="Data to run both models on [default: found beside FLOAT_MODEL].")
@click.option("--labels", type=_path, help=".npy integer labels, one per sample (adds accuracy).")
@click.option("--limit", type=int, metavar="N", help="Use at most N samples.")
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--provider", multiple=True, help="onnxruntime execution provider(s) [default: CPU].")
@click.option("--json", "json_path", type=_path, help="Also write the comparison as JSON here.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def compare(float_model: Path, quant_model: Path, data: Path | None, labels: Path | None,
            limit: int | None, batch_size: int, provider: tuple[str, ...], json_path: Path | None,
            debug: bool) -> None:
    """Compare FLOAT_MODEL and QUANT_MODEL outputs: SQNR, cosine, max error, top-1 agreement."""
    from qcal.accuracy.evaluate import compare_models
    from qcal.calibration import data as data_mod
    from qcal.graph.files.atomic import check_output_path, write_atomic
    from qcal.graph.files.load import load_model
    from qcal.graph.model import model_inputs
    from qcal.pipeline import load_labels

    if batch_size < 1:
        raise ConfigError(f"--batch-size: {batch_size} must be at least 1")
    if json_path is not None:  # before any work: never over an input, never into nowhere
        read = [p for p in (float_model, quant_model, data, labels) if p is not None]
        check_output_path(json_path, inputs=read, force=True, what="--json")
    float_loaded, quant_loaded = load_model(float_model), load_model(quant_model)
    inputs = model_inputs(float_loaded.model)
    source = data_mod.open_data(data, model_path=float_model, inputs=inputs, limit=limit)
    data_mod.validate_data(source, inputs)
    comparison = compare_models(
        float_loaded.model, quant_loaded.model, data_mod.iter_batches(source, inputs, batch_size),
        labels=load_labels(labels) if labels else None,
        providers=tuple(provider) or ("CPUExecutionProvider",),
    )
    result = comparison.to_json()
    if json_path is not None:
        write_atomic(json_path, (json.dumps(result, indent=2) + "\n").encode())
    stdout.print(_metrics_table(
        f"{float_model.name} vs {quant_model.name} on {comparison.samples} samples"
        + padding_words(None if comparison.padding is None else comparison.padding.to_json()),
        [o.to_json() for o in comparison.outputs]))
