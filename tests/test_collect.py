"""Collection streams: observers see every batch in order, and no batch outlives the next one."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcal.calibration.collect import collect
from qcal.numerics.observers import MinMaxObserver, PerTensor


def _relu_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu"),
         helper.make_node("Neg", ["y"], ["z"], name="neg")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 256])],
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 256])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class RecordingObserver:
    """Keeps weak references to what it is fed, and counts how many are still alive."""

    is_order_dependent = False

    def __init__(self) -> None:
        self.refs: list[weakref.ref[np.ndarray]] = []
        self.max_alive = 0
        self.first_values: list[float] = []

    def update(self, batch: np.ndarray) -> None:
        gc.collect()
        self.refs.append(weakref.ref(batch))
        self.max_alive = max(self.max_alive, sum(r() is not None for r in self.refs))
        self.first_values.append(float(batch.ravel()[0]))

    def merge(self, other: Any) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    def state(self) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return {}


def _batches(n: int) -> Any:
    for i in range(n):
        yield {"x": np.full((4, 256), float(i), np.float32)}, 4


def test_no_batch_is_retained_and_order_is_kept() -> None:
    observer = RecordingObserver()
    summary = collect(_relu_model(), {"y": observer}, _batches(50))
    assert summary.samples == 200 and summary.batches == 50
    assert observer.first_values == [float(i) for i in range(50)]
    # The pipeline keeps at most the batch being observed and the one being computed.
    assert observer.max_alive <= 2
    gc.collect()
    assert all(r() is None for r in observer.refs)


def test_collect_equals_direct_reduction() -> None:
    rng = np.random.default_rng(3)
    data = [rng.standard_normal((3, 256)).astype(np.float32) for _ in range(7)]
    observer = MinMaxObserver(PerTensor())
    collect(_relu_model(), {"y": observer}, (({"x": d}, 3) for d in data))
    stacked = np.maximum(np.concatenate(data), 0)
    state = observer.state()
    assert float(state.min) == float(stacked.min()) and float(state.max) == float(stacked.max())


def test_non_finite_activation_names_the_tensor(tmp_path: Path) -> None:
    import pytest

    from qcal.numerics.errors import DataError

    observer = MinMaxObserver(PerTensor())
    bad = {"x": np.array([[np.nan] * 256], np.float32)}
    with pytest.raises(DataError, match="'y'"):
        collect(_relu_model(), {"y": observer}, iter([(bad, 1)]))
