"""An output of one row per sample is also measured against how its rows vary between samples
(`variation_sqnr_db`), and the floor holds per-sample scores to it: a regression head's ratings
sit on an offset that flatters their SQNR, and their argmax (always the same rating) agrees
however scrambled they are."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal._verdict import quality_verdict
from qcal.accuracy.evaluate import compare_models
from qcal.config import CalibrationConfig


def _head(slope: float, *, offset: tuple[float, ...] = (3.0, 2.0, 2.2),
          shape: list[str | int] | None = None) -> onnx.ModelProto:
    """y = x @ (W * slope) + offset: three ratings from a linear layer, varying with x."""
    w = np.linspace(-0.3, 0.3, 4 * len(offset), dtype=np.float32).reshape(4, len(offset))
    w = w * np.float32(slope)
    shape = shape or ["N", 4]
    out_shape = [*shape[:-1], len(offset)]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="linear"),
         helper.make_node("Add", ["h", "b"], ["y"], name="bias")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        initializer=[onnx.numpy_helper.from_array(w, "w"),
                     onnx.numpy_helper.from_array(np.asarray(offset, np.float32), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _expected(x: np.ndarray, slope: float) -> tuple[float, float]:
    """Independently: (SQNR, SQNR against the rows' variation) of `_head(slope)` vs `_head(1)`."""
    w = np.linspace(-0.3, 0.3, 12, dtype=np.float32).reshape(4, 3)
    b = np.array([3.0, 2.0, 2.2], np.float32).astype(np.float64)
    f = x.astype(np.float64) @ w.astype(np.float64) + b
    q = x.astype(np.float64) @ (w * np.float32(slope)).astype(np.float64) + b
    noise = np.sum((f - q) ** 2)
    variation = np.sum((f - f.mean(axis=0)) ** 2)
    return 10 * math.log10(np.sum(f * f) / noise), 10 * math.log10(variation / noise)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_variation_sqnr_is_the_error_against_the_rows_around_their_mean(batch: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    batches = [({"x": x[i:i + batch]}, batch) for i in range(0, 16, batch)]
    out = compare_models(_head(1.0), _head(0.5), batches).outputs[0]
    sqnr, variation = _expected(x, 0.5)
    assert out.sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert out.variation_sqnr_db == pytest.approx(variation, abs=1e-3)
    assert out.sqnr_db > 14 > out.variation_sqnr_db  # the offset flatters it past the floor
    assert out.floor_sqnr_db == out.variation_sqnr_db
    # the ratings' argmax is the first everywhere: the decisions agree, saying nothing
    assert out.decisions == "argmax" and out.top1_agreement == 1.0


def test_the_floor_holds_per_sample_scores_to_their_variation() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    floor = CalibrationConfig().accuracy_target()
    scrambled = compare_models(_head(1.0), _head(0.5), [({"x": x}, 16)])
    assert not floor.is_met(scrambled)
    assert floor.describe().startswith("SQNR of values, sigmoid maps and per-sample scores >= 14")
    close = compare_models(_head(1.0), _head(0.97), [({"x": x}, 16)])
    assert close.outputs[0].variation_sqnr_db > 14 and floor.is_met(close)
    # a user's --target-sqnr holds each output's SQNR as documented
    target = CalibrationConfig(target_sqnr=20.0).accuracy_target()
    assert target.is_met(scrambled)


def test_the_verdict_names_the_variation_it_measured_against() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    out = compare_models(_head(1.0), _head(0.8), [({"x": x}, 16)]).outputs[0]
    report = {"evaluation": {"outputs": [out.to_json()]}, "gates": [],
              "config": {"fallback": True, "weight_only": None, "target_sqnr": None,
                         "max_agreement_drop": None, "min_coverage": 70.0}}
    verdict = quality_verdict(report)
    assert verdict is not None
    shown = math.floor(out.variation_sqnr_db * 10 + 1e-9) / 10
    assert f"worst SQNR {shown:.1f} dB on y, against its variation between samples" in verdict.text


@pytest.mark.parametrize("case", ["positions", "few", "constant", "integer"])
def test_no_variation_figure_where_there_are_no_rows_to_vary(case: str) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    if case == "positions":  # [N, T, 3]: positions, not one row per sample
        model_f, model_q = (_head(s, shape=["N", "T", 4]) for s in (1.0, 0.5))
        batches = [({"x": x.reshape(4, 4, 4)}, 4)]
    elif case == "few":  # fewer than MIN_ROWS samples
        model_f, model_q = _head(1.0), _head(0.5)
        batches = [({"x": x[:3]}, 3)]
    elif case == "constant":  # rows that do not vary between samples
        model_f, model_q = _head(1.0), _head(0.5)
        batches = [({"x": np.zeros_like(x) + 1.0}, 16)]
    else:  # labels: agreement by equality, no SQNR
        model_f, model_q = _argmax_model(), _argmax_model()
        batches = [({"x": x}, 16)]
    out = compare_models(model_f, model_q, batches).outputs[0]
    assert out.variation_sqnr_db is None
    assert out.floor_sqnr_db == out.sqnr_db


def _argmax_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ArgMax", ["x"], ["y"], name="argmax", axis=1, keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["N"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_score_per_sample_and_a_scalar_per_run_are_rows_too() -> None:
    """[N] (one rating per sample) and a scalar output of a batch of one."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    for keepdims, batch in ((1, 4), (0, 1)):  # [N, 1] -> [N]... and a scalar for one sample
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="linear"),
                 helper.make_node("Add", ["h", "b"], ["r"], name="bias"),
                 helper.make_node("ReduceSum", ["r"], ["y"], name="sum", keepdims=0)
                 if not keepdims else
                 helper.make_node("Squeeze", ["r", "axis"], ["y"], name="squeeze")]

        def model(slope: float, nodes: list[onnx.NodeProto] = nodes) -> onnx.ModelProto:
            w = np.array([[0.2], [-0.1], [0.3], [0.1]], np.float32) * slope
            graph = helper.make_graph(
                nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                initializer=[onnx.numpy_helper.from_array(w, "w"),
                             onnx.numpy_helper.from_array(np.array([4.0], np.float32), "b"),
                             onnx.numpy_helper.from_array(np.array([1], np.int64), "axis")])
            return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                     ir_version=8)

        batches = [({"x": x[i:i + batch]}, batch) for i in range(0, 16, batch)]
        out = compare_models(model(1.0), model(0.5), batches).outputs[0]
        f = x.astype(np.float64) @ np.array([0.2, -0.1, 0.3, 0.1]) + 4.0
        q = x.astype(np.float64) @ (np.array([0.2, -0.1, 0.3, 0.1]) * 0.5) + 4.0
        expected = 10 * math.log10(np.sum((f - f.mean()) ** 2) / np.sum((f - q) ** 2))
        assert out.variation_sqnr_db == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(("agree", "count"), [(16, 16), (319, 320), (49, 50), (9900, 10000)])
def test_the_agreement_bound_is_the_wilson_score_bound(agree: int, count: int) -> None:
    from qcal.accuracy.target import agreement_lower_bound

    z = 1.6448536  # one-sided 95 %
    p = agree / count
    # the bound's other algebraic form: (2np + z² − z·√(z² + 4np(1 − p))) / (2(n + z²))
    expected = ((2 * count * p + z * z - z * math.sqrt(z * z + 4 * count * p * (1 - p)))
                / (2 * (count + z * z)))
    assert agreement_lower_bound(p, count) == pytest.approx(expected, rel=1e-9)
    assert agreement_lower_bound(p, count) < p


def test_the_verdict_says_how_little_a_few_decisions_show() -> None:
    """All of 16 held-out samples agreeing shows at 95 % confidence only that 85.5 % do."""
    rng = np.random.default_rng(8)
    few = rng.standard_normal((16, 4)).astype(np.float32)
    many = rng.standard_normal((400, 4)).astype(np.float32)
    said = {}
    for name, x, given in (("few", few, None), ("many", many, None), ("given", few, "e.npz")):
        out = compare_models(_head(1.0, offset=(0.0, 0.0, 0.0)), _head(1.0, offset=(0.0, 0.0, 0.0)),
                             [({"x": x}, len(x))]).outputs[0]
        assert out.decisions == "argmax" and out.decision_count == len(x)
        report = {"evaluation": {"outputs": [out.to_json()]}, "gates": [],
                  "config": {"fallback": True, "weight_only": None, "target_sqnr": None,
                             "max_agreement_drop": None, "min_coverage": 70.0,
                             "eval_data": given}}
        verdict = quality_verdict(report)
        assert verdict is not None
        said[name] = verdict.text
    assert "of 16 decisions, which show at 95 % confidence only that at least 85.5 % agree; " \
        "more evaluation samples, --eval-data, show more" in said["few"]
    assert "confidence" not in said["many"]  # 400 of 400 show 99.3 %, 268 of 268 99.0 %
    # the user's own evaluation data: no advice to give what was given
    assert "agree; more evaluation samples show more" in said["given"]


@pytest.mark.parametrize("op", ["Softmax", "Sigmoid"])
def test_probabilities_are_held_by_their_level_not_their_variation(op: str) -> None:
    """A confident classifier's probabilities sit near 1 for every held-out sample of its one
    class (a spam filter's held-out mail all ham): their level is what is read, and an error
    small against it is no error, however little they vary between samples."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((16, 4)) * 0.5).astype(np.float32)
    offset = (5.0, 0.0, 0.0) if op == "Softmax" else (5.0, -5.0, 5.0)  # every sigmoid decided

    def model(slope: float) -> onnx.ModelProto:
        head = _head(slope, offset=offset)
        head.graph.node[-1].output[0] = "scores"
        head.graph.node.append(helper.make_node(op, ["scores"], ["y"], name="probabilities"))
        return head

    out = compare_models(model(1.0), model(1.3), [({"x": x}, 16)]).outputs[0]
    assert out.decisions is not None and out.variation_sqnr_db is None
    assert CalibrationConfig().accuracy_target().is_met(
        compare_models(model(1.0), model(1.3), [({"x": x}, 16)]))
    # the same scores before the probabilities vary too little for that error
    scores = compare_models(_head(1.0, offset=offset), _head(1.3, offset=offset),
                            [({"x": x}, 16)]).outputs[0]
    assert scores.variation_sqnr_db is not None and scores.variation_sqnr_db < 14


def _log_spectrum(slope: float) -> onnx.ModelProto:
    """y = x * slope + 55, [N, 2, 8]: values of any rank on an offset (a log-mel front end's
    decibels around 55), no decisions."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["h"], name="scale"),
         helper.make_node("Add", ["h", "b"], ["y"], name="offset")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8])],
        initializer=[onnx.numpy_helper.from_array(np.array(slope, np.float32), "s"),
                     onnx.numpy_helper.from_array(np.array(55.0, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("batch", [1, 8])
def test_values_of_any_rank_are_held_to_their_variation(batch: int) -> None:
    """A wake-word model's log-mel front end read 14.8 dB against its decibels' energy and
    passed the floor, at 6.7 dB against how they vary (its embeddings at a cosine of 0.957):
    only outputs [N] and [N, k] were measured so."""
    rng = np.random.default_rng(9)
    x = 10 * rng.standard_normal((16, 2, 8)).astype(np.float32)
    batches = [({"x": x[i:i + batch]}, batch) for i in range(0, 16, batch)]
    out = compare_models(_log_spectrum(1.0), _log_spectrum(0.7), batches).outputs[0]
    f = x.astype(np.float64) + 55.0
    q = x.astype(np.float64) * np.float32(0.7) + 55.0
    noise = np.sum((f - q) ** 2)
    assert out.decisions is None
    assert out.sqnr_db == pytest.approx(10 * math.log10(np.sum(f * f) / noise), abs=1e-3)
    assert out.variation_sqnr_db == pytest.approx(
        10 * math.log10(np.sum((f - f.mean(axis=0)) ** 2) / noise), abs=1e-3)
    assert out.sqnr_db > 14 > out.variation_sqnr_db
    assert not CalibrationConfig().accuracy_target().is_met(
        compare_models(_log_spectrum(1.0), _log_spectrum(0.7), batches))


def _scaled(slope: float) -> onnx.ModelProto:
    """y = x * slope + 5: a map of values on an offset, of the input's size."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["h"], name="scale"),
         helper.make_node("Add", ["h", "b"], ["y"], name="offset")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "W"])],
        initializer=[onnx.numpy_helper.from_array(np.array(slope, np.float32), "s"),
                     onnx.numpy_helper.from_array(np.array(5.0, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_maps_of_several_sizes_are_measured_against_their_values_around_their_mean() -> None:
    """Images of several sizes give rows of several widths, with no mean row: their variation
    is then around the mean of all their values, not their whole energy (a depth model read
    36.1 dB so, against 26.4 dB on images of one size)."""
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((1, width)).astype(np.float32) for width in (30, 40, 30, 50, 20)]
    out = compare_models(_scaled(1.0), _scaled(0.9), [({"x": x}, 1) for x in xs]).outputs[0]
    f = np.concatenate([x.ravel().astype(np.float64) + 5.0 for x in xs])
    q = np.concatenate([x.ravel().astype(np.float64) * np.float32(0.9) + 5.0 for x in xs])
    noise = np.sum((f - q) ** 2)
    assert out.sqnr_db == pytest.approx(10 * math.log10(np.sum(f * f) / noise), abs=1e-3)
    assert out.variation_sqnr_db == pytest.approx(
        10 * math.log10(np.sum((f - f.mean()) ** 2) / noise), abs=1e-3)
    assert out.sqnr_db > out.variation_sqnr_db + 10  # the offset no longer flatters it
