"""The process `qcal.accuracy.latency.time_side_by_side` times the two models in.

``python -m qcal.accuracy._timing FOLDER SETTINGS``: FOLDER holds ``float.onnx``,
``quantized.onnx`` and ``feed.npz`` (the samples' inputs as ``arr_0``, ``arr_1``, ..., sample
by sample, each in the order SETTINGS names them); SETTINGS is JSON (providers, threads: one
count, budget, for_gate, tolerance, inputs, samples). The process has one pool of that many
onnxruntime threads, which both models' sessions share
(`qcal.accuracy.latency.measure_latency`). The answer goes to ``answer.json`` in FOLDER: the
figures, the worst ratio and the thread counts found slower, or the error that stopped the
timing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx

from qcal.accuracy import latency
from qcal.calibration.runtime import share_one_pool
from qcal.numerics.errors import one_line


def main(argv: list[str]) -> int:
    folder, settings = Path(argv[0]), json.loads(argv[1])
    # the tolerance of the process that asked (its tests set their own)
    latency._TOLERANCE = float(settings["tolerance"])
    names, samples = settings["inputs"], int(settings["samples"])
    with np.load(folder / "feed.npz", allow_pickle=False) as arrays:
        feeds = [{name: arrays[f"arr_{j * len(names) + i}"] for i, name in enumerate(names)}
                 for j in range(samples)]
    try:
        share_one_pool(int(settings["threads"]))
        result = latency.time_here(
            _load(folder / "float.onnx"), _load(folder / "quantized.onnx"), feeds,
            providers=tuple(settings["providers"]), threads=(int(settings["threads"]),),
            budget=float(settings["budget"]), for_gate=bool(settings["for_gate"]))
    except Exception as err:  # noqa: BLE001  onnxruntime raises untyped exceptions
        answer: dict[str, object] = {"error": one_line(err)}
    else:
        answer = {"figures": result.figures, "worst_ratio": result.worst_ratio,
                  "clearly_slower": list(result.clearly_slower)}
    (folder / latency.TIMING_ANSWER).write_text(json.dumps(answer))
    return 0


def _load(path: Path) -> onnx.ModelProto:
    """The model as the parent holds it: weights it keeps in files are referred to by absolute
    path and mapped by the session; weights written beside it (`stage_model`) are read."""
    return onnx.load(path, load_external_data=path.with_name(f"{path.name}.data").exists())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
