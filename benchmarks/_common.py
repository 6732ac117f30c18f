"""Shared pieces of the benchmark scripts: child processes, metrics, graph inspection, tables."""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from models import CACHE_DIR, RESULTS_DIR

WORKER = Path(__file__).resolve().parent / "_worker.py"

# SIGTERM ends a benchmark like Ctrl-C does, so that run_child can stop the running job too.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
QCAL_CLI = [sys.executable, "-m", "qcal.cli"]

# onnxruntime's quantize_static settings for every comparison (the x86 CPU layout qcal targets).
ORT_METHODS = ("MinMax", "MinMax-MovingAverage", "Entropy", "Percentile")
QCAL_METHODS = ("minmax", "moving-average", "percentile", "entropy", "mse")
# Which onnxruntime method a qcal method is compared with (same row group in the tables).
COMPARABLE = {
    "minmax": "MinMax",
    "moving-average": "MinMax-MovingAverage",
    "percentile": "Percentile",
    "entropy": "Entropy",
    "mse": None,
}

# Op types of onnxruntime's optimized CPU graph that compute in integers.
INTEGER_OPS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QGemm",
        "QLinearAdd",
        "QLinearMul",
        "QLinearGlobalAveragePool",
        "QLinearAveragePool",
        "QLinearConcat",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearSoftmax",
        "QLinearReduceMean",
        "QLinearWhere",
        "QLinearConvTranspose",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QAttention",
        "QEmbedLayerNormalization",
        "QOrderedMatMul",
        "DynamicQuantizeLSTM",
        "NhwcQLinearConv",
        "QLinearGather",
    }
)
FLOAT_COMPUTE_OPS = frozenset(
    {
        "Conv",
        "MatMul",
        "Gemm",
        "FusedConv",
        "FusedMatMul",
        "FusedGemm",
        "ConvTranspose",
        "Attention",
        "MultiHeadAttention",
    }
)


# ----------------------------------------------------------------------------- child processes


@dataclass
class ChildResult:
    """What a measured child process did: its payload (from _worker.py), time and peak memory."""

    ok: bool
    wall_seconds: float
    peak_rss_mib: float  # the child's own VmHWM, else the highest VmRSS the watchdog saw
    payload: dict[str, Any] = field(default_factory=dict)
    ru_maxrss_mib: float | None = None  # os.wait4; includes this process's size at fork time
    error: str | None = None
    returncode: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_child(
    cmd: Sequence[str],
    *,
    log_stem: Path,
    timeout_s: float,
    max_rss_mib: float,
    result_file: Path | None = None,
) -> ChildResult:
    """Run `cmd` in its own process group and measure it; kill it past the time or memory limit.

    Peak RSS is the child's VmHWM, read by the child itself at its end (``_worker.py`` does), so
    jobs never share a measurement. ``ru_maxrss`` from ``os.wait4`` is kept too but is only an
    upper bound: Linux carries the forking parent's resident size into it. A watchdog polls
    VmRSS every 20 ms to stop runaway memory before the machine swaps or the OOM killer picks a
    random victim; its highest reading stands in for VmHWM when the child reports none.
    """
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    if result_file is not None and result_file.exists():
        result_file.unlink()
    with (
        open(log_stem.with_suffix(".out"), "wb") as out,
        open(log_stem.with_suffix(".err"), "wb") as err,
    ):
        started = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, start_new_session=True)
        killed = None
        polled_peak = 0.0
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                elapsed = time.perf_counter() - started
                rss = _vm_rss_mib(proc.pid)
                polled_peak = max(polled_peak, rss)
                if killed is None and elapsed > timeout_s:
                    killed = f"killed: timeout after {timeout_s:.0f} s"
                elif killed is None and rss > max_rss_mib:
                    killed = f"killed: RSS above {max_rss_mib:.0f} MiB"
                if killed is not None:
                    _kill_group(proc.pid)
                time.sleep(0.02)
        except BaseException:
            # the child has its own session: stop it with us (Ctrl-C, SIGTERM, errors)
            _kill_group(proc.pid)
            proc.wait()
            raise
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    payload: dict[str, Any] = {}
    if result_file is not None and result_file.is_file():
        payload = json.loads(result_file.read_text())
    peak = payload.get("vmhwm_mib") or polled_peak
    ok = proc.returncode == 0 and killed is None and payload.get("ok", True) is not False
    error = None
    if not ok:
        error = (
            killed
            or payload.get("error")
            or _last_error_line(log_stem.with_suffix(".err"))
            or f"exit code {proc.returncode}"
        )
    return ChildResult(
        ok=ok,
        wall_seconds=wall,
        peak_rss_mib=peak,
        payload=payload,
        error=error,
        returncode=proc.returncode,
        ru_maxrss_mib=usage.ru_maxrss / 1024.0,  # KiB on Linux
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _vm_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return 0.0


def _last_error_line(path: Path) -> str | None:
    """The most telling line of a child's stderr: the last non-empty one, trimmed."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def compile_qcal_bytecode() -> str | None:
    """Compile the bytecode of the qcal the jobs import, as ``pip install`` does; its folder.

    The other tools' jobs import packages whose bytecode their install compiled. qcal run from
    a source tree (``PYTHONPATH``, an editable install) where ``PYTHONDONTWRITEBYTECODE`` is
    set would compile its ~150 modules again in every job, about 0.2 s of each job's time that
    no installed qcal spends.
    """
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("qcal")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = next(iter(spec.submodule_search_locations))
    compileall.compile_dir(folder, quiet=1)
    return str(folder)


def worker_cmd(job: Mapping[str, Any], result_file: Path) -> list[str]:
    return [sys.executable, str(WORKER), json.dumps(dict(job)), str(result_file)]


def run_worker(job: Mapping[str, Any], logs: Path, tag: str, args: Any) -> ChildResult:
    """`job` in a ``_worker.py`` process under the run's limits (``args.timeout``,
    ``args.max_rss_mib``); logs and result in ``logs/<tag>.*``."""
    result_file = logs / f"{tag}.result.json"
    return run_child(
        worker_cmd(job, result_file),
        log_stem=logs / tag,
        timeout_s=args.timeout,
        max_rss_mib=args.max_rss_mib,
        result_file=result_file,
    )


def ort_job(model: Any, method: str, calib: Path, output: Path) -> dict[str, Any]:
    """A ``_worker.py`` job running onnxruntime's ``quantize_static`` (`method`) on `model`."""
    return {
        "kind": "ort",
        "method": method,
        "model": str(model.path),
        "input": model.input_name,
        "data": str(calib),
        "batch_size": 1,
        "output": str(output),
    }


