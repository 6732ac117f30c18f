"""Conformance sweep over ONNX's own backend test cases (shipped in the onnx wheel).

Every case is calibrated as a user would: ``qcal calibrate CASE/model.onnx --data
CASE/test_data_set_0 -o OUT/q.onnx --report OUT/q.json``. The cases are the node cases
(``<onnx>/backend/test/data/node/*`` when the wheel ships them, else generated in memory by
``onnx.backend.test.case.node.collect_testcases()`` and written out the way onnx's own
``backend-test-tools generate-data`` does) and the folders ``pytorch-converted``,
``pytorch-operator`` and ``simple``. Each case is one test id (``node/test_abs``, ...).

What each case must do:

- the float model does not run in onnxruntime on the case's data: qcal exits 0 or with a
  documented refusal (3-7), never 1 (and never says it wrote an invalid model);
- exit 0 or 7: the QDQ model and the report exist; the model passes onnx.checker at the level
  the float model passes (``full_check`` or plain), loads and runs in onnxruntime on the same
  inputs, and has the float model's output names, element types and ranks (declared, and as
  run: compared with the float model's run, or with its declared outputs when that fails);
- exit 3/4/5/6: allowed when the reason lies in the input (a message of ``INPUT_REFUSALS``, or
  the float model does not run); a message about a model qcal built itself (the calibration,
  quantized or sensitivity model, InsertQDQ, checker failures of what qcal wrote) is qcal's fault,
  and so is an unknown refusal of a model onnxruntime runs (add it to ``INPUT_REFUSALS`` once a
  human has decided it is the input's fault);
- exit 1 (an internal error, i.e. a bug), any other code, a crash of the process or a run over
  ``CASE_TIMEOUT_S`` fails the case. For exit 1 the case is rerun with ``--debug`` and the failure
  names the exception and the innermost qcal frame.

The cases run in ``WORKERS`` worker processes (``python tests/test_conformance.py --worker``),
one case at a time each, so a crash or a hang of one case costs only that case. The sweep runs
once per session for the selected ids (``-k`` works). ``QCAL_CONFORMANCE_JSON=path`` writes every
case's result there; ``python tests/test_conformance.py --summary path`` prints the grouped counts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytestmark = pytest.mark.slow

ONNX_DATA = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data"
FOLDER_KINDS = ("pytorch-converted", "pytorch-operator", "simple")
CASE_TIMEOUT_S = 90.0  # one case, qcal plus the checks; the slowest takes under 2 s
SWEEP_BUDGET_S = 480.0  # cases not started by then fail as "not run"
WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))
# Options appended to the command line above; ("--placement", "all") puts Q/DQ on every node with a
# rule and so exercises the QDQ writer on about 3.5 times as many cases.
EXTRA_ARGS: tuple[str, ...] = ()
QCAL_CLEAN_EXITS = (0, 7)
QCAL_REFUSALS = (3, 4, 5, 6)

# Refusals whose reason lies in the model or the data, not in qcal: allowed even when
# onnxruntime runs the float model. Anything else qcal refuses on a runnable model fails.
INPUT_REFUSALS = {
    "sequence, optional or map model input": r"model input '.*' is an? (sequence|optional|map)_type",
    "already quantized": r"the model is already quantized",
    "non-finite data": r"holds NaN( or infinite)? values|calibration data contains NaN",
    "model without inputs (empty data set)": r"no calibration data in this folder",
    # Scan-8's batch axis goes when onnx converts it to opset 9+: the model would take other inputs
    "opset upgrade would change the inputs": r"converter changes input '.*' from rank",
}
# qcal checking what it wrote: always qcal's fault.
QCAL_WROTE = re.compile(r"InsertQDQ|wrote a (model|malformed)")
# onnxruntime failing on a model qcal built: qcal's fault when the float model runs.
QCAL_MODELS = re.compile(
    r"quantized model|calibration model|sensitivity( probe)? model|shape probe|second model|"
    r"onnxruntime failed on (a )?(calibration|sensitivity)"
)


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------


def _folder_cases(kinds: tuple[str, ...]) -> dict[str, Path]:
    cases = {}
    for kind in kinds:
        for folder in sorted((ONNX_DATA / kind).glob("*")):
            if (folder / "model.onnx").is_file() and (folder / "test_data_set_0").is_dir():
                cases[f"{kind}/{folder.name}"] = folder
    return cases


def _pb_bytes(value: Any, info: onnx.ValueInfoProto) -> bytes:
    """One input file as onnx's generate-data writes it."""
    kind = info.type.WhichOneof("value")
    if kind == "map_type":
        return bytes(numpy_helper.from_dict(value, info.name).SerializeToString())
    if kind == "sequence_type":
        return bytes(numpy_helper.from_list(value, info.name).SerializeToString())
    if kind == "optional_type":
        return bytes(numpy_helper.from_optional(value, info.name).SerializeToString())
    if isinstance(value, onnx.TensorProto):
        return bytes(value.SerializeToString())
    return bytes(numpy_helper.from_array(value, info.name).SerializeToString())


