"""The yes decisions of probabilities (a sigmoid's map, a detector's class-score parts): their F1
against independent counts, and the accuracy floor holding them where the element agreement
cannot see them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal.accuracy.coverage import Coverage
from qcal.accuracy.evaluate import MIN_YES_DECISIONS, compare_models
from qcal.accuracy.gates import Gates, check_gates
from qcal.config import DEFAULT_FLOOR_YES_F1, CalibrationConfig


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], output: str,
           initializers: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
                              initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _shifted_map(shift: float, *, transpose: bool = False) -> onnx.ModelProto:
    """p = Sigmoid(x + shift) over x [N, 6, 40], transposed to [N, 40, 6] (anchors x classes,
    as paddle2onnx's PicoDet writes its scores) when asked."""
    nodes = [helper.make_node("Add", ["x", "shift"], ["t"], name="shift"),
             helper.make_node("Sigmoid", ["t"], ["s"], name="sigmoid")]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["s"], ["p"], name="to_anchors",
                                      perm=[0, 2, 1]))
    else:
        nodes.append(helper.make_node("Identity", ["s"], ["p"], name="same"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 40])],
                  "p", [onnx.numpy_helper.from_array(np.float32(shift), "shift")])


def _sparse_logits(samples: int, seed: int = 5) -> np.ndarray:
    """A detector's map: 2 % of cells positive with logits spread over (0, 3), the rest at -6."""
    rng = np.random.default_rng(seed)
    positive = rng.random((samples, 6, 40)) < 0.02
    x = np.where(positive, rng.uniform(0.0, 3.0, positive.shape), -6.0)
    return x.astype(np.float32)


def _expected_f1(x: np.ndarray, shift: float) -> float:
    sigmoid = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    shifted = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) + shift)))
    a, b = sigmoid > 0.5, shifted > 0.5
    return 2.0 * np.count_nonzero(a & b) / (np.count_nonzero(a) + np.count_nonzero(b))


@pytest.mark.parametrize("transpose", [False, True])
def test_the_f1_of_a_sparse_maps_yes_decisions_fails_the_floor_its_agreement_passes(
        transpose: bool) -> None:
    """A shift of -0.3 on the logits turns the weakest tenth of the positives off: 99.8 % of
    the elements still agree and the probabilities keep 20 dB, but the yes decisions a detector
    reads keep an F1 of about 0.95, as a numpy threshold counts it. The floor fails on it, and
    holds for a shift that flips a hundredth of them. A transposed sigmoid's map is read alike."""
    x = _sparse_logits(100)
    comparison = compare_models(_shifted_map(0.0, transpose=transpose),
                                _shifted_map(-0.3, transpose=transpose), [({"x": x}, 100)])
    out = comparison.outputs[0]
    assert out.decisions == "threshold"
    assert out.top1_agreement is not None and out.top1_agreement > 0.99
    assert out.sqnr_db is not None and out.sqnr_db > 14.0
    expected = _expected_f1(x, -0.3)
    assert 0.9 < expected < DEFAULT_FLOOR_YES_F1
    assert out.yes_f1 == pytest.approx(expected, rel=1e-9)
    floor = CalibrationConfig().accuracy_target()
    assert not floor.is_met(comparison)
    assert floor.shortfall(comparison) == pytest.approx(DEFAULT_FLOOR_YES_F1 - expected, abs=1e-6)
    assert "F1 >= 0.97 of the yes decisions (probabilities above 0.5" in floor.describe(comparison)
    # the floor's failed gate names the figure that missed
    coverage = Coverage(basis="nodes", compute_nodes=1, quantized_nodes=1, macs_total=None,
                        macs_quantized=None, note=None)
    [gate] = check_gates(Gates(fallback_target=("accuracy-floor", 0.0)), comparison, coverage,
                         fallback_reached=False)
    assert f"F1 {np.floor(expected * 1000) / 1000:.3f} of the yes decisions" in gate.measure
    small = compare_models(_shifted_map(0.0, transpose=transpose),
                           _shifted_map(-0.03, transpose=transpose), [({"x": x}, 100)])
    assert small.outputs[0].yes_f1 == pytest.approx(_expected_f1(x, -0.03), rel=1e-9)
    assert small.outputs[0].yes_f1 >= DEFAULT_FLOOR_YES_F1 and floor.is_met(small)


