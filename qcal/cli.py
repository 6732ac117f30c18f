"""The `qcal` command: a thin shell over the library that owns messages, progress and exit codes.

The consoles, the progress bar and the run's summary tables are in `qcal._cli_output`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from rich.table import Table

import qcal
from qcal._cli_output import _metrics_table, _progress_bar, _show_summary, stderr, stdout
from qcal.config import METHODS, CalibrationConfig, config_from_mapping, load_config_file
from qcal.numerics.errors import EXIT_INTERNAL, CalibrationInterrupted, ConfigError, QcalError

F = TypeVar("F", bound=Callable[..., Any])

# Flags that shape the run but are not part of CalibrationConfig; the config file may set them too.
_OUTPUT_KEYS = ("output", "report", "force")


def reports_errors(command: F) -> F:
    """Turn library errors into one-line messages and documented exit codes."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug"))
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as stop:
            signum = getattr(stop, "signum", signal.SIGINT)
            err = CalibrationInterrupted(
                f"interrupted by {signal.Signals(signum).name}; no output was written")
            stderr.print(f"[bold red]error:[/] {err}")
            # The way out has removed every temporary file. Leave without the interpreter's
            # exit, which joins worker threads: an interrupt raised while the main thread held
            # a lock a worker waits on would make that join wait forever.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + int(signum))
        except QcalError as err:
            if debug:
                raise
            stderr.print(f"[bold red]error ({err.title}):[/] {err}", soft_wrap=True)
            raise SystemExit(err.exit_code) from None
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as err:  # a bug: say so plainly, keep the traceback for --debug
            if debug:
                raise
            stderr.print(
                f"[bold red]internal error:[/] {type(err).__name__}: {err} "
                "(rerun with --debug for the traceback)", soft_wrap=True,
            )
            raise SystemExit(EXIT_INTERNAL) from None

    return run  # type: ignore[return-value]


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (how CI systems and closing terminals stop a job), raised where the
    program is, like Ctrl-C: temporary files are removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _sigint_as_keyboard_interrupt() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_stopped)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(qcal.__version__, prog_name="qcal")
def main() -> None:
    """Calibrate float ONNX models into QDQ models with framework-exact quantization semantics."""
    _sigint_as_keyboard_interrupt()


