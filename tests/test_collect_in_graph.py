"""Min/max statistics computed inside the onnxruntime graph equal, bit for bit, what observers
get from the whole tensors; NaN (whatever its payload), infinities, signed zeros and empty
batches included."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from onnx import helper

from qcal.calibration import data as data_mod
from qcal.calibration.collect import collect, expose_tensors
from qcal.calibration.reduce_min_max import add_min_max_outputs, read_per_tensor
from qcal.config import CalibrationConfig
from qcal.graph.model import model_inputs
from qcal.numerics.errors import DataError
from qcal.numerics.observers import (
    DataPolicy,
    Granularity,
    MindSporeObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    OneFlowMovingAverageObserver,
    PerChannel,
    PerTensor,
)
from qcal.pipeline import plan_model

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"
Feed = Mapping[str, np.ndarray]
ObserverFactory = Callable[[Granularity], object]

OBSERVERS: dict[str, ObserverFactory] = {
    "minmax": lambda g: MinMaxObserver(g),
    "moving-average": lambda g: MovingAverageMinMaxObserver(g, averaging_constant=0.3),
    "mindspore-ema": lambda g: MindSporeObserver(g, ema=True, ema_decay=0.9),
    "oneflow": lambda g: OneFlowMovingAverageObserver(g, momentum=0.8, symmetric=False),
}


def _whole_tensor_states(
    model: onnx.ModelProto,
    make: Callable[[str], object],
    tensors: Sequence[str],
    feeds: Sequence[Feed],
) -> dict[str, object]:
    """The reference: every tensor leaves onnxruntime whole and goes through `update`."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        expose_tensors(model, tensors).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )
    observers = {t: make(t) for t in tensors}
    for feed in feeds:
        for tensor, array in zip(tensors, session.run(list(tensors), dict(feed))):
            if array.size:
                observers[tensor].update(array)  # type: ignore[attr-defined]
    return observers


def _bits(values: np.ndarray) -> bytes:
    """The float32 bit patterns, every NaN written as one (a NaN's sign and payload carry no
    data, and numpy's min/max and onnxruntime's kernels choose them differently)."""
    return np.where(np.isnan(values), np.float32(np.nan), values).astype(np.float32).tobytes()


def _assert_same_states(found: Mapping[str, object], expected: Mapping[str, object]) -> None:
    for tensor, observer in expected.items():
        want = observer.state()  # type: ignore[attr-defined]
        got = found[tensor].state()  # type: ignore[attr-defined]
        assert _bits(got.min) == _bits(want.min), (tensor, got.min, want.min)
        assert _bits(got.max) == _bits(want.max), (tensor, got.max, want.max)
        assert got.axis == want.axis, tensor


def _sample_model(name: str) -> tuple[onnx.ModelProto, list[str], list[Feed]]:
    path = SAMPLES / f"{name}.onnx"
    config = CalibrationConfig(data=SAMPLES / f"{name}.calib.npz", limit=12)
    _, prepared, _, plan = plan_model(path, config)
    inputs = model_inputs(prepared)
    source = data_mod.open_data(config.data, model_path=path, inputs=inputs, limit=12)
    feeds = [feed for feed, _ in data_mod.iter_batches(source, inputs, 3)]
    return prepared, sorted(t.tensor for t in plan.activations), feeds


@pytest.mark.parametrize("kind", sorted(OBSERVERS))
@pytest.mark.parametrize("name", ["digits_cnn", "transformer_block"])
def test_sample_models_in_graph_equals_whole_tensors(name: str, kind: str) -> None:
    model, tensors, feeds = _sample_model(name)
    make = OBSERVERS[kind]
    observers = {t: make(PerTensor()) for t in tensors}
    collect(model, observers, ((f, 3) for f in feeds))  # type: ignore[arg-type]
    expected = _whole_tensor_states(model, lambda t: make(PerTensor()), tensors, feeds)
    _assert_same_states(observers, expected)