@functools.cache
def _generated_node_cases() -> dict[str, tuple[bytes, tuple[bytes, ...]]]:
    """Node cases built in memory: id -> (model bytes, input files). numpy's global generator
    is seeded for the export functions that draw random inputs, and restored afterwards."""
    from onnx.backend.test.case import node

    state = np.random.get_state()
    np.random.seed(0)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            testcases = node.collect_testcases()
    finally:
        np.random.set_state(state)
    cases = {}
    for case in testcases:
        assert case.model is not None and case.data_sets, case.name
        inputs, _ = case.data_sets[0]
        files = tuple(_pb_bytes(v, case.model.graph.input[j]) for j, v in enumerate(inputs))
        cases[f"node/{case.name}"] = (case.model.SerializeToString(), files)
    return cases


def _node_on_disk() -> bool:
    return any((ONNX_DATA / "node").glob("*/model.onnx"))


def case_ids() -> list[str]:
    ids = list(_folder_cases(FOLDER_KINDS))
    ids += list(_folder_cases(("node",)) if _node_on_disk() else _generated_node_cases())
    return sorted(ids)


def _materialize(ids: list[str], root: Path) -> dict[str, Path]:
    """Case id -> folder holding model.onnx and test_data_set_0 (written for generated cases)."""
    on_disk = _folder_cases(FOLDER_KINDS + (("node",) if _node_on_disk() else ()))
    folders = {}
    for case_id in ids:
        if case_id in on_disk:
            folders[case_id] = on_disk[case_id]
            continue
        model, inputs = _generated_node_cases()[case_id]
        folder = root / case_id
        (folder / "test_data_set_0").mkdir(parents=True)
        (folder / "model.onnx").write_bytes(model)
        for j, data in enumerate(inputs):
            (folder / "test_data_set_0" / f"input_{j}.pb").write_bytes(data)
        folders[case_id] = folder
    return folders


# --------------------------------------------------------------------------------------------
# One case (runs in a worker process)
# --------------------------------------------------------------------------------------------


