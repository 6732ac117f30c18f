"""A channel shuffle (Reshape, Transpose, Reshape) becomes a Gather of channels
(shuffle-as-gather) and a Sum of two an Add (sum-as-add): the prepared model computes the same
values bit for bit, and quantized, onnxruntime gathers the integer codes instead of running a
five-axis Transpose, and adds the residual's codes instead of a float Sum."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, optimized_ops, run
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import prepare_model
from qcal.pipeline import calibrate

_GROUPS, _CHANNELS, _SIDE = 4, 64, 28


def _shuffle_block(*, split: list[int] | None = None, joined: list[int] | None = None,
                   perm: list[int] | None = None, batch: int | str = "N",
                   spy: bool = False) -> onnx.ModelProto:
    """x [N, 64, 28, 28] -> grouped 1x1 Conv (4 groups) -> Relu -> shuffle of 4 groups ->
    depthwise 3x3 Conv -> 1x1 Conv -> y; with `spy`, the transposed groups are an output too."""
    rng = np.random.default_rng(0)
    c, g = _CHANNELS, _GROUPS
    inits = {
        "w0": (rng.standard_normal((c, c // g, 1, 1)) * 0.3).astype(np.float32),
        "w1": (rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((c, c, 1, 1)) * 0.2).astype(np.float32),
        "split": np.array(split or [0, g, c // g, _SIDE, _SIDE], np.int64),
        "joined": np.array(joined or [0, -1, _SIDE, _SIDE], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="gconv", group=g),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu"),
        helper.make_node("Reshape", ["r0", "split"], ["s0"], name="split_groups"),
        helper.make_node("Transpose", ["s0"], ["t0"], name="swap_groups",
                         perm=perm or [0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t0", "joined"], ["h"], name="shuffled"),
        helper.make_node("Conv", ["h", "w1"], ["d"], name="depthwise", group=c, pads=[1] * 4),
        helper.make_node("Conv", ["d", "w2"], ["y"], name="pointwise"),
    ]
    outputs = ["y", "t0"] if spy else ["y"]
    return build_model(nodes, [float_input("x", [batch, c, _SIDE, _SIDE])], outputs, inits)


def _feed(batch: int = 3) -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal((batch, _CHANNELS, _SIDE, _SIDE))
    return {"x": x.astype(np.float32)}


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize(
    ("case", "batch"),
    [({}, "N"), ({"split": [-1, 4, 16, 28, 28], "joined": [-1, 64, 28, 28]}, "N"),
     ({"split": [1, 4, 16, 28, 28], "joined": [1, 64, 28, 28]}, 1),
     ({"split": [1, 4, 16, 28, 28], "joined": [1, -1, 28, 28]}, 1)],
    ids=["batch copied", "batch inferred", "batch 1 (dynamo)", "channels inferred"])
def test_a_channel_shuffle_becomes_a_gather_of_channels(case: dict, batch: int | str) -> None:
    model = _shuffle_block(batch=batch, **case)
    prepared, steps = prepare_model(model)
    ops = _ops(prepared)
    assert ops["Transpose"] == 0 and ops["Reshape"] == 0 and ops["Gather"] == 1
    (gather,) = [n for n in prepared.graph.node if n.op_type == "Gather"]
    assert (gather.name, gather.input[0], list(gather.output)) == ("shuffled", "r0", ["h"])
    assert [s.name for s in steps if s.name == "shuffle-as-gather"] == ["shuffle-as-gather"]
    assert not {"split", "joined"} & {t.name for t in prepared.graph.initializer}
    onnx.checker.check_model(prepared, full_check=True)
    # the permutation, independently: numpy's reshape, swap and reshape of the channels
    channels = np.arange(_CHANNELS).reshape(_GROUPS, _CHANNELS // _GROUPS).T.reshape(-1)
    indices = {t.name: onnx.numpy_helper.to_array(t) for t in prepared.graph.initializer}
    np.testing.assert_array_equal(indices[gather.input[1]], channels)
    feed = _feed(3 if batch == "N" else 1)
    (reference,), (got,) = run(model, feed), run(prepared, feed)
    np.testing.assert_array_equal(got, reference)  # the same values moved: bit for bit


@pytest.mark.parametrize(
    "case",
    [{"perm": [0, 1, 2, 3, 4]}, {"perm": [0, 2, 1, 4, 3]}, {"spy": True},
     {"split": [0, 4, 16, 14, 56]}, {"joined": [0, -1, 14, 56]}, {"six axes": True}],
    ids=["no swap", "spatial axes swapped too", "groups read elsewhere", "rows regrouped",
         "back to another shape", "channels split in three"])
def test_other_reshape_transpose_chains_stay(case: dict) -> None:
    model = _shuffle_block_6d() if case.get("six axes") else _shuffle_block(**case)
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["Gather"] == 0 and _ops(prepared)["Transpose"] == 1
    assert not [s for s in steps if s.name == "shuffle-as-gather"]


def _shuffle_block_6d() -> onnx.ModelProto:
    """The channels split in three axes [N, 2, 2, C/4, H, W], the first two swapped."""
    rng = np.random.default_rng(2)
    inits = {"split": np.array([0, 2, 2, _CHANNELS // 4, _SIDE, _SIDE], np.int64),
             "joined": np.array([0, -1, _SIDE, _SIDE], np.int64),
             "w": (rng.standard_normal((4, _CHANNELS, 1, 1))).astype(np.float32)}
    nodes = [helper.make_node("Reshape", ["x", "split"], ["s"], name="split"),
             helper.make_node("Transpose", ["s"], ["t"], name="swap", perm=[0, 2, 1, 3, 4, 5]),
             helper.make_node("Reshape", ["t", "joined"], ["h"], name="join"),
             helper.make_node("Conv", ["h", "w"], ["y"], name="conv")]
    return build_model(nodes, [float_input("x", ["N", _CHANNELS, _SIDE, _SIDE])], ["y"], inits)


def _calibrated(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    onnx.save(model, folder / "m.onnx")
    x = np.random.default_rng(4).standard_normal((16, _CHANNELS, _SIDE, _SIDE))
    np.savez(folder / "calib.npz", x=x.astype(np.float32))
    result = calibrate(folder / "m.onnx", CalibrationConfig(data=folder / "calib.npz",
                                                           fallback=False),
                       enforce_gates=False)
    onnx.checker.check_model(result.model)
    return result.model


def test_the_quantized_shuffle_moves_codes(tmp_path: Path) -> None:
    model = _shuffle_block()
    quantized = _calibrated(model, tmp_path)
    optimized_ops(quantized, tmp_path)  # writes onnxruntime's graph of it
    ran = onnx.load(tmp_path / "optimized.onnx").graph.node
    producer = {v: n for n in ran for v in n.output}
    ops = Counter(n.op_type for n in ran)
    # the grouped, the depthwise and the last Conv integer (the last one writes the model's
    # output through a pair of its own), the shuffle a Gather of codes, no Transpose of five
    # axes left
    assert ops["QLinearConv"] == 3
    (gather,) = [n for n in ran if n.op_type == "Gather"]
    assert producer[gather.input[0]].op_type in ("Transpose", "QLinearConv")
    assert not [n for n in ran if n.op_type == "Transpose"
                and len(next(a.ints for a in n.attribute if a.name == "perm")) == 5]
    (reference,), (got,) = run(model, _feed()), run(quantized, _feed())
    noise = np.sum((got - reference) ** 2)
    assert 10 * np.log10(np.sum(reference**2) / noise) > 25  # dB; int8 codes through 3 Convs


def _residual_sum(inputs: int) -> onnx.ModelProto:
    """x -> Conv -> Relu -> h; Sum(h, x[, x]) -> Relu -> Conv -> Relu -> Conv -> y."""
    rng = np.random.default_rng(5)
    inits = {"w0": (rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32),
             "w1": (rng.standard_normal((16, 16, 1, 1)) * 0.2).astype(np.float32),
             "w2": (rng.standard_normal((16, 16, 1, 1)) * 0.2).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c"], name="conv0", pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["h"], name="relu0"),
             helper.make_node("Sum", ["h", *["x"] * (inputs - 1)], ["s"], name="residual"),
             helper.make_node("Relu", ["s"], ["r"], name="relu1"),
             helper.make_node("Conv", ["r", "w1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu2"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    return build_model(nodes, [float_input("x", ["N", 16, 28, 28])], ["y"], inits)


def test_a_sum_of_two_becomes_an_add_and_is_quantized(tmp_path: Path) -> None:
    model = _residual_sum(2)
    prepared, steps = prepare_model(model)
    (node,) = [n for n in prepared.graph.node if n.name == "residual"]
    assert (node.op_type, list(node.input), list(node.output)) == ("Add", ["h", "x"], ["s"])
    assert "sum-as-add" in [s.name for s in steps]
    feed = {"x": np.random.default_rng(6).standard_normal((2, 16, 28, 28)).astype(np.float32)}
    np.testing.assert_array_equal(run(prepared, feed)[0], run(model, feed)[0])
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(7).standard_normal(
        (16, 16, 28, 28)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(data=tmp_path / "calib.npz",
                                                              fallback=False),
                       enforce_gates=False)
    decisions = {d["name"]: d for d in result.report["nodes"]}
    assert decisions["residual"]["op_type"] == "Add" and decisions["residual"]["quantized"]
    assert optimized_ops(result.model, tmp_path)["QLinearAdd"] == 1


def test_a_sum_of_three_stays_a_sum() -> None:
    prepared, steps = prepare_model(_residual_sum(3))
    (node,) = [n for n in prepared.graph.node if n.name == "residual"]
    assert node.op_type == "Sum" and "sum-as-add" not in [s.name for s in steps]
