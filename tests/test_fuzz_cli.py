"""The command line against random models, random option combinations and broken data.

Hypothesis draws a small model (the random-graph generator of `test_fuzz`), a defect of its
calibration data (or none), sometimes held-back evaluation data with its own defect, and a
random combination of options, and runs `qcal calibrate` in-process. Whatever it draws:

* the exit code is 0 or a documented one, never 1, and no traceback is printed;
* the model and data files given are unchanged;
* numpy warns of no arithmetic on infinities or NaN (such a value was not guarded against);
* a refusal (codes 2-6) leaves no output and no temporary file behind, with a one-line message;
  the accuracy-gate code (7) leaves both the model and the report, as evidence.

The default run draws a bounded number of examples with a fixed seed (CI keeps it under two
minutes); ``QCAL_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_cli.py`` draws many more, and
``QCAL_FUZZ_DUMP=folder`` copies the files of a failing example there with its arguments
(``QCAL_FUZZ_LAST=folder``: of every example before it runs, for a crash of the process).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import Case, cases

from qcal.cli import main
from qcal.numerics import errors

DOCUMENTED = {0, 2} | {
    cls.exit_code
    for cls in (errors.ConfigError, errors.ModelError, errors.DataError, errors.OutputError,
                errors.AccuracyGateError)
}
EXAMPLES = int(os.environ.get("QCAL_FUZZ_EXAMPLES", "150"))
F32_MAX = np.finfo(np.float32).max


def _poison(value: float) -> Callable[[np.ndarray, np.random.Generator], dict[str, np.ndarray]]:
    def defect(x: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        x = x.copy()
        x.flat[int(rng.integers(x.size))] = value
        return {"x": x}
    return defect


# Each defect turns the calibration array (samples, 1, ...) into the arrays of an .npz file.
DEFECTS: dict[str, Callable[[np.ndarray, np.random.Generator], dict[str, np.ndarray]]] = {
    "none": lambda x, _: {"x": x},
    "nan": _poison(float("nan")),
    "inf": _poison(float("inf")),
    "-inf": _poison(float("-inf")),
    "float32 max sentinels": lambda x, _: {"x": np.where(np.arange(x.size).reshape(x.shape) % 5,
                                                         x, F32_MAX).astype(np.float32)},
    "float64": lambda x, _: {"x": x.astype(np.float64)},
    "int32": lambda x, _: {"x": (x * 10).astype(np.int32)},
    "rank dropped": lambda x, _: {"x": x.reshape(x.shape[0], -1)[:, :1]},
    "rank added": lambda x, _: {"x": x[..., np.newaxis]},
    "no samples": lambda x, _: {"x": x[:0]},
    "extra array": lambda x, _: {"x": x, "y": x},
    "wrong name": lambda x, _: {"input": x},
    "constant": lambda x, _: {"x": np.zeros_like(x)},
}
TRUNCATIONS = ["none", "truncated", "empty file", "not a zip"]
OPTIONS: list[list[str]] = [
    ["--per-tensor"], ["--batch-size", "3"], ["--limit", "2"], ["--placement", "all"],
    ["--no-fallback"], ["--no-default-exclusions"], ["--threads", "1"], ["--opset", "17"],
    ["--opset", "21"], ["--exclude-op-types", "Conv"], ["--op-types", "MatMul,Relu"],
    ["--sensitivity"], ["--sensitivity-samples", "2"], ["--min-coverage", "100"],
    ["--min-coverage", "0"], ["--target-sqnr", "30"], ["--max-agreement-drop", "0"],
    ["--fail-under-sqnr", "-inf"], ["--fail-under-sqnr", "25"], ["--fail-if-coverage-below", "90"],
    ["--fail-under-agreement", "99"], ["--method", "entropy"], ["--method", "moving-average"],
    ["--preset", "mindspore"], ["--preset-option", "reduce_range=true"], ["--bins", "64"],
    ["--target-sqnr", "nan"], ["--seed", "-1"], ["--percentile", "100"], ["--limit", "0"],
]


def _write_npz(path: Path, arrays: dict[str, np.ndarray], truncation: str) -> None:
    np.savez(path, **arrays)
    raw = path.read_bytes()
    if truncation == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif truncation == "empty file":
        path.write_bytes(b"")
    elif truncation == "not a zip":
        path.write_bytes(b"\x93NUMPY not really" + raw[:16])


def _digest(folder: Path, names: list[str]) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


@pytest.mark.filterwarnings("error::RuntimeWarning")  # arithmetic on inf/NaN unguarded
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), data=st.data())
def test_the_command_line_never_reaches_an_internal_error(case: Case, data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="defect seed"))
    # Sound inputs half the time, so that the options are exercised beyond the first check.
    calib_defect = data.draw(st.sampled_from(["none"] * 12 + sorted(DEFECTS)),
                             label="calibration defect")
    calib_file = data.draw(st.sampled_from(["none"] * 9 + TRUNCATIONS), label="calibration file")
    eval_defect = data.draw(st.sampled_from([None] * 6 + ["none"] * 6 + sorted(DEFECTS)),
                            label="evaluation defect")
    options = data.draw(st.lists(st.sampled_from(OPTIONS), max_size=4, unique_by=tuple),
                        label="options")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        onnx.save(case.model, folder / "m.onnx")
        _write_npz(folder / "calib.npz", DEFECTS[calib_defect](case.data, rng), calib_file)
        inputs = ["m.onnx", "calib.npz"]
        args = ["calibrate", str(folder / "m.onnx"), "--data", str(folder / "calib.npz"),
                "-o", str(folder / "q.onnx"), "--report", str(folder / "q.json"), "-q",
                "--preset", case.preset, "--method", case.method]
        if eval_defect is not None:
            _write_npz(folder / "eval.npz", DEFECTS[eval_defect](case.data, rng), "none")
            inputs.append("eval.npz")
            args += ["--eval-data", str(folder / "eval.npz")]
        args += [word for option in options for word in option]  # later options win
        before = _digest(folder, inputs)
        if os.environ.get("QCAL_FUZZ_LAST"):  # what a crash of the process itself leaves to see
            shutil.copytree(folder, os.environ["QCAL_FUZZ_LAST"], dirs_exist_ok=True)
            Path(os.environ["QCAL_FUZZ_LAST"], "args.json").write_text(json.dumps(args))

        result = CliRunner().invoke(main, args)

        said = result.output + result.stderr
        if result.exit_code == 1 and os.environ.get("QCAL_FUZZ_DUMP"):  # keep it to reproduce
            shutil.copytree(folder, os.environ["QCAL_FUZZ_DUMP"], dirs_exist_ok=True)
            Path(os.environ["QCAL_FUZZ_DUMP"], "args.json").write_text(json.dumps(args))
        assert result.exit_code in DOCUMENTED, (result.exit_code, said)
        assert "Traceback" not in said and "internal error" not in said, said
        assert _digest(folder, inputs) == before
        left = sorted(p.name for p in folder.iterdir() if p.name not in inputs)
        if result.exit_code == errors.AccuracyGateError.exit_code:
            assert left == ["q.json", "q.onnx"], left
            report = json.loads((folder / "q.json").read_text())
            assert any(not gate["passed"] for gate in report["gates"])
        elif result.exit_code == 0:
            assert left == ["q.json", "q.onnx"], left
            onnx.checker.check_model(onnx.load(folder / "q.onnx"))
        else:
            assert left == [], (left, said)
            message = result.stderr.strip()
            assert len(message.splitlines()) == 1 and message.startswith(("error", "Usage",
                                                                          "Error")), message