def _first_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_pb(path: Path, info: onnx.ValueInfoProto | None) -> Any:
    kind = info.type.WhichOneof("value") if info is not None else "tensor_type"
    proto: Any
    if kind == "sequence_type":
        proto = onnx.SequenceProto()
        proto.ParseFromString(path.read_bytes())
        return numpy_helper.to_list(proto)
    if kind == "optional_type":
        proto = onnx.OptionalProto()
        proto.ParseFromString(path.read_bytes())
        return numpy_helper.to_optional(proto)
    if kind == "map_type":
        proto = onnx.MapProto()
        proto.ParseFromString(path.read_bytes())
        return numpy_helper.to_dict(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(proto)


def _feeds(model: onnx.ModelProto, data: Path) -> dict[str, Any]:
    """The data set's inputs by model input name: by tensor names when they all name inputs,
    else by position among the inputs that are not initializers."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    by_name = {i.name: i for i in model.graph.input}
    files = sorted(data.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    names = []
    for path in files:
        proto = onnx.TensorProto()
        with contextlib.suppress(Exception):
            proto.ParseFromString(path.read_bytes())
        names.append(proto.name)
    if not (all(n in by_name for n in names) and len(set(names)) == len(names)):
        names = [inputs[int(p.stem.split("_")[1])].name for p in files]
    return {n: _read_pb(p, by_name.get(n)) for n, p in zip(names, files)}


def _session(model_path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} rank {value.ndim}"
    if value is None:
        return "none"
    return type(value).__name__


def _run(model_path: Path, feeds: dict[str, Any]) -> dict[str, str]:
    """Output name -> element type and rank as onnxruntime computes them."""
    session = _session(model_path)
    names = [o.name for o in session.get_outputs()]
    return {n: _describe(v) for n, v in zip(names, session.run(None, feeds))}


def _checker_level(model: onnx.ModelProto) -> str | None:
    for level, full in (("full_check", True), ("plain", False)):
        with contextlib.suppress(Exception):
            onnx.checker.check_model(model, full_check=full)
            return level
    return None


def _declared(model: onnx.ModelProto) -> list[tuple[str, str]]:
    described = []
    for out in model.graph.output:
        kind = out.type.WhichOneof("value")
        if kind == "tensor_type":
            tensor = out.type.tensor_type
            rank = len(tensor.shape.dim) if tensor.HasField("shape") else None
            type_name = onnx.TensorProto.DataType.Name(tensor.elem_type)
            described.append((out.name, f"{type_name} rank {rank}"))
        else:
            described.append((out.name, str(kind)))
    return described


def _same_declared(float_model: onnx.ModelProto, quant: onnx.ModelProto) -> str | None:
    f_out, q_out = _declared(float_model), _declared(quant)
    if [n for n, _ in f_out] != [n for n, _ in q_out]:
        return f"output names {[n for n, _ in q_out]} instead of {[n for n, _ in f_out]}"
    for (name, f_type), (_, q_type) in zip(f_out, q_out):
        # an undeclared rank (rank None) may become known
        if f_type != q_type and not (f_type.endswith("rank None") and
                                     q_type.startswith(f_type[: -len("None")])):
            return f"output {name!r} declared {q_type} instead of {f_type}"
    return None


def _qcal_frame(exc_info: Any) -> str:
    """Exception type, message and the innermost frame in qcal of a --debug rerun."""
    if not exc_info:
        return ""
    _, exc, tb = exc_info
    frames = traceback.extract_tb(tb)
    qcal_frames = [f for f in frames if f"{os.sep}qcal{os.sep}" in f.filename]
    where = ""
    if qcal_frames:
        f = qcal_frames[-1]
        where = f"{f.filename.split(os.sep + 'qcal' + os.sep)[-1]}:{f.lineno} in {f.name}"
        if frames[-1] is not f:
            last = frames[-1]
            where += f" (raised in {Path(last.filename).name}:{last.lineno})"
    return f"{type(exc).__name__} at qcal/{where}" if where else type(exc).__name__


def run_case(folder: Path, out: Path) -> dict[str, Any]:
    """Everything the test asserts about one case (plain data: it crosses a pipe as JSON)."""
    from click.testing import CliRunner

    from qcal.cli import main

    start = time.perf_counter()
    model_path, data = folder / "model.onnx", folder / "test_data_set_0"
    result: dict[str, Any] = {"float_error": None, "message": "", "detail": "", "where": ""}
    float_model = onnx.load(str(model_path))
    float_outputs: dict[str, str] = {}
    feeds: dict[str, Any] | None = None
    try:
        feeds = _feeds(float_model, data)
    except Exception as err:  # noqa: BLE001
        result["float_error"] = f"cannot read the data: {_first_line(err)}"
    if feeds is not None:
        try:
            float_outputs = _run(model_path, feeds)
        except Exception as err:  # noqa: BLE001
            result["float_error"] = _first_line(err)
    level = _checker_level(float_model)

    out.mkdir(parents=True, exist_ok=True)
    q_path, report = out / "q.onnx", out / "q.json"
    args = ["calibrate", str(model_path), "--data", str(data), "-o", str(q_path),
            "--report", str(report), *EXTRA_ARGS]
    ran = CliRunner().invoke(main, args)
    code = ran.exit_code
    lines = [ln for ln in ran.stderr.strip().splitlines() if ln.strip()]
    result["exit"] = code
    result["message"] = lines[-1] if lines else ""
    if ran.exception is not None and not isinstance(ran.exception, SystemExit):
        result["message"] = f"uncaught {type(ran.exception).__name__}: {_first_line(ran.exception)}"
        result["where"] = _qcal_frame(ran.exc_info)
    elif code == 1:
        debug_out = out / "debug"
        debug_out.mkdir()
        rerun = CliRunner().invoke(main, [*args[:4], "-o", str(debug_out / "q.onnx"), "--report",
                                          str(debug_out / "q.json"), *EXTRA_ARGS, "--debug"])
        result["where"] = _qcal_frame(rerun.exc_info)

    if code in QCAL_CLEAN_EXITS:
        result["detail"], result["qdq_nodes"] = _check_output(
            float_model, float_outputs, level, q_path, report, feeds)
    result["seconds"] = round(time.perf_counter() - start, 3)
    result["outcome"] = classify(result)
    return result


def _declared_as_run(model: onnx.ModelProto) -> dict[str, str]:
    """Output name -> what _describe says of it, for the outputs whose type and rank are declared."""
    described = {}
    for out in model.graph.output:
        tensor = out.type.tensor_type
        if out.type.HasField("tensor_type") and tensor.HasField("shape"):
            with contextlib.suppress(Exception):
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
                described[out.name] = f"{dtype} rank {len(tensor.shape.dim)}"
    return described


def _check_output(float_model: onnx.ModelProto, float_outputs: dict[str, str],
                  level: str | None, q_path: Path, report: Path,
                  feeds: dict[str, Any] | None) -> tuple[str, int]:
    """('' when the written model is sound, else what is wrong with it; its Q/DQ node count).

    The outputs as run are compared with the float model's as run, or, when onnxruntime does
    not run the float model, with its declared outputs."""
    if not q_path.is_file() or not report.is_file():
        return f"missing output: model {q_path.is_file()}, report {report.is_file()}", 0
    try:
        quant = onnx.load(str(q_path))
    except Exception as err:  # noqa: BLE001
        return f"onnx.load: {_first_line(err)}", 0
    qdq = sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in quant.graph.node)
    problem = _same_declared(float_model, quant)
    if problem:
        return problem, qdq
    if level is not None:
        try:
            onnx.checker.check_model(quant, full_check=level == "full_check")
        except Exception as err:  # noqa: BLE001
            return f"onnx.checker ({level}): {_first_line(err)}", qdq
    if feeds is None:
        return "", qdq
    try:
        quant_outputs = _run(q_path, feeds)
    except Exception as err:  # noqa: BLE001
        return f"onnxruntime: {_first_line(err)}", qdq
    expected = float_outputs or _declared_as_run(float_model)
    diff = [f"{n!r}: {quant_outputs.get(n)} instead of {t}" for n, t in expected.items()
            if quant_outputs.get(n) != t]
    if diff or (float_outputs and list(quant_outputs) != list(float_outputs)):
        return "computed outputs differ: " + "; ".join(diff or [str(list(quant_outputs))]), qdq
    return "", qdq


def classify(r: dict[str, Any]) -> str:
    """The outcome class of a case result (see the module docstring)."""
    code, message = r.get("exit"), r.get("message", "")
    if code is None:
        return str(r.get("outcome", "crash"))
    if message.startswith("uncaught"):
        return "exit 1 (internal error)"
    if code in QCAL_CLEAN_EXITS:
        return f"exit {code}, output " + ("broken" if r["detail"] else "ok")
    if code == 1:
        return "exit 1 (internal error)"
    if code in QCAL_REFUSALS:
        if QCAL_WROTE.search(message):
            return f"exit {code}, qcal-caused"
        if r["float_error"] is not None:
            return f"exit {code}, input-caused (float model not runnable)"
        if QCAL_MODELS.search(message):
            return f"exit {code}, qcal-caused"
        if any(re.search(p, message) for p in INPUT_REFUSALS.values()):
            return f"exit {code}, input-caused"
        return f"exit {code}, qcal-caused (refuses a runnable model for an unknown reason)"
    return f"exit {code} (undocumented for this run)"


def passes(r: dict[str, Any]) -> bool:
    outcome: str = r["outcome"]
    return outcome.endswith(("output ok", "input-caused", "(float model not runnable)"))


# --------------------------------------------------------------------------------------------
# The worker processes
# --------------------------------------------------------------------------------------------


def _worker_main() -> None:
    """Read JSON requests {folder, out} from stdin, write one JSON result line each."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed to fd 1 (native code included) must not reach the protocol
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")
    # The models are timed in this process, as the test suite times them (tests/conftest.py):
    # a case checks conformance, not speed, and a process of their own costs 0.3 s a case.
    from qcal import _users_model
    from qcal.accuracy import latency
    _users_model.time_side_by_side = latency.time_here
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = run_case(Path(request["folder"]), Path(request["out"]))
        except Exception as err:  # noqa: BLE001 (a failure of the harness, not of qcal)
            result = {"exit": None, "outcome": "harness error",
                      "message": f"{type(err).__name__}: {_first_line(err)}",
                      "detail": traceback.format_exc(limit=-3)}
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )

    def ask(self, request: dict[str, str], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            return {"exit": None, "outcome": "timeout",
                    "message": f"no result after {timeout:.0f} s (worker killed)"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"exit": None, "outcome": "crash",
                    "message": f"worker process died (return code {code})"}
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def sweep(ids: list[str], root: Path, workers: int = WORKERS) -> dict[str, dict[str, Any]]:
    """Run the cases in `workers` processes; id -> result."""
    folders = _materialize(ids, root / "cases")
    pending = collections.deque(ids)
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + SWEEP_BUDGET_S

    def drive() -> None:
        worker = _Worker()
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    case_id = pending.popleft()
                if time.monotonic() > deadline:
                    result = {"exit": None, "outcome": "not run",
                              "message": f"sweep budget of {SWEEP_BUDGET_S:.0f} s exhausted"}
                else:
                    out = root / "out" / case_id
                    result = worker.ask({"folder": str(folders[case_id]), "out": str(out)},
                                        CASE_TIMEOUT_S)
                    shutil.rmtree(out, ignore_errors=True)
                    if worker.proc.poll() is not None:  # died or killed: a fresh one
                        worker.stop()
                        worker = _Worker()
                result["id"] = case_id
                with lock:
                    results[case_id] = result
        finally:
            worker.stop()

    threads = [threading.Thread(target=drive) for _ in range(max(1, min(workers, len(ids))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def _slow_selected(config: pytest.Config) -> bool:
    """Whether -m selects this module's tests: the node cases take ~10 s to build, which the
    default run (-m 'not slow') should not pay at collection."""
    expr = config.getoption("markexpr", "")
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        def has_mark(name: str, /, **kwargs: object) -> bool:
            return name in ("slow", "parametrize")

        return bool(Expression.compile(expr).evaluate(has_mark))
    except Exception:  # noqa: BLE001
        return True


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case_id" in metafunc.fixturenames:
        ids = case_ids() if _slow_selected(metafunc.config) else []
        metafunc.parametrize("case_id", ids, ids=ids)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """One sweep over every selected case of this module."""
    selected = [str(item.callspec.params["case_id"]) for item in request.session.items
                if isinstance(item, pytest.Function) and item.module is request.module
                and "case_id" in getattr(getattr(item, "callspec", None), "params", {})]
    root = tmp_path_factory.mktemp("conformance")
    start = time.monotonic()
    found = sweep(selected, root)
    wall = time.monotonic() - start
    dump = os.environ.get("QCAL_CONFORMANCE_JSON")
    if dump:
        Path(dump).write_text(json.dumps({"wall_seconds": round(wall, 1), "workers": WORKERS,
                                          "cases": found}, indent=1))
    yield found
    shutil.rmtree(root, ignore_errors=True)


def test_case_conforms(case_id: str, results: dict[str, dict[str, Any]]) -> None:
    r = results[case_id]
    if passes(r):
        return
    text = f"{r['outcome']}: {r.get('message', '')}"
    if r.get("where"):
        text += f"\n  at {r['where']}"
    if r.get("detail"):
        text += f"\n  written model: {r['detail']}"
    if r.get("float_error"):
        text += f"\n  (the float model does not run: {r['float_error']})"
    pytest.fail(text, pytrace=False)


def test_the_sweep_covers_the_onnx_backend_cases() -> None:
    """The sweep is not vacuous: the wheel still ships the case folders and the node cases."""
    ids = case_ids()
    kinds = collections.Counter(i.split("/")[0] for i in ids)
    assert kinds["node"] > 1000 and all(kinds[k] > 10 for k in FOLDER_KINDS), kinds


# --------------------------------------------------------------------------------------------
# Summary of a dumped sweep (for people, not for pytest)
# --------------------------------------------------------------------------------------------


def _pattern(message: str) -> str:
    """A message with its case-specific parts (quoted names, paths, numbers) blanked."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", message)
    text = re.sub(r"(/[\w.+-]+)+", "PATH", text)
    return re.sub(r"\d+", "N", text)


def summarize(path: Path, top: int = 10) -> str:
    dumped = json.loads(path.read_text())
    cases: dict[str, dict[str, Any]] = dumped["cases"]
    out = io.StringIO()
    out.write(f"{len(cases)} cases in {dumped['wall_seconds']} s ({dumped['workers']} workers)\n")
    for outcome, n in collections.Counter(r["outcome"] for r in cases.values()).most_common():
        out.write(f"  {n:5d}  {outcome}\n")
    with_qdq = sum(r.get("qdq_nodes", 0) > 0 for r in cases.values() if r.get("exit") in (0, 7))
    out.write(f"  (exit 0/7 models holding Q/DQ nodes: {with_qdq})\n")
    failing = [r for r in cases.values() if not passes(r)]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in failing:
        key = r.get("detail") if "output broken" in r["outcome"] else r.get("message", "")
        groups[(r["outcome"], _pattern(key or "") + (f"  [{r['where']}]" if r.get("where") else ""))
               ].append(r)
    for outcome in sorted({o for o, _ in groups}):
        out.write(f"\n== {outcome}\n")
        ranked = sorted(((k, v) for k, v in groups.items() if k[0] == outcome),
                        key=lambda kv: -len(kv[1]))
        for (_, pattern), members in ranked[:top]:
            example = members[0]
            out.write(f"  {len(members):4d}  {pattern}\n        e.g. {example['id']}: "
                      f"{example.get('detail') or example.get('message')}\n")
        if len(ranked) > top:
            out.write(f"  ... {len(ranked) - top} more patterns\n")
    return out.getvalue()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker_main()
    elif sys.argv[1:2] == ["--summary"]:
        print(summarize(Path(sys.argv[2])))
    else:
        print(f"usage: {sys.argv[0]} --worker | --summary RESULTS.json", file=sys.stderr)
        sys.exit(2)