def test_too_few_yes_decisions_are_not_judged() -> None:
    """With fewer than MIN_YES_DECISIONS cells the float model calls yes, one cell is more than
    2 % of the F1: there is none, and the floor reads the map by its SQNR and agreement."""
    x = _sparse_logits(100)
    few = x[:4]
    assert 0 < np.count_nonzero(few > 0) < MIN_YES_DECISIONS <= np.count_nonzero(x > 0)
    comparison = compare_models(_shifted_map(0.0), _shifted_map(-0.3), [({"x": few}, 4)])
    out = comparison.outputs[0]
    assert out.decisions == "threshold" and out.yes_f1 is None
    # the fallback's message names no F1 it did not hold the model to
    assert "F1" not in CalibrationConfig().accuracy_target().describe(comparison)


def test_a_transposed_linear_layers_scores_are_not_read_by_an_argmax() -> None:
    """A Transpose keeps each element's yes/no but moves the axis an argmax reads: a linear
    layer's logits transposed hold no decisions."""
    weight = onnx.numpy_helper.from_array(np.eye(5, dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"], name="linear"),
             helper.make_node("Transpose", ["logits"], ["y"], name="t", perm=[0, 2, 1])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 5])],
                   "y", [weight])
    x = np.random.default_rng(0).standard_normal((4, 3, 5)).astype(np.float32)
    out = compare_models(model, model, [({"x": x}, 4)]).outputs[0]
    assert out.decisions is None and out.top1_agreement is None and out.yes_f1 is None


def test_a_concatenated_outputs_probability_part_is_counted_alone() -> None:
    """YOLOv8's [N, 4 + classes, anchors]: the box coordinates (in pixels, far above 0.5) are
    values; only the class probabilities' yes decisions are counted."""
    nodes = [helper.make_node("Add", ["s", "shift"], ["t"], name="shift"),
             helper.make_node("Sigmoid", ["t"], ["probs"], name="sigmoid"),
             helper.make_node("Concat", ["boxes", "probs"], ["out"], name="join", axis=1)]
    inputs = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4, 40]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 6, 40])]

    def model(shift: float) -> onnx.ModelProto:
        return _model(nodes, inputs, "out",
                      [onnx.numpy_helper.from_array(np.float32(shift), "shift")])

    x = _sparse_logits(100, seed=9)
    boxes = np.random.default_rng(1).uniform(10.0, 300.0, (100, 4, 40)).astype(np.float32)
    feeds = [({"boxes": boxes[i:i + 1], "s": x[i:i + 1]}, 1) for i in range(100)]
    out = compare_models(model(0.0), model(-0.3), feeds).outputs[0]
    assert out.yes_f1 == pytest.approx(_expected_f1(x, -0.3), rel=1e-9)


def _anchor_softmax(shift: float) -> onnx.ModelProto:
    """Softmax over [background, face] logits of [N, anchors, 2], the face logit shifted."""
    nodes = [helper.make_node("Add", ["x", "shift"], ["t"], name="shift"),
             helper.make_node("Softmax", ["t"], ["scores"], name="softmax", axis=-1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 240, 2])],
                  "scores", [onnx.numpy_helper.from_array(np.array([0.0, shift], np.float32),
                                                           "shift")])


def test_a_per_position_argmax_mostly_background_is_judged_by_its_other_decisions() -> None:
    """A face detector's anchors, 2 % of them faces: a shift turning the weakest tenth of the
    faces into background keeps 99.8 % of the anchors' argmax alike, and an F1 of about 0.95
    on the faces, as numpy counts it; the floor fails on that F1 as on a sigmoid's map's."""
    rng = np.random.default_rng(7)
    face = rng.random((100, 240)) < 0.02
    x = np.zeros((100, 240, 2), np.float32)
    x[..., 1] = np.where(face, rng.uniform(0.0, 3.0, face.shape), -6.0)
    comparison = compare_models(_anchor_softmax(0.0), _anchor_softmax(-0.3), [({"x": x}, 100)])
    out = comparison.outputs[0]
    assert out.decisions == "argmax" and out.top1_agreement is not None
    assert out.top1_agreement > 0.99
    a, b = x[..., 1] > 0.0, x[..., 1] - 0.3 > 0.0
    expected = 2.0 * np.count_nonzero(a & b) / (np.count_nonzero(a) + np.count_nonzero(b))
    assert 0.9 < expected < DEFAULT_FLOOR_YES_F1
    assert out.yes_f1 == pytest.approx(expected, rel=1e-9)
    assert not CalibrationConfig().accuracy_target().is_met(comparison)
    # no class holding most positions (a tagger's frames of every class alike): no such F1
    even = rng.standard_normal((100, 240, 2)).astype(np.float32)
    mixed = compare_models(_anchor_softmax(0.0), _anchor_softmax(-0.3), [({"x": even}, 100)])
    assert mixed.outputs[0].decisions == "argmax" and mixed.outputs[0].yes_f1 is None