def _monotone_chain() -> onnx.ModelProto:
    """Every operation whose extremes are derived from its input's, chained, with a tensor in
    the middle that nobody observes, next to ops that are reduced in the graph."""
    nodes = [
        helper.make_node("Mul", ["x", "minus_two"], ["neg_scaled"], name="mul"),
        helper.make_node("Add", ["three", "neg_scaled"], ["shifted"], name="add"),
        helper.make_node("Div", ["shifted", "seven"], ["divided"], name="div"),
        helper.make_node("Sub", ["three", "divided"], ["flipped"], name="sub_from"),
        helper.make_node("Sub", ["flipped", "seven"], ["lowered"], name="sub"),
        helper.make_node("Relu", ["lowered"], ["unobserved"], name="relu"),
        helper.make_node("Clip", ["unobserved", "zero", "three"], ["clipped"], name="clip"),
        helper.make_node("Div", ["seven", "x"], ["reciprocal"], name="not_monotone"),
        helper.make_node("Mul", ["x", "x"], ["squared"], name="square"),
        helper.make_node("Mul", ["x", "zero"], ["zeroed"], name="times_zero"),
    ]
    constants = {
        "minus_two": np.array([-2.0], np.float32),
        "three": np.array(3.0, np.float32),
        "seven": np.array([[7.0]], np.float32),
        "zero": np.array(0.0, np.float32),
    }
    outputs = ["clipped", "reciprocal", "squared", "zeroed"]
    model = build_model(nodes, [float_input("x", ["N", 5])], outputs, constants)
    return onnx.shape_inference.infer_shapes(model)


OBSERVED = [
    "x",
    "neg_scaled",
    "shifted",
    "divided",
    "flipped",
    "lowered",
    "clipped",
    "reciprocal",
    "squared",
    "zeroed",
]


def test_derived_extremes_skip_the_reductions() -> None:
    model = _monotone_chain()
    rewritten, layout = add_min_max_outputs(model, dict.fromkeys(OBSERVED))
    derived = {r.value: r.observed for r in layout.derived}
    assert derived == {
        "neg_scaled": True,
        "shifted": True,
        "divided": True,
        "flipped": True,
        "lowered": True,
        "unobserved": False,
        "clipped": True,
    }
    reduced = {v for _, values in layout.stacks for v in values}
    assert reduced == {"x", "reciprocal", "squared", "zeroed"}
    reductions = [n for n in rewritten.graph.node if n.op_type.startswith("Reduce")]
    assert len(reductions) == 3 * len(reduced)


def test_derivations_on_arrays_equal_them_number_by_number() -> None:
    """All values of a layout at once give each rule's own float32 result, bit for bit."""
    model = _monotone_chain()
    _, layout = add_min_max_outputs(model, dict.fromkeys(OBSERVED))
    assert layout.derived  # chained rules of every kind, an unobserved one in the middle
    rng = np.random.default_rng(3)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38, 2.0, -5.0], np.float32)
    for _ in range(40):
        arrays = {}
        for name, covered in layout.stacks:
            stats = rng.choice(specials, (len(covered), 3)).astype(np.float32)
            stats[rng.random(len(covered)) < 0.2, :2] = [np.inf, -np.inf]  # empty
            arrays[name] = stats.reshape(-1)
        found = read_per_tensor(layout, arrays)
        expected: dict[str, tuple[np.float32, np.float32] | None] = {}
        for name, covered in layout.stacks:
            for value, (lo, hi, square) in zip(covered, arrays[name].reshape(-1, 3)):
                nan = np.float32(np.nan)
                expected[value] = None if lo > hi else (nan, nan) if np.isnan(square) else (lo, hi)
        for rule in layout.derived:
            source = expected[rule.source]
            if source is None:
                expected[rule.value] = None
                continue
            lo, hi = _apply_rule(rule, source[0]), _apply_rule(rule, source[1])
            expected[rule.value] = (hi, lo) if rule.decreasing else (lo, hi)
        assert found.values == tuple(v for v in expected if v in layout.axes)
        for value, lo, hi, empty in zip(found.values, found.lows, found.highs, found.empty):
            want = expected[value]
            assert empty == (want is None), value
            if want is not None:
                assert lo.tobytes() == want[0].tobytes() and hi.tobytes() == want[1].tobytes()


def _chain_batches(rng: np.random.Generator) -> list[Feed]:
    specials = [
        np.array([[0.0, -0.0, 1.0, -1.0, 0.5]], np.float32),
        np.array([[-0.0, -0.0, -0.0, -0.0, -0.0]], np.float32),
        np.array([[np.inf, 1.0, -2.0, 3.0, 0.0]], np.float32),
        np.array([[1.0, -np.inf, 2.0, 0.0, -0.0]], np.float32),
        np.zeros((0, 5), np.float32),
        np.array([[3e38, -3e38, 1.0, 2.0, 3.0]], np.float32),
    ]
    random = [rng.standard_normal((4, 5)).astype(np.float32) * 10 for _ in range(4)]
    return [{"x": x} for x in [*random[:2], *specials, *random[2:]]]


