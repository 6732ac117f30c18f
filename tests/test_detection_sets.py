"""Outputs that are sets of detections (the boxes a NonMaxSuppression kept, with their scores and
labels) are compared as sets, by the F1 of the detections matched by IoU and label: two
detections that swap rows, or one dropped near the score threshold, do not spoil every row
after them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.detection_sets import count_matches
from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.output_metrics import floor_sqnr_applies
from qcal.graph.detections import detection_sets

ANCHORS = 64


def _detector(logit_shift: dict[int, float], *, in_branch: bool = False,
              columns: str | None = None) -> onnx.ModelProto:
    """x [1, 64, 5]: per anchor a box (x1, y1, x2, y2) and a score's logit; the boxes and the
    sigmoid scores go through NonMaxSuppression (IoU 0.5, score 0.5, at most 20), and the kept
    boxes, scores and labels (the class of each, from the selection) are the outputs. The
    logits of `logit_shift`'s anchors are shifted, as quantization error would. With
    `columns`, one output [1, K, 6] of rows (x1, y1, x2, y2, score, and `columns`: "class",
    the class, or "area", a figure of a box's size where the class would be), as ultralytics writes it."""
    shift = np.zeros((1, 1, ANCHORS), np.float32)
    for anchor, value in logit_shift.items():
        shift[0, 0, anchor] = value
    consts = {"starts_b": [0], "ends_b": [4], "starts_s": [4], "ends_s": [5], "axis2": [2],
              "max_out": [20], "col1": [1], "col2": [2], "flat": [ANCHORS], "flat4": [ANCHORS, 4]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(shift, "shift"),
              numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
              numpy_helper.from_array(np.array([0.5], np.float32), "score_min")]
    make = helper.make_node
    nms = make("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_min"],
               ["selected"], name="nms")
    nodes = [
        make("Slice", ["x", "starts_b", "ends_b", "axis2"], ["boxes"], name="box_slice"),
        make("Slice", ["x", "starts_s", "ends_s", "axis2"], ["logit"], name="logit_slice"),
        make("Transpose", ["logit"], ["logit_t"], name="t", perm=[0, 2, 1]),
        make("Add", ["logit_t", "shift"], ["shifted"], name="shift_add"),
        make("Sigmoid", ["shifted"], ["scores"], name="sigmoid"),
    ]
    if in_branch:  # as torchvision exports it: the NMS inside an If
        branch = helper.make_graph([nms], "then", [], [helper.make_tensor_value_info(
            "selected", TensorProto.INT64, None)])
        other = helper.make_graph(
            [make("Constant", [], ["none"], value=numpy_helper.from_array(
                np.zeros((0, 3), np.int64)))], "else", [],
            [helper.make_tensor_value_info("none", TensorProto.INT64, None)])
        inits.append(numpy_helper.from_array(np.array(True), "always"))
        nodes.append(make("If", ["always"], ["picked"], name="if", then_branch=branch,
                          else_branch=other))
    else:
        nodes.append(nms)
    picked = "picked" if in_branch else "selected"
    nodes += [
        make("Gather", [picked, "col2"], ["index2"], name="g_index", axis=1),
        make("Flatten", ["index2"], ["index_flat"], name="fl", axis=0),
        make("Squeeze", ["index_flat"], ["index"], name="sq"),
        make("Reshape", ["boxes", "flat4"], ["all_boxes"], name="r_boxes"),
        make("Reshape", ["scores", "flat"], ["all_scores"], name="r_scores"),
        make("Gather", ["all_boxes", "index"], ["kept_boxes"], name="g_boxes", axis=0),
        make("Gather", ["all_scores", "index"], ["kept_scores"], name="g_scores", axis=0),
        make("Gather", [picked, "col1"], ["class2"], name="g_class", axis=1),
        make("Flatten", ["class2"], ["class_flat"], name="fl2", axis=0),
        make("Squeeze", ["class_flat"], ["kept_labels"], name="sq2"),
    ]
    outputs = [helper.make_tensor_value_info("kept_boxes", TensorProto.FLOAT, ["K", 4]),
               helper.make_tensor_value_info("kept_scores", TensorProto.FLOAT, ["K"]),
               helper.make_tensor_value_info("kept_labels", TensorProto.INT64, ["K"])]
    if columns is not None:
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
        inits.append(numpy_helper.from_array(np.array(3.0, np.float32), "three"))
        last = "class_f" if columns == "class" else "area"
        nodes += [
            make("Cast", ["kept_labels"], ["class_f"], name="cast", to=TensorProto.FLOAT),
            make("ReduceSum", ["kept_boxes", "one"], ["corners"], name="sum", keepdims=0),
            make("Div", ["corners", "three"], ["area"], name="area"),
            make("Unsqueeze", ["kept_scores", "one"], ["score_col"], name="u1"),
            make("Unsqueeze", [last, "one"], ["last_col"], name="u2"),
            make("Concat", ["kept_boxes", "score_col", "last_col"], ["rows"], name="cat", axis=1),
            make("Unsqueeze", ["rows", "col2"], ["rows_b"], name="u3"),
        ]
        nodes[-1].input[1] = "zero"
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero"))
        outputs = [helper.make_tensor_value_info("rows_b", TensorProto.FLOAT, [1, "K", 6])]
    graph = helper.make_graph(
        nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [1, ANCHORS, 5])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _anchors() -> np.ndarray:
    """Ten boxes apart from each other with scores above 0.5: anchors 3 and 4 at logits 2.0 and
    2.01 (their order swaps with a shift of -0.02), anchor 7 at 0.01 (score 0.5025, dropped by a
    shift of -0.05); the rest below the threshold."""
    x = np.zeros((1, ANCHORS, 5), np.float32)
    for a in range(ANCHORS):
        x[0, a, :4] = [20 * a, 0, 20 * a + 10, 10]
        x[0, a, 4] = -3.0
    for a, logit in enumerate([1.0, 1.5, 2.5, 2.0, 2.01, 3.0, 1.2, 0.01, 1.7, 2.2]):
        x[0, a, 4] = logit
    return x


