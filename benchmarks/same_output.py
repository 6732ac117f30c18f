"""Do two revisions of qcal write the same bytes? Models and reports (timings aside), side by side.

A refactoring must not change what qcal writes. This script checks out a base revision into a
temporary git worktree, runs the same ``qcal calibrate`` commands with each revision's package
(the base worktree, then this checkout), and compares the QDQ models byte for byte and the
reports as JSON with ``timings_seconds`` removed and absolute paths (the inputs', which
depend on the checkout) cut to file names.

    python benchmarks/same_output.py --base HEAD~3            # sample models, several methods/presets
    python benchmarks/same_output.py --base HEAD~3 --ppocr    # and the three PP-OCR models
    python benchmarks/same_output.py --base A --head B        # two commits, this checkout unused

Exit 0 when every pair is identical; 1 with the differing cases listed otherwise. The base
revision's outputs are cached in ``benchmarks/.cache/same_output/<commit>/`` (a commit's outputs
never change), so checking several later trees against one base runs the base once; so are a
``--head`` commit's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
CACHE = ROOT / "benchmarks" / ".cache" / "same_output"

# (case name, model, data, extra flags). Several range methods and presets on each sample model;
# the sensitivity/fallback path on one of them.
SAMPLE_CASES: list[tuple[str, str, str, list[str]]] = [
    *(
        (f"digits-{method}-{preset}", "digits_cnn", "digits_cnn.calib.npz",
         ["--method", method, "--preset", preset, "--limit", "64"])
        for method in ("minmax", "moving-average", "entropy", "percentile", "mse")
        for preset in ("pytorch", "tensorflow", "horizon", "mindspore", "oneflow-google")
        if not (method == "moving-average" and preset in ("horizon",))
    ),
    *(
        (f"transformer-{method}", "transformer_block", "transformer_block.calib.npz",
         ["--method", method, "--limit", "32"])
        for method in ("minmax", "entropy", "percentile", "mse")
    ),
    ("transformer-per-tensor", "transformer_block", "transformer_block.calib.npz",
     ["--per-tensor", "--preset", "pytorch-symmetric", "--limit", "32"]),
    ("digits-fallback", "digits_cnn", "digits_cnn.calib.npz",
     ["--limit", "64", "--target-sqnr", "45", "--sensitivity"]),
]


def ppocr_cases() -> list[tuple[str, str, str, list[str]]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import get_models

    cases = []
    for model in get_models(("ppocr_det", "ppocr_rec", "ppocr_cls")):
        calib = model.calib_data(8)
        for method in ("minmax", "entropy", "percentile"):
            cases.append((f"{model.name}-{method}", str(model.path), str(calib),
                          ["--method", method]))
        cases.append((f"{model.name}-tensorflow", str(model.path), str(calib),
                      ["--preset", "tensorflow"]))
    return cases


def run_cases(source: Path, cases: list[tuple[str, str, str, list[str]]], out: Path) -> None:
    """Run every case with the qcal package found under `source`, writing into `out` (relative
    output names, so that reports from two folders can be compared)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONHASHSEED": "0"}
    for name, model, data, flags in cases:
        if (out / f"{name}.rc").exists():
            continue
        model_path = SAMPLES / f"{model}.onnx" if "/" not in model else Path(model)
        data_path = SAMPLES / data if "/" not in data else Path(data)
        cmd = [sys.executable, "-m", "qcal.cli", "calibrate", str(model_path), "--data",
               str(data_path), "-o", f"{name}.onnx", "--report", f"{name}.json", "--force",
               "-q", *flags]
        done = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, check=False)
        (out / f"{name}.log").write_text(done.stdout + done.stderr)
        (out / f"{name}.rc").write_text(str(done.returncode))
        print(f"  {name}: exit {done.returncode}", flush=True)


def run_commit(revision: str, cases: list[tuple[str, str, str, list[str]]]) -> Path:
    """Run `cases` with the package of `revision` (a temporary worktree); outputs are cached."""
    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    out = CACHE / commit
    print(f"{revision} = {commit[:10]}: {out}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT,
                       capture_output=True, check=True)
        try:
            run_cases(tree, cases, out)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True, check=False)
    return out


def comparable_report(path: Path) -> Any:
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    report.pop("timings_seconds", None)
    return _file_names(report)


def _file_names(value: Any) -> Any:
    """`value` with absolute paths cut to their file names: the inputs' folders depend on the
    checkout and environment that ran the case (a cached base may come from another)."""
    if isinstance(value, dict):
        return {k: _file_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_file_names(v) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        return Path(value).name
    return value


def compare(base: Path, head: Path, cases: list[tuple[str, str, str, list[str]]]) -> list[str]:
    differing = []
    for name, *_ in cases:
        problems = []
        if (base / f"{name}.rc").read_text() != (head / f"{name}.rc").read_text():
            problems.append("exit code")
        for suffix in (".onnx",):
            a, b = base / f"{name}{suffix}", head / f"{name}{suffix}"
            if a.exists() != b.exists() or (a.exists() and a.read_bytes() != b.read_bytes()):
                problems.append("model")
        if comparable_report(base / f"{name}.json") != comparable_report(head / f"{name}.json"):
            problems.append("report")
        if problems:
            differing.append(f"{name}: {', '.join(problems)} differ")
    return differing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--head", help="git revision to check (default: this checkout)")
    parser.add_argument("--ppocr", action="store_true", help="also the three PP-OCR models")
    args = parser.parse_args()
    cases = SAMPLE_CASES + (ppocr_cases() if args.ppocr else [])

    base_out = run_commit(args.base, cases)
    if args.head:
        head_out = run_commit(args.head, cases)
    else:
        head_out = CACHE / "head"
        shutil.rmtree(head_out, ignore_errors=True)
        print(f"this checkout: {head_out}")
        run_cases(ROOT, cases, head_out)

    differing = compare(base_out, head_out, cases)
    for line in differing:
        print("DIFFERS", line)
    print(f"{len(cases) - len(differing)} of {len(cases)} cases identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