@pytest.mark.parametrize("kind", sorted(OBSERVERS))
def test_derived_and_reduced_extremes_equal_whole_tensors(kind: str) -> None:
    """Signed zeros, infinities, overflow and an empty batch, through every derivation."""
    model = _monotone_chain()
    feeds = _chain_batches(np.random.default_rng(0))
    policy = DataPolicy("ignore", "propagate", "propagate")

    def make(_: str) -> object:
        observer = OBSERVERS[kind](PerTensor())
        observer._policy = policy  # type: ignore[attr-defined]  # infinities reach the stats
        return observer

    observers = {t: make(t) for t in OBSERVED}
    collect(model, observers, ((f, len(f["x"])) for f in feeds))  # type: ignore[arg-type]
    _assert_same_states(observers, _whole_tensor_states(model, make, OBSERVED, feeds))


@pytest.mark.parametrize("position", [0, 1, 7, 8, 63, 64, 999])
def test_nan_anywhere_reaches_the_statistics(position: int) -> None:
    """onnxruntime's ReduceMin/ReduceMax drop a NaN unless it comes first; the statistics must
    not: with NaN propagated they are NaN, as numpy's min/max of the tensor are."""
    model = _monotone_chain()
    x = np.random.default_rng(position).standard_normal((200, 5)).astype(np.float32)
    x.reshape(-1)[position] = np.nan
    policy = DataPolicy("ignore", "propagate", "propagate")
    observers = {t: MinMaxObserver(PerTensor(), policy=policy) for t in OBSERVED}
    collect(model, observers, iter([({"x": x}, 200)]))
    expected = _whole_tensor_states(
        model, lambda t: MinMaxObserver(PerTensor(), policy=policy), OBSERVED, [{"x": x}]
    )
    _assert_same_states(observers, expected)
    assert np.isnan(observers["x"].state().min) and np.isnan(observers["clipped"].state().max)


def test_nan_is_refused_by_default() -> None:
    x = np.ones((64, 5), np.float32)
    x[40, 3] = np.nan
    observers = {t: MinMaxObserver(PerTensor()) for t in OBSERVED}
    with pytest.raises(DataError, match="NaN"):
        collect(_monotone_chain(), observers, iter([({"x": x}, 64)]))


def test_per_channel_in_graph_equals_whole_tensors() -> None:
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    weights = {"w": rng.standard_normal((6, 3, 3, 3)).astype(np.float32)}
    model = onnx.shape_inference.infer_shapes(
        build_model(nodes, [float_input("x", ["N", 3, 8, 8])], ["z"], weights)
    )
    feeds = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(5)]
    for kind in ("minmax", "moving-average"):
        for axis in (1, -3, 3):
            make = OBSERVERS[kind]
            observers = {t: make(PerChannel(axis)) for t in ("x", "y", "z")}
            collect(model, observers, ((f, 2) for f in feeds))  # type: ignore[arg-type]
            expected = _whole_tensor_states(
                model,
                lambda _, make=make, axis=axis: make(PerChannel(axis)),
                ["x", "y", "z"],
                feeds,
            )
            _assert_same_states(observers, expected)


def test_only_small_arrays_leave_onnxruntime() -> None:
    """With min-max observers, no observed tensor is a model output: memory is inference's."""
    model, tensors, _ = _sample_model("transformer_block")
    rewritten, layout = add_min_max_outputs(model, dict.fromkeys(tensors))
    outputs = {o.name for o in rewritten.graph.output} - {o.name for o in model.graph.output}
    assert outputs == {name for name, _ in layout.stacks}
    assert not outputs & set(tensors)


def _apply_rule(rule: Any, x: np.float32) -> np.float32:
    """A derivation rule on one float32 number, as onnxruntime's kernel rounds it (the
    one-number reference the vectorized reading is checked against)."""
    c = rule.constant
    result: Any
    with np.errstate(all="ignore"):  # inf/NaN extremes go through as in the kernels
        if rule.op_type == "Relu":
            result = np.maximum(x, np.float32(0.0))
        elif rule.op_type == "Clip":
            result = x if c is None else np.maximum(x, c)
            result = result if rule.upper is None else np.minimum(result, rule.upper)
        else:
            a, b = (c, x) if rule.constant_first else (x, c)
            if rule.op_type == "Add":
                result = a + b
            elif rule.op_type == "Sub":
                result = a - b
            elif rule.op_type == "Mul":
                result = a * b
            else:
                result = a / b
    return np.float32(result)
