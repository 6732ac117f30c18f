"""A per-position output's sequences: each sample's positions read as a CTC decoder or a
tagger's segments read them, against an independent reading."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal._verdict import agreement_cell
from qcal.accuracy.decision_counts import argmax_ties, sequence_axis, sequences_read_alike
from qcal.accuracy.evaluate import compare_models


def _linear(weights: np.ndarray) -> onnx.ModelProto:
    """y = x @ weights over the last axis: per-position logits of whatever rank x has."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="linear")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(weights.astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _merged(labels: np.ndarray) -> list[int]:
    return [int(label) for label, _ in itertools.groupby(labels)]


def _expected(fx: np.ndarray, fy: np.ndarray) -> float:
    """Share of rows (samples) of two [samples, positions] label arrays that read alike."""
    return float(np.mean([_merged(a) == _merged(b) for a, b in zip(fx, fy)]))


@pytest.mark.parametrize("batch", [1, 3, 12])
def test_sequences_of_a_crnn_output_match_an_independent_reading_whatever_the_batch(
        batch: int) -> None:
    """[T, N, classes] logits (a CRNN's layout, the batch on axis 1): the share of samples whose
    merged argmax sequence is the same, as an independent reading gives it, for batches of 1,
    3 and 12 samples alike."""
    rng = np.random.default_rng(5)
    positions, samples, classes = 7, 12, 4
    x = rng.standard_normal((positions, samples, classes)).astype(np.float32)
    a = np.eye(classes) + 0.05 * rng.standard_normal((classes, classes))
    b = a + 0.35 * rng.standard_normal((classes, classes))
    fx = np.argmax(x.astype(np.float64) @ a.astype(np.float32), -1).T  # [samples, positions]
    fy = np.argmax(x.astype(np.float64) @ b.astype(np.float32), -1).T
    expected = _expected(fx, fy)
    assert 0.0 < expected < 1.0
    batches = [({"x": x[:, i : i + batch]}, batch) for i in range(0, samples, batch)]
    out = compare_models(_linear(a), _linear(b), batches).outputs[0]
    assert out.sequence_agreement == pytest.approx(expected)
    assert out.to_json()["sequence_agreement"] == pytest.approx(expected)
    assert out.top1_agreement == pytest.approx(float(np.mean(fx == fy)))


def test_sequences_batch_first_are_read_along_the_first_axis() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 5, 3)).astype(np.float32)  # [N, T, classes]
    a = np.eye(3)
    b = a + 0.4 * rng.standard_normal((3, 3))
    fx = np.argmax(x.astype(np.float64) @ a.astype(np.float32), -1)
    fy = np.argmax(x.astype(np.float64) @ b.astype(np.float32), -1)
    out = compare_models(_linear(a), _linear(b), [({"x": x[:4]}, 4), ({"x": x[4:]}, 4)])
    assert out.outputs[0].sequence_agreement == pytest.approx(_expected(fx, fy))


def test_a_moved_boundary_reads_alike_and_a_new_label_does_not() -> None:
    """One sample per column: the float reading a a - b b; a boundary moved by a position
    (a - - b b) reads alike, an extra label (a c - b b) and a lost one (a a a b b, the blank
    between them gone) do not."""
    def logits(*rows: list[int]) -> np.ndarray:
        labels = np.array(rows).T  # [positions, samples]
        return np.eye(4, dtype=np.float32)[labels]

    blank, a, b, c = 0, 1, 2, 3
    float_reading = [a, a, blank, b, b]
    x = logits(float_reading, float_reading, float_reading, float_reading)
    y = logits(float_reading, [a, blank, blank, b, b], [a, c, blank, b, b], [a, a, a, b, b])
    alike, read = sequences_read_alike(argmax_ties(x, y), axis=1)
    assert (alike, read) == (2, 4)


def test_near_ties_of_the_float_model_read_alike() -> None:
    x = np.array([[[1.0, 1.0 - 1e-7, 0.0]], [[0.0, 0.0, 1.0]]], np.float32)  # [T=2, N=1, 3]
    y = np.array([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]], np.float32)
    assert sequences_read_alike(argmax_ties(x, y), axis=1) == (1, 1)


@pytest.mark.parametrize(("shape", "samples", "known", "axis"), [
    ((6, 4, 5), 4, None, 1), ((4, 6, 5), 4, None, 0), ((4, 4, 5), 4, None, 0),
    ((4, 4, 5), 4, 1, 1), ((6, 6, 5), 4, None, None), ((4, 5), 4, None, None),
    ((2, 4, 6, 5), 4, None, None)])
def test_the_batch_axis_of_a_sequence_output(shape: tuple[int, ...], samples: int,
                                             known: int | None, axis: int | None) -> None:
    """The axis of the first two whose size is the batch's; as many positions as samples: the
    axis an earlier batch showed, else the first; none, or another rank: no sequences."""
    assert sequence_axis(shape, samples, known) == axis


def test_outputs_without_sequences_have_no_sequence_figure() -> None:
    """A classifier's [N, classes] scores, and a per-position output whose batch no axis shows
    (positions and samples folded together) have none."""
    rng = np.random.default_rng(7)
    x2 = rng.standard_normal((6, 4)).astype(np.float32)
    a, b = np.eye(4), np.eye(4) + 0.3 * rng.standard_normal((4, 4))
    classifier = compare_models(_linear(a), _linear(b), [({"x": x2}, 6)]).outputs[0]
    assert classifier.top1_agreement is not None and classifier.sequence_agreement is None
    x3 = rng.standard_normal((5, 3, 4)).astype(np.float32)
    folded = compare_models(_linear(a), _linear(b), [({"x": x3}, 2)]).outputs[0]
    assert folded.top1_agreement is not None and folded.sequence_agreement is None


def test_the_summary_shows_sequences_beside_the_decisions() -> None:
    output = {"top1_agreement": 0.99375, "sequence_agreement": 0.9375, "yes_f1": None}
    assert agreement_cell(output) == "99.37% (93.75% of sequences)"
    assert agreement_cell({**output, "sequence_agreement": None}) == "99.37%"


def test_a_batch_of_as_many_samples_as_positions_is_read_as_the_earlier_batches_showed() -> None:
    """[T=4, N, classes] fed 3 then 4 samples: the second batch's two axes are both 4 long, and
    it is read along the batch axis the first one showed (axis 1), as an independent reading
    of the 7 samples says."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 7, 3)).astype(np.float32)
    a = np.eye(3)
    b = a + 0.4 * rng.standard_normal((3, 3))
    fx = np.argmax(x.astype(np.float64) @ a.astype(np.float32), -1).T
    fy = np.argmax(x.astype(np.float64) @ b.astype(np.float32), -1).T
    expected = _expected(fx, fy)
    by_rows = _expected(np.argmax(x[:, 3:].astype(np.float64) @ a.astype(np.float32), -1),
                        np.argmax(x[:, 3:].astype(np.float64) @ b.astype(np.float32), -1))
    assert by_rows * 4 + _expected(fx[:3], fy[:3]) * 3 != pytest.approx(expected * 7)
    out = compare_models(_linear(a), _linear(b), [({"x": x[:, :3]}, 3), ({"x": x[:, 3:]}, 4)])
    assert out.outputs[0].sequence_agreement == pytest.approx(expected)
