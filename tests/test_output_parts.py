"""Outputs that concatenate separately computed parts are compared part by part: a detector's
class scores next to its box coordinates keep their own SQNR."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.output_parts import OutputPart, Part, measured_groups, output_parts
from qcal.accuracy.output_sums import OutputAccumulator

_W_BOX = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32) * 100
_W_CLS = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)


def _detector(box_gain: float, score_gain: float) -> onnx.ModelProto:
    """y = Concat(axis 1)[x @ W_box (coordinates, ~100), Sigmoid(x @ W_cls) (probabilities)]."""
    nodes = [
        helper.make_node("MatMul", ["x", "wb"], ["boxes"]),
        helper.make_node("MatMul", ["x", "wc"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["scores"]),
        helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None])],
        initializer=[onnx.numpy_helper.from_array(_W_BOX * np.float32(box_gain), "wb"),
                     onnx.numpy_helper.from_array(_W_CLS * np.float32(score_gain), "wc")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _boxes(parts: dict[str, tuple[OutputPart, ...]]) -> dict[str, list[Part]]:
    return {name: [p.box for p in found] for name, found in parts.items()}


def _sqnr(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return 10 * math.log10(float((x ** 2).sum()) / float(((x - y) ** 2).sum()))


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def test_a_detectors_scores_keep_their_own_sqnr_beside_its_boxes() -> None:
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(3)]
    float_model, other = _detector(1.0, 1.0), _detector(1.001, 2.0)
    out = compare_models(float_model, other, (({"x": d}, 4) for d in data)).outputs[0]
    x = np.concatenate([_outputs(float_model, d) for d in data])
    y = np.concatenate([_outputs(other, d) for d in data])
    whole, boxes, scores = _sqnr(x, y), _sqnr(x[:, :4], y[:, :4]), _sqnr(x[:, 4:], y[:, 4:])
    assert whole > 40 and scores < 20  # the whole output's energy hides the scores' error
    assert out.sqnr_db == pytest.approx(min(boxes, scores), rel=1e-9)
    assert out.sqnr_part == "[:, 4:7]"
    assert out.to_json()["sqnr_part"] == "[:, 4:7]"


def test_an_output_whose_worst_part_is_its_whole_names_no_part() -> None:
    """Parts alike in error: the whole output's SQNR is no better than its worst part's, and
    the figure is the whole's whenever no part is worse."""
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 4)).astype(np.float32)]
    out = compare_models(_detector(1.0, 1.0), _detector(1.0, 1.0),
                         (({"x": d}, 4) for d in data)).outputs[0]
    assert out.sqnr_db is None and out.sqnr_part is None


def test_parts_follow_concats_inside_concats_along_other_axes() -> None:
    """Concat(axis 0)[Concat(axis 1)[a (2x3), b (2x2)], c (1x5)]: three boxes of the output."""
    nodes = [helper.make_node("Concat", ["a", "b"], ["ab"], axis=1),
             helper.make_node("Concat", ["ab", "c"], ["y"], axis=-2)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 2]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _boxes(output_parts(model)) == {"y": [((0, 2), (0, 3)), ((0, 2), (3, 5)), ((2, 3), None)]}


def test_parts_are_found_behind_the_cast_of_a_float16_models_output() -> None:
    """A float16 model, which qcal computes in float32, ends in a Cast of what its Concat joins:
    a YOLOv5 export in float16 was measured whole, its scores unseen (10.8 dB) behind its
    coordinates (35.5 dB)."""
    nodes = [helper.make_node("Concat", ["a", "b"], ["ab"], axis=1),
             helper.make_node("Cast", ["ab"], ["y"], to=TensorProto.FLOAT16)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _boxes(output_parts(model)) == {"y": [(None, (0, 3)), (None, (3, 5))]}


def test_a_part_of_unknown_size_leaves_the_output_whole() -> None:
    """Where the parts meet is unknown when one's size along the axis is: no parts."""
    assert output_parts(_detector(1.0, 1.0)) == {
        "y": (OutputPart((None, (0, 4))), OutputPart((None, (4, 7)), probabilities=True))}
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["y"], axis=1)], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", "K"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert output_parts(model) == {}


def _concat_model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]],
                  output: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                     for k, v in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(np.array([1, -1, 5], np.int64), "flat")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_parts_along_the_last_axis_pass_a_reshape_of_the_other_axes() -> None:
    """YOLOv5's head: per scale, Concat(last axis)[xy, wh, conf] reshaped to [N, anchors, 5],
    the scales joined along the anchors: six boxes of the output."""
    nodes, scales = [], []
    for s, (h, w) in enumerate(((4, 4), (2, 2))):
        nodes += [helper.make_node("Concat", [f"xy{s}", f"wh{s}", f"conf{s}"], [f"cat{s}"],
                                   axis=-1),
                  helper.make_node("Reshape", [f"cat{s}", "flat"], [f"flat{s}"])]
        scales.append(f"flat{s}")
    nodes.append(helper.make_node("Concat", scales, ["y"], axis=1))
    inputs = {f"{k}{s}": [1, h, w, n] for s, (h, w) in enumerate(((4, 4), (2, 2)))
              for k, n in (("xy", 2), ("wh", 2), ("conf", 1))}
    parts = output_parts(_concat_model(nodes, inputs, "y"))
    assert _boxes(parts) == {"y": [(None, (0, 16), (0, 2)), (None, (0, 16), (2, 4)),
                                   (None, (0, 16), (4, 5)), (None, (16, 20), (0, 2)),
                                   (None, (16, 20), (2, 4)), (None, (16, 20), (4, 5))]}


