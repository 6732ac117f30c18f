"""`qcal calibrate`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from qcal._cli_output import _progress_bar, _show_summary, stdout
from qcal.cli._app import _existing, _path, main, reports_errors
from qcal.cli._options import _build_config, ray_options
from qcal.cli._run_extras import RunExtras
from qcal.cli.diff import drift_options, raise_for_drift, show_drift
from qcal.config import METHODS, WEIGHT_ROUNDINGS, CalibrationConfig
from qcal.graph.placement import SMALL_PRODUCT_MACS
from qcal.graph.weight_only import FORMATS, WEIGHT_ONLY
from qcal.numerics.errors import ConfigError, OutputError


@main.command()
@click.argument("model", type=_existing)
@click.option("-o", "--output", type=_path, help="QDQ model to write [default: ./<stem>.qdq.onnx]")
@click.option("--report", type=_path,
              help="JSON report to write [default: beside -o's model, else ./<stem>.qcal.json]")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--data", type=_path, help=".npz file (.npy for a one-input model), folder of such samples, or test_data_set folder(s).")
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
@click.option("--method", type=click.Choice(METHODS), default="auto", show_default=True,
              help="How activation ranges are chosen (auto: mse, but the exact extremes of "
                   "tensors the outputs read directly).")
@click.option("--percentile", type=float, default=99.99, show_default=True, help="For --method percentile.")
@click.option("--bins", type=int, default=2048, show_default=True, help="Histogram bins (entropy, percentile, mse).")
@click.option("--quantized-bins", type=int, default=128, show_default=True, help="Quantized bins for entropy.")
@click.option("--per-channel/--per-tensor", default=True, show_default=True, help="Weight granularity.")
@click.option("--weight-rounding", type=click.Choice(WEIGHT_ROUNDINGS), default="nearest",
              show_default=True,
              help="How weight codes are chosen: nearest, gptq (minimises each layer's output "
                   "error on the calibration data; one more pass over it), or auto (gptq for "
                   "MatMul/Gemm weights, nearest for Conv: no extra pass on a model without "
                   "MatMul/Gemm).")
@click.option("--bias-correction/--no-bias-correction", default=True, show_default=True,
              help="Correct Conv/Gemm biases (and the bias an Add gives a MatMul) for the mean "
                   "output shift quantization causes on the calibration data (one more pass "
                   "over it).")
@click.option("--weight-only", type=click.Choice(WEIGHT_ONLY),
              help="Quantize only MatMul/Gemm weights, to 4 bits in blocks along their inputs; "
                   "activations stay float [default: off].")
@click.option("--block-size", type=int, default=32, show_default=True,
              help="--weight-only: inputs per block sharing a scale (a power of 2, >= 16).")
@click.option("--weight-only-format", type=click.Choice(FORMATS), default="matmulnbits",
              show_default=True,
              help="--weight-only: onnxruntime's MatMulNBits, or int4 DequantizeLinear (qdq, "
                   "opset 21).")
@click.option("--equalize/--no-equalize", default=False, show_default=True,
              help="Even out channel ranges, the float outputs staying the same: with "
                   "per-channel weights, those of depthwise Conv inputs (one more pass over the "
                   "data); with per-tensor weights, those of Conv pairs' weights.")
@click.option("--smooth-quant", metavar="ALPHA|auto",
              help="SmoothQuant: move activation outliers of MatMul/Gemm inputs into their "
                   "weights with strength ALPHA in [0, 1], or the best of 0.3..0.9 per layer "
                   "(auto; one more pass over the data).")
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
@click.option("--min-product-macs", type=int, default=SMALL_PRODUCT_MACS, show_default=True,
              metavar="N", help="Placement auto: a MatMul/Gemm of fewer multiply-adds per run "
                                "(at the calibration data's shapes) stays float, where its "
                                "integer kernel does not pay; 0 quantizes every one.")
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
                   "at 1 or 2 threads on this machine (e.g. 1.1; inf: never).")
@click.option("--allow-slower", is_flag=True,
              help="Accept a quantized model slower than the float one on this machine (by "
                   "default that exits 7: the not-slower gate).")
@click.option("--html", type=_path, help="Also write the report as an HTML page with plots "
              "(needs qcal[report]).")
@click.option("--baseline", type=_existing, metavar="OLD.json",
              help="Compare with the report of an earlier run and show what moved.")
@drift_options
@click.option("--summary-md", type=_path, metavar="PATH",
              help="Also write a Markdown summary for a CI job page (appended to "
                   "$GITHUB_STEP_SUMMARY too when it is set).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one line of JSON summing up the run on stdout, and nothing else.")
@click.option("--stats", "--ranges", "stats", type=_existing, metavar="FILE",
              help="Take the statistics from this file (qcal collect) instead of running the "
                   "model for them, or the ranges from a TensorRT calibration cache or an "
                   "onnxruntime TensorQuantOverrides / calibration cache JSON.")
@click.option("--write-ranges", multiple=True, metavar="FORMAT=PATH",
              help="Also write the activation ranges for another tool: tensorrt[:VERSION], "
                   "onnxruntime-overrides, onnxruntime-cache, or onnxruntime-table (a folder) "
                   "(repeatable).")
@click.option("--checkpoint", type=_path, metavar="STATS",
              help="Collect into this statistics file, resuming from it if it exists, then "
                   "calibrate from it.")
@ray_options
@click.option("--config", type=_path, help="TOML file with the same keys as these flags (flags win).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@reports_errors
def calibrate(**params: Any) -> None:
    """Calibrate MODEL on real data and write a QDQ model and a JSON report."""
    from qcal.accuracy.gates import raise_for_failed
    from qcal.pipeline import calibrate as run_calibration
    from qcal.pipeline import default_output_paths, report_beside

    ctx = click.get_current_context()
    extras = RunExtras.take(params)
    statistics, checkpoint = params.pop("stats"), params.pop("checkpoint")
    exports = _range_exports(params.pop("write_ranges"))
    ray_address, workers = params.pop("ray_address"), params.pop("workers")
    if ray_address is not None and (statistics is not None or checkpoint is not None):
        raise ConfigError("--ray collects the statistics: it goes with neither --stats nor "
                          "--checkpoint")
    if statistics is not None and checkpoint is not None:
        raise ConfigError("--stats and --checkpoint: choose one (a checkpoint is a statistics "
                          "file collected by this run)")
    config, outputs = _build_config(ctx, params)
    if config.weight_only is not None and (statistics or checkpoint or ray_address or exports):
        raise ConfigError("weight-only: activations stay float; it goes with none of --stats, "
                          "--checkpoint, --ray, --write-ranges")
    if (config.equalize or config.smooth_quant is not None) and (
            statistics is not None or checkpoint is not None or ray_address is not None):
        raise ConfigError("--equalize, --smooth-quant: they change the model, so they go with "
                          "no statistics collected beforehand (--stats, --checkpoint, --ray)")
    model: Path = params["model"]
    output = Path(outputs["output"]) if outputs.get("output") else default_output_paths(model)[0]
    report = Path(outputs["report"]) if outputs.get("report") else report_beside(output)
    if params.get("config") is not None:  # the config file is an input too, --force or not
        from qcal.graph.files.atomic import check_output_path

        for path, what in ((output, "output"), (report, "report")):
            check_output_path(path, inputs=[params["config"]], force=True, what=what)
    read = [model, *(Path(p) for p in (config.data, config.eval_data, config.labels) if p)]
    read += [statistics] if statistics is not None else []
    extras.check(inputs=read + ([params["config"]] if params.get("config") else []),
                 outputs=(output, report), force=bool(outputs.get("force")))
    _check_range_exports(exports, checkpoint, model=model, outputs=(output, report),
                         force=bool(outputs.get("force")))
    quiet = params["quiet"] or extras.as_json  # --json: stdout holds the JSON line alone
    with _progress_bar(not quiet and sys.stderr.isatty()) as progress:
        if checkpoint is not None:  # collect (or resume) first, then calibrate from the file
            from qcal._collection import collect_statistics

            collect_statistics(model, config, checkpoint=checkpoint, histograms=False,
                               progress=progress)
            statistics = checkpoint
        elif ray_address is not None:
            from qcal._ray_shards import collect_on_ray

            statistics = collect_on_ray(model, config, output=None, histograms=False,
                                        address=ray_address, workers=workers, progress=progress)
        result = run_calibration(model, config, output=output, report_path=report,
                                 force=bool(outputs.get("force")), progress=progress,
                                 enforce_gates=False, statistics=statistics)
    if exports:
        from qcal.calibration.statistics import ranges_of_tensors, write_ranges

        ranges = ranges_of_tensors(result.report["tensors"])
        for kind, path in exports.items():
            write_ranges(kind, path, ranges)
    drift = extras.drift(result.report)
    written = extras.write(result.report, drift)
    if extras.as_json:
        print(extras.json_line(result.report, drift, result.report_path), flush=True)
    elif not quiet:
        _show_summary(result)
        for path in written:
            stdout.print(f"wrote {path}")
        if drift is not None:
            show_drift(drift, f"moved since {extras.baseline}")
    # after the summary: it shows the evidence
    raise_for_failed(result.gates, result.report_path)
    if drift is not None:
        raise_for_drift(drift, extras.fail_on_drift)


def _check_range_exports(
    exports: dict[str, Path], checkpoint: Path | None, *, model: Path,
    outputs: tuple[Path, Path], force: bool,
) -> None:
    """`--write-ranges` and `--checkpoint` paths, checked before anything runs."""
    from qcal.graph.files.atomic import check_output_path

    files = [p for kind, p in exports.items() if kind != "onnxruntime-table"]  # a folder's below
    for path in [*files, *([checkpoint] if checkpoint is not None else [])]:
        check_output_path(path, inputs=[model, *outputs], force=True, what="ranges")
    for kind, path in exports.items():
        if kind == "onnxruntime-table":  # a folder: its three files are checked
            if path.exists() and not path.is_dir():
                raise OutputError(f"ranges: {path} is not a folder (onnxruntime-table writes "
                                  "calibration.json, .flatbuffers and .cache into one)")
            for name in ("calibration.json", "calibration.flatbuffers", "calibration.cache"):
                if path.is_dir():
                    check_output_path(path / name, inputs=[model], force=force, what="ranges")
            continue
        check_output_path(path, inputs=[model], force=force, what="ranges")


def _range_exports(values: tuple[str, ...]) -> dict[str, Path]:
    """`--write-ranges FORMAT=PATH` values, checked before anything runs."""
    from qcal.calibration.statistics import RANGE_FORMATS

    exports: dict[str, Path] = {}
    for value in values:
        kind, sep, path = value.partition("=")
        if not sep or not path or kind.partition(":")[0] not in RANGE_FORMATS:
            raise ConfigError(f"--write-ranges: expected FORMAT=PATH with FORMAT one of "
                              f"{', '.join(RANGE_FORMATS)}, got {value!r}")
        exports[kind] = Path(path)
    return exports