def parse_with_quick(
    parser: Any, argv: list[str] | None, quick: Mapping[str, Any]
) -> Any:
    """`parser`'s arguments plus ``--quick``, which replaces the settings listed in `quick`."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: " + ", ".join(f"{k}={v}" for k, v in quick.items()),
    )
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    return args


def qcal_cli_cmd(
    model: Path,
    data: Path,
    output: Path,
    report: Path,
    *,
    method: str | None,
    batch_size: int,
    eval_data: Path | None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`qcal calibrate` as the benchmark runs it; `extra` is appended verbatim (easy to edit)."""
    cmd = [
        *QCAL_CLI,
        "calibrate",
        str(model),
        "--data",
        str(data),
        "-o",
        str(output),
        "--report",
        str(report),
        "--batch-size",
        str(batch_size),
        "--force",
        "-q",
    ]
    if method is not None:
        cmd += ["--method", method]
    if eval_data is not None:
        cmd += ["--eval-data", str(eval_data)]
    return cmd + list(extra)


def qcal_cli_job(cmd: Sequence[str], report: Path) -> dict[str, Any]:
    """A `_worker.py` job running a `qcal_cli_cmd` command in-process (to measure its VmHWM)."""
    return {"kind": "qcal-cli", "argv": list(cmd[len(QCAL_CLI) :]), "report": str(report)}


def split_args(text: str) -> list[str]:
    return shlex.split(text) if text else []


def default_max_rss_mib() -> float:
    """80 % of physical memory: a guard, not a budget."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return 0.8 * int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 8192.0


# ----------------------------------------------------------------------------- machine, output


def machine_info() -> dict[str, Any]:
    import onnx
    import onnxruntime as ort

    cpu = platform.processor()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(
                        have & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}
                    )
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_flags": flags,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
    }
    try:
        import importlib.metadata as md

        info["qcal"] = md.version("qcal")
    except Exception:  # noqa: BLE001 - qcal may not be installed yet
        info["qcal"] = None
    return info


def git_commit() -> str | None:
    """The checkout's commit (short), with "-dirty" when tracked files differ from it; None
    outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=root, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if changed.strip() else "")