def _parse_option_value(text: str) -> Any:
    """A TOML value (true, 3, 0.5, "x", [1, 2]); anything else is taken as a bare string."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _preset_options(values: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--preset-option: expected KEY=VALUE, got {item!r}")
        options[key.strip()] = _parse_option_value(value.strip())
    return options


def _list_option(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _explicit(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _build_config(ctx: click.Context, params: Mapping[str, Any]) -> tuple[CalibrationConfig, dict[str, Any]]:
    """File values first, then every flag the user typed; returns the config and output options."""
    file_values: dict[str, Any] = {}
    if params.get("config") is not None:
        file_values = load_config_file(params["config"])
    outputs = _file_outputs(params.get("config"), file_values)
    config = config_from_mapping(file_values, where=f"{params['config']}: ") if file_values else CalibrationConfig()
    flags: dict[str, Any] = {}
    for name, value in params.items():
        if name in {"model", "config", "quiet", "debug", *_OUTPUT_KEYS} or not _explicit(ctx, name):
            continue
        if name == "preset_option":
            flags["preset_options"] = {**config.preset_options, **_preset_options(value)}
        elif name == "provider":
            flags["providers"] = list(value)
        elif name in {"op_types", "exclude_op_types", "exclude_nodes", "exclude_tensors"}:
            flags[name] = _list_option(value)
        elif isinstance(value, Path):
            flags[name] = str(value)
        else:
            flags[name] = value
    for key in _OUTPUT_KEYS:
        if _explicit(ctx, key) or key not in outputs:
            outputs[key] = params[key]
    return config_from_mapping(flags, base=config, where="--"), outputs


def _file_outputs(config_path: Path | None, file_values: dict[str, Any]) -> dict[str, Any]:
    """Take output, report and force out of the config file's values, checked like the rest."""
    outputs: dict[str, Any] = {}
    for key in _OUTPUT_KEYS:
        if key not in file_values:
            continue
        value = file_values.pop(key)
        if key == "force":
            if not isinstance(value, bool):
                raise ConfigError(f"{config_path}: force: expected true or false, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ConfigError(f"{config_path}: {key}: expected a path string, got {value!r}")
        elif config_path is not None:
            value = str(config_path.parent / value)  # relative to the file, as the README says
        outputs[key] = value
    return outputs


_path = click.Path(path_type=Path)
_existing = click.Path(exists=False, path_type=Path)


@main.command()
@click.argument("model", type=_existing)
@click.option("-o", "--output", type=_path, help="QDQ model to write [default: ./<stem>.qdq.onnx]")
@click.option("--report", type=_path, help="JSON report to write [default: ./<stem>.qcal.json]")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--data", type=_path, help=".npz file, folder of .npz samples, or test_data_set folder(s).")
@click.option("--eval-data", type=_path, help="Data to compare float and quantized outputs on.")
@click.option("--labels", type=_path, help=".npy integer labels for --eval-data (adds accuracy).")
@click.option("--synthetic", type=int, metavar="N", help="Calibrate on N random samples (not real data!).")
@click.option("--limit", type=int, metavar="N", help="Use at most N calibration samples.")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Samples per onnxruntime run.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --synthetic data.")
@click.option("--preset", default=CalibrationConfig().preset, show_default=True,
              help="Quantization semantics to follow (see `qcal presets`).")
@click.option("--preset-option", multiple=True, metavar="KEY=VALUE",
              help="A preset parameter under its framework's name, e.g. reduce_range=true.")
@click.option("--method", type=click.Choice(METHODS), default="minmax", show_default=True,
              help="How activation ranges are chosen.")
@click.option("--percentile", type=float, default=99.99, show_default=True, help="For --method percentile.")
@click.option("--bins", type=int, default=2048, show_default=True, help="Histogram bins (entropy, percentile, mse).")
@click.option("--quantized-bins", type=int, default=128, show_default=True, help="Quantized bins for entropy.")
@click.option("--per-channel/--per-tensor", default=True, show_default=True, help="Weight granularity.")
@click.option("--op-types", multiple=True, help="Quantize only these op types (comma-separated).")
@click.option("--exclude-op-types", multiple=True, help="Keep these op types in float.")
@click.option("--exclude-nodes", multiple=True, help="Keep nodes whose names match these globs in float.")
@click.option("--exclude-tensors", multiple=True, help="Never quantize these tensors.")
@click.option("--opset", type=int, default=13, show_default=True,
              help="Upgrade the model to at least this opset (21 enables int4/int16 QDQ types).")
@click.option("--provider", multiple=True, help="onnxruntime execution provider(s) [default: CPU].")
@click.option("--threads", type=int, default=0, show_default=True, help="onnxruntime intra-op threads (0: its default).")
@click.option("--default-exclusions/--no-default-exclusions", default=True, show_default=True,
              help="Keep known accuracy traps in float (normalization statistics, ...; see README).")
@click.option("--placement", type=click.Choice(["auto", "all"]),
              help="Where Q/DQ goes: auto, where onnxruntime's integer kernels pay; all, every "
                   "node with a rule [default: auto; all for the horizon presets].")
@click.option("--fallback/--no-fallback", default=True, show_default=True,
              help="Check the accuracy floor on held-back data and keep the most harmful "
                   "tensors float below it (see README).")
@click.option("--sensitivity", is_flag=True, help="Measure every quantized tensor's effect alone.")
@click.option("--sensitivity-samples", type=int, metavar="N",
              help="Evaluation samples the sensitivity runs on [default: 16; every tensor is "
                   "screened on up to 4 first, harmless ones stop there].")
@click.option("--target-sqnr", type=float, metavar="DB",
              help="Keep harmful tensors in float until every output's SQNR is at least DB.")
@click.option("--max-agreement-drop", type=float, metavar="PCT",
              help="Keep harmful tensors in float until top-1 agreement is at least 100-PCT %.")
@click.option("--min-coverage", type=float, default=70.0, show_default=True, metavar="PCT",
              help="The fallback never keeps more than 100-PCT % of Conv/MatMul/Gemm MACs in float.")
@click.option("--fail-under-sqnr", type=float, metavar="DB", help="Exit 7 if an output's SQNR is below DB.")
@click.option("--fail-under-agreement", type=float, metavar="PCT",
              help="Exit 7 if top-1 agreement is below PCT %.")
@click.option("--fail-if-coverage-below", type=float, metavar="PCT",
              help="Exit 7 if less than PCT % of Conv/MatMul/Gemm MACs are quantized.")
@click.option("--fail-if-slower", type=float, metavar="RATIO",
              help="Exit 7 if the quantized model's latency is over RATIO x the float model's "
                   "at 1 or 2 threads on this machine (e.g. 1.0).")
@click.option("--config", type=_path, help="TOML file with the same keys as these flags (flags win).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def calibrate(**params: Any) -> None:
    """Calibrate MODEL on real data and write a QDQ model and a JSON report."""
    from qcal.accuracy.gates import raise_for_failed
    from qcal.pipeline import calibrate as run_calibration
    from qcal.pipeline import default_output_paths

    ctx = click.get_current_context()
    config, outputs = _build_config(ctx, params)
    model: Path = params["model"]
    default_output, default_report = default_output_paths(model)
    output = Path(outputs["output"]) if outputs.get("output") else default_output
    report = Path(outputs["report"]) if outputs.get("report") else default_report
    if params.get("config") is not None:  # the config file is an input too, --force or not
        from qcal.graph.files.atomic import check_output_path

        for path, what in ((output, "output"), (report, "report")):
            check_output_path(path, inputs=[params["config"]], force=True, what=what)
    show_progress = not params["quiet"] and sys.stderr.isatty()
    with _progress_bar(show_progress) as progress:
        result = run_calibration(model, config, output=output, report_path=report,
                                 force=bool(outputs.get("force")), progress=progress,
                                 enforce_gates=False)
    if not params["quiet"]:
        _show_summary(result)
    raise_for_failed(result.gates, result.report_path)  # after the summary: it shows the evidence


@main.command()
@click.argument("model", type=_existing)
@click.option("--op-types", multiple=True, help="Quantize only these op types (comma-separated).")
@click.option("--exclude-op-types", multiple=True, help="Keep these op types in float.")
@click.option("--exclude-nodes", multiple=True, help="Keep nodes whose names match these globs in float.")
@click.option("--exclude-tensors", multiple=True, help="Never quantize these tensors.")
@click.option("--per-channel/--per-tensor", default=True, show_default=True, help="Weight granularity.")
@click.option("--default-exclusions/--no-default-exclusions", default=True, show_default=True,
              help="Keep known accuracy traps in float (see README).")
@click.option("--placement", type=click.Choice(["auto", "all"]),
              help="Where Q/DQ goes [default: auto; all for the horizon presets].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def inspect(model: Path, as_json: bool, debug: bool, **selection: Any) -> None:
    """Show MODEL's inputs, opset, op counts, and what would be quantized and why not."""
    from qcal.graph.model import model_inputs
    from qcal.pipeline import plan_model

    config = config_from_mapping({k: _list_option(v) if isinstance(v, tuple) else v
                                  for k, v in selection.items() if v is not None}, where="--")
    loaded, prepared, steps, plan = plan_model(model, config)
    opsets = {o.domain or "ai.onnx": o.version for o in loaded.model.opset_import}
    inputs = model_inputs(prepared)
    op_counts = Counter(n.op_type for n in loaded.model.graph.node)
    if as_json:
        stdout.print_json(json.dumps({
            "model": str(model), "opset": opsets,
            "inputs": [{"name": i.name, "dtype": str(i.dtype), "shape": list(i.shape)} for i in inputs],
            "op_counts": dict(sorted(op_counts.items())),
            "preparation": [{"step": s.name, "detail": s.detail} for s in steps],
            "nodes": [{"name": n.node, "op_type": n.op_type, "quantized": n.quantized,
                       "reason": n.reason} for n in plan.nodes],
            "activations": [a.tensor for a in plan.activations],
            "weights": [{"tensor": w.tensor, "axis": w.axis} for w in plan.weights],
        }))
        return
    stdout.print(f"[bold]{model}[/]  opset {', '.join(f'{d} {v}' for d, v in sorted(opsets.items()))}")
    for spec in inputs:
        dims = ", ".join("?" if d is None else str(d) for d in spec.shape)
        stdout.print(f"  input {spec.name}: {spec.dtype} [{dims}]")
    stdout.print("  ops: " + ", ".join(f"{op} {n}" for op, n in sorted(op_counts.items())))
    for step in steps:
        stdout.print(f"  prepare: {step.detail}")
    table = Table(title_justify="left", title=(
        f"{sum(n.quantized for n in plan.nodes)} of {len(plan.nodes)} nodes would be quantized; "
        f"{len(plan.activations)} activations, {len(plan.weights)} weights, {len(plan.biases)} biases"))
    for col in ("node", "op", "quantized", "why"):
        table.add_column(col)
    for n in plan.nodes:
        table.add_row(n.node, n.op_type, "yes" if n.quantized else "[yellow]no[/]", n.reason)
    stdout.print(table)


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
        f"{float_model.name} vs {quant_model.name} on {comparison.samples} samples",
        [o.to_json() for o in comparison.outputs]))


if __name__ == "__main__":  # pragma: no cover
    main()
