"""`qcal inspect`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from qcal._cli_output import stdout
from qcal.cli._app import _existing, main, reports_errors
from qcal.cli._options import _list_option
from qcal.config import config_from_mapping


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