def write_results(name: str, data: Mapping[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{RUN_ID}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    latest = RESULTS_DIR / f"{name}-latest.json"
    latest.write_text(path.read_text())
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


# Outputs and logs of this run; runs started side by side never share a file.
RUN_ID = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def work_dir(script: str, *parts: str) -> Path:
    """``.cache/runs/<script>-<time>-<pid>/<parts>``, created on first use."""
    path = CACHE_DIR.joinpath("runs", f"{script}-{RUN_ID}", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A rich table when rich is importable, else aligned plain text; a Markdown table when
    the environment sets QCAL_BENCH_MARKDOWN=1 (for pasting into documents)."""
    rows = [[_cell(v) for v in row] for row in rows]
    if os.environ.get("QCAL_BENCH_MARKDOWN") == "1":
        print(f"\n{title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join(" --- " for _ in columns) + "|")
        for row in rows:
            print("| " + " | ".join(v.replace("|", "/") for v in row) + " |")
        return
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [
            max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
            for i, c in enumerate(columns)
        ]
        print(f"\n{title}")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for row in rows:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=escape(title), title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(escape(column), justify="left" if i < 3 else "right", overflow="fold")
    for row in rows:  # escaped: "qcal[fast]" is text, not rich markup
        table.add_row(*(escape(v) for v in row))
    Console(width=max(100, min(200, _terminal_width()))).print(table)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 160


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if np.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


# ----------------------------------------------------------------------------- model analysis


def count_ops(model_path: Path) -> dict[str, int]:
    """Op-type histogram of a model file (domain-qualified for non-default domains)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    counts: Counter[str] = Counter()
    for node in model.graph.node:
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        counts[f"{domain}:{node.op_type}" if domain else node.op_type] += 1
    return dict(sorted(counts.items()))


def summarize_optimized(counts: Mapping[str, int]) -> dict[str, Any]:
    """Integer kernels, leftover Q/DQ and float compute ops in onnxruntime's optimized graph."""
    integer: dict[str, int] = {}
    floats: dict[str, int] = {}
    q = dq = 0
    for key, n in counts.items():
        op = key.rsplit(":", 1)[-1]
        if op in INTEGER_OPS or op.startswith("QLinear"):
            integer[op] = integer.get(op, 0) + n
        elif op == "QuantizeLinear":
            q += n
        elif op == "DequantizeLinear":
            dq += n
        elif op in FLOAT_COMPUTE_OPS:
            floats[key] = floats.get(key, 0) + n
    return {
        "integer_nodes": sum(integer.values()),
        "integer": integer,
        "quantize_linear": q,
        "dequantize_linear": dq,
        "float_compute_nodes": sum(floats.values()),
        "float_compute": floats,
        "total_nodes": sum(counts.values()),
    }


def optimized_op_counts(model_path: Path, out_path: Path) -> dict[str, int]:
    """Let onnxruntime optimize the model (ORT_ENABLE_ALL, CPU), save that graph and count it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(out_path)
    options.log_severity_level = 3
    ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return count_ops(out_path)


class OutputAgreement:
    """Streams float and quantized outputs: SQNR, cosine, max abs error, top-1 agreement."""

    def __init__(self, *, argmax: bool) -> None:
        self.argmax = argmax
        self.signal = self.noise = self.dot = self.q_energy = 0.0
        self.max_abs = 0.0
        self.agree = self.total = 0

    def update(self, ref: np.ndarray, quant: np.ndarray) -> None:
        r = ref.astype(np.float64).ravel()
        q = quant.astype(np.float64).ravel()
        self.signal += float(r @ r)
        self.noise += float((r - q) @ (r - q))
        self.dot += float(r @ q)
        self.q_energy += float(q @ q)
        self.max_abs = max(self.max_abs, float(np.max(np.abs(r - q))) if r.size else 0.0)
        if self.argmax and ref.ndim >= 2:
            a, b = ref.argmax(axis=-1), quant.argmax(axis=-1)
            self.agree += int((a == b).sum())
            self.total += int(a.size)

    def result(self) -> dict[str, float | None]:
        sqnr = (
            float("inf")
            if self.noise == 0
            else 10 * np.log10(self.signal / self.noise)
            if self.signal > 0
            else float("-inf")
        )
        denom = np.sqrt(self.signal * self.q_energy)
        return {
            "sqnr_db": float(sqnr),
            "cosine": float(self.dot / denom) if denom > 0 else None,
            "max_abs_error": self.max_abs,
            "top1_agreement": self.agree / self.total if self.total else None,
        }


def median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def variant_sessions(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """An onnxruntime session (CPU, quiet) for every variant whose model was written."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return {
        name: ort.InferenceSession(str(v["path"]), options, providers=["CPUExecutionProvider"])
        for name, v in variants.items()
        if v["ok"]
    }