def test_parts_of_one_kind_are_measured_together() -> None:
    """Two parts of like size (a detector's anchors at two scales): the output is measured
    whole, even where one part's error is the larger; a part 100x smaller is measured on its
    own."""
    model = _concat_model([helper.make_node("Concat", ["a", "b"], ["y"], axis=1)],
                          {"a": [1, 6], "b": [1, 4]}, "y")
    rng = np.random.default_rng(3)
    for size_b, whole in ((0.5, True), (0.01, False)):
        a = rng.standard_normal((1, 6)).astype(np.float32)
        b = (rng.standard_normal((1, 4)) * size_b).astype(np.float32)
        x = np.concatenate([a, b], axis=1)
        y = np.concatenate([a * np.float32(1.001), b * np.float32(1.1)], axis=1)
        accumulator = OutputAccumulator(parts=output_parts(model)["y"])
        accumulator.add(x, y, None)
        out = accumulator.metrics("y")
        assert out.sqnr_db == pytest.approx(_sqnr(x, y) if whole else _sqnr(x[:, 6:], y[:, 6:]),
                                            rel=1e-9)
        assert out.sqnr_part == (None if whole else "[:, 6:10]")


def test_yolox_heads_are_split_through_reshapes_concats_and_a_transpose() -> None:
    """YOLOX: per scale Concat(channels)[box (4), Sigmoid(objectness), Sigmoid(class)] as
    [1, 6, H, W], flattened to [1, 6, H*W], the scales joined along the positions and
    transposed to [1, positions, 6]: box, objectness and class of each scale, the last two
    probabilities."""
    nodes, scales, inputs = [], [], {}
    for s, (h, w) in enumerate(((4, 4), (2, 2))):
        inputs |= {f"box{s}": [1, 4, h, w], f"obj{s}": [1, 1, h, w], f"cls{s}": [1, 1, h, w]}
        nodes += [helper.make_node("Sigmoid", [f"obj{s}"], [f"pobj{s}"]),
                  helper.make_node("Sigmoid", [f"cls{s}"], [f"pcls{s}"]),
                  helper.make_node("Concat", [f"box{s}", f"pobj{s}", f"pcls{s}"], [f"cat{s}"],
                                   axis=1),
                  helper.make_node("Reshape", [f"cat{s}", "flat6"], [f"flat{s}"])]
        scales.append(f"flat{s}")
    nodes += [helper.make_node("Concat", scales, ["joined"], axis=2),
              helper.make_node("Transpose", ["joined"], ["y"], perm=[0, 2, 1])]
    model = _concat_model(nodes, inputs, "y")
    model.graph.initializer.append(
        onnx.numpy_helper.from_array(np.array([1, 6, -1], np.int64), "flat6"))
    parts = output_parts(model)["y"]
    assert [(p.box, p.probabilities) for p in parts] == [
        ((None, (0, 16), (0, 4)), False), ((None, (0, 16), (4, 5)), True),
        ((None, (0, 16), (5, 6)), True), ((None, (16, 20), (0, 4)), False),
        ((None, (16, 20), (4, 5)), True), ((None, (16, 20), (5, 6)), True)]


def test_probabilities_and_values_are_measured_apart() -> None:
    assert measured_groups([1.0, 0.5], [False, False]) == [[0, 1]]
    assert measured_groups([1.0, 0.5], [False, True]) == [[0], [1]]
    assert measured_groups([1.0, 0.5, 0.3], [True, False, True]) == [[1], [0, 2]]
    # probabilities together, whatever their sizes: a part of less is mostly background
    assert measured_groups([1.0, 1e-4, 0.5], [True, True, False]) == [[2], [0, 1]]
    assert measured_groups([1.0, 0.01], [False, False]) == [[0], [1]]  # 20 dB apart
    assert measured_groups([1.0, 0.1], [False, False]) == [[0, 1]]  # 10 dB apart


def test_an_output_of_another_rank_than_its_parts_is_measured_whole() -> None:
    """A model may declare an output's shape wrongly (a recognizer declared [1, T] computes
    [T, 1, classes]): parts found at one rank are not cut from another."""
    parts = (OutputPart((None, (0, 4))), OutputPart((None, (4, 6)), probabilities=True))
    accumulator = OutputAccumulator(parts=parts)
    x = np.random.default_rng(4).standard_normal((2, 3, 6)).astype(np.float32)
    y = x.copy()
    y[..., 4:] *= np.float32(1.5)
    accumulator.add(x, y, None)
    out = accumulator.metrics("y")
    assert out.sqnr_db == pytest.approx(_sqnr(x, y), rel=1e-9) and out.sqnr_part is None