@pytest.mark.parametrize("in_branch", [False, True])
def test_the_outputs_of_a_selection_are_found_by_data_flow(in_branch: bool) -> None:
    (found,) = detection_sets(_detector({}, in_branch=in_branch))
    assert found.boxes == "kept_boxes" and found.others == ("kept_scores", "kept_labels")


@pytest.mark.parametrize(("shift", "f1"), [
    ({4: -0.02}, 1.0),           # two detections swap rows: the same set
    ({7: -0.05}, 2 * 9 / 19),    # one dropped near the threshold: 9 of 10 and 9 matched
    ({4: -0.02, 7: -0.05}, 2 * 9 / 19),
])
def test_detections_are_compared_as_sets(shift: dict[int, float], f1: float) -> None:
    batches = [({"x": _anchors()}, 1)]
    comparison = compare_models(_detector({}), _detector(shift), batches)
    by_name = {o.name: o for o in comparison.outputs}
    boxes = by_name["kept_boxes"]
    assert boxes.decisions == "detections"
    assert boxes.yes_f1 == pytest.approx(f1, abs=1e-12)
    assert boxes.yes_counts == (10, 10 - (7 in shift), 10 - (7 in shift))
    for output in by_name.values():  # no figure row by row, nor the floor's SQNR
        assert output.sqnr_db is None and output.top1_agreement is None
        assert not floor_sqnr_applies(output.top1_agreement, output.decisions,
                                      output.variation_sqnr_db)


def test_rows_of_box_score_and_class_are_a_set_where_their_values_read_so() -> None:
    batches = [({"x": _anchors()}, 1)]
    (found,) = detection_sets(_detector({}, columns="class"))
    assert found.boxes == "rows_b" and found.columns
    (rows,) = compare_models(_detector({}, columns="class"),
                             _detector({4: -0.02, 7: -0.05}, columns="class"), batches).outputs
    assert rows.decisions == "detections" and rows.yes_counts == (10, 9, 9)
    # a last column of areas, not classes: the rows are compared row by row, as before
    (rows,) = compare_models(_detector({}, columns="area"),
                             _detector({4: -0.02}, columns="area"), batches).outputs
    assert rows.decisions != "detections" and rows.sqnr_db is not None and rows.sqnr_db < 30


def test_matching_takes_overlap_labels_order_and_padding() -> None:
    boxes = np.array([[0, 0, 10, 10], [20, 20, 30, 30], [40, 0, 50, 10]], np.float64)
    same_rows_swapped = boxes[[1, 0, 2]]
    assert count_matches(boxes, same_rows_swapped, None, None) == (3, 3, 3)
    # moved by 2 of 10 (IoU 0.667) still matches; by 5 (IoU 0.333) does not
    moved = boxes + np.array([[2, 0, 2, 0], [5, 0, 5, 0], [0, 0, 0, 0]])
    assert count_matches(boxes, moved, None, None) == (3, 3, 2)
    # another label is another detection
    labels = np.array([1, 2, 3])
    assert count_matches(boxes, boxes, labels, np.array([1, 2, 4])) == (3, 3, 2)
    # (y1, x1, y2, x2) corners, as TensorFlow writes them, overlap as (x1, y1, x2, y2) do
    assert count_matches(boxes[:, [1, 0, 3, 2]], moved[:, [1, 0, 3, 2]], None, None) == (3, 3, 2)
    # rows of zeros pad a fixed count of rows: not detections
    padded = np.vstack([boxes, np.zeros((5, 4))])
    assert count_matches(padded, padded[[0, 1, 3, 4, 5, 6, 7, 2]], None, None) == (3, 3, 3)
    # one quantized box cannot match two float ones
    assert count_matches(np.vstack([boxes[:1], boxes[:1]]), boxes[:1], None, None) == (2, 1, 1)
    assert count_matches(np.zeros((0, 4)), boxes, None, None) == (0, 3, 0)
