"""Scaling of `qcal collect --ray` from 1 to 2 workers, on a model where inference dominates.

The PP-OCRv4 detector of rapidocr_onnxruntime 1.4.4 with its input fixed to 3 x SIDE x SIDE
(so that `--synthetic` data has the size of real pages: synthetic samples are made where they
are read, no data file is shared), min/max statistics (`--no-histograms`: the extremes are
computed in the graph, so onnxruntime's inference is nearly all the work). Whole processes,
interleaved, median of the repeats:

- `single`: `qcal collect --threads 1`, one process, one onnxruntime thread;
- `ray-1`, `ray-2`: `qcal collect --ray --workers 1|2` (a local Ray started for the run, one
  onnxruntime thread per worker);
- `ray-start`: `--ray --workers 2` on 2 samples: what starting and stopping Ray costs, subtracted
  for the "collection alone" column.

Every run's statistics file must be byte-identical to the others'. The load average of the
machine before and after is printed and saved: on a shared machine the scaling is only as good
as the cores that are free.

    python benchmarks/bench_ray.py [--samples 600] [--side 384] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    compile_qcal_bytecode,
    machine_info,
    print_table,
    run_child,
    work_dir,
    write_results,
)
from models import ensure_packages, ppocr_model_path


def fixed_model(side: int, folder: Path) -> Path:
    model = onnx.load(ppocr_model_path("ppocr_det"))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].Clear()
    dims[2].dim_value = side
    dims[3].Clear()
    dims[3].dim_value = side
    path = folder / f"ppocr_det_{side}.onnx"
    onnx.save(model, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--side", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="200 samples, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 200, 1
    compile_qcal_bytecode()
    ensure_packages()
    folder = work_dir("bench_ray")
    model = fixed_model(args.side, folder)
    qcal = [sys.executable, "-m", "qcal.cli", "collect", str(model), "--no-histograms", "-q",
            "--force"]
    configs = {
        "single": ["--threads", "1", "--synthetic", str(args.samples)],
        "ray-1": ["--ray", "--workers", "1", "--synthetic", str(args.samples)],
        "ray-2": ["--ray", "--workers", "2", "--synthetic", str(args.samples)],
        "ray-start": ["--ray", "--workers", "2", "--synthetic", "2"],
    }
    load_before = os.getloadavg()
    walls: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, bytes] = {}
    for repeat in range(args.repeats):
        for name, extra in configs.items():
            out = folder / f"{name}.stats"
            result = run_child([*qcal, *extra, "-o", str(out)], log_stem=folder / f"{name}-{repeat}",
                               timeout_s=3600, max_rss_mib=8192)
            if not result.ok:
                raise SystemExit(f"{name}: {result.error}")
            walls[name].append(result.wall_seconds)
            data = out.read_bytes()
            if name != "ray-start" and outputs.setdefault("collection", data) != data:
                raise SystemExit(f"{name}: the statistics differ from the other runs'")
    load_after = os.getloadavg()
    median = {name: statistics.median(values) for name, values in walls.items()}
    start = median["ray-start"]
    rows = []
    for name in ("single", "ray-1", "ray-2"):
        alone = median[name] - (start if name.startswith("ray") else 0.0)
        rows.append([name, round(median[name], 1), round(alone, 1),
                     round(median["ray-1"] / median[name], 2),
                     round((median["ray-1"] - start) / max(alone, 1e-9), 2)])
    rows.append(["ray-start", round(start, 1), "", "", ""])
    print_table(
        f"qcal collect, PP-OCRv4 det at {args.side}x{args.side}, {args.samples} samples, "
        f"median of {args.repeats}; load average before {load_before[0]:.1f}, after "
        f"{load_after[0]:.1f} ({os.cpu_count()} CPUs); statistics byte-identical in every run",
        ["run", "wall s", "collection alone s", "speed-up vs ray-1", "alone vs ray-1"], rows)
    write_results("bench_ray", {
        "machine": machine_info(), "samples": args.samples, "side": args.side,
        "repeats": args.repeats, "walls": walls, "load_before": load_before,
        "load_after": load_after, "identical": True,
    })


if __name__ == "__main__":
    main()
