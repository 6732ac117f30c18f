"""Where the quantized model's error is made: a tensor's own rounding counts as harm even where
an earlier error hides its jump."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, read_rounded, run
from onnx import helper, numpy_helper

from qcal.accuracy.localise import localise_error
from qcal.graph.model import SelectionRules, plan_quantization, prepare_model


def test_a_tensor_rounded_coarsely_after_an_earlier_error_is_still_blamed() -> None:
    """x -> MatMul -> h1 -> MatMul -> h2 -> MatMul -> y. The first weight's first column is off
    by half (an error larger than any rounding after it, in a channel of h1 the second MatMul
    does not read), and the second MatMul reads h1 through a grid of 16 steps over its range:
    the error at h2, all rounding, is smaller than h1's, so no jump shows there. h1's harm is
    its own rounding, the mean over the samples of its noise over its signal, as numpy
    computes it from the quantized model's h1."""
    rng = np.random.default_rng(17)
    weights = {f"w{i}": (rng.standard_normal((8, 8)) * 0.5).astype(np.float32) for i in (1, 2, 3)}
    weights["w2"][0, :] = 0.0  # h1's first channel does not reach h2
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w2"], ["h2"], name="mm2"),
             helper.make_node("MatMul", ["h2", "w3"], ["y"], name="mm3")]
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8])], ["y"], weights))
    plan = plan_quantization(model, SelectionRules())
    assert "h1" in {a.tensor for a in plan.activations}

    x = rng.standard_normal((4, 8)).astype(np.float32)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    for tensor in broken.graph.initializer:
        if tensor.name == "w1":  # its first column off by half: h1's first channel
            values = numpy_helper.to_array(tensor).copy()
            values[:, 0] *= 1.5
            tensor.CopyFrom(numpy_helper.from_array(values, "w1"))
    h1 = run(broken, {"x": x})[0]
    scale = np.float32(np.abs(h1).max() / 8)
    broken = read_rounded(broken, "h1", float(scale), np.array(0, np.int8))

    batches = [({"x": x[i:i + 1]}, 1) for i in range(4)]
    harm = {s.tensor: s.harm for s in localise_error(model, broken, plan, batches).tensors}
    h64 = h1.astype(np.float64)
    rounded = np.clip(np.rint(h1 / scale), -128, 127).astype(np.float64) * float(scale)
    expected = np.mean(np.sum((rounded - h64) ** 2, axis=1) / np.sum(h64 ** 2, axis=1))
    assert 0.001 < expected < 0.1
    assert harm.get("h1", 0.0) >= expected - 1e-9
    assert harm["w1"] > 0.01  # the first error, where it is made


def test_each_sample_weighs_the_same_in_the_error_ratios() -> None:
    """An error of fixed size (an offset added to h1) is a large part of a quiet sample and a
    tiny part of a loud one: the jump at the first MatMul is the mean of the two samples'
    noise-over-signal ratios, as numpy computes them, not the ratio of the pooled energies
    (which the loud sample would own)."""
    rng = np.random.default_rng(19)
    weights = {f"w{i}": (rng.standard_normal((8, 8)) * 0.5).astype(np.float32) for i in (1, 2)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w2"], ["y"], name="mm2")]
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8])], ["y"], weights))
    plan = plan_quantization(model, SelectionRules())
    offset = np.full((1, 8), 0.05, np.float32)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.initializer.append(numpy_helper.from_array(offset, "offset"))
    broken.graph.node[0].output[0] = "h1_exact"
    broken.graph.node.insert(1, helper.make_node("Add", ["h1_exact", "offset"], ["h1"]))
    quiet = (rng.standard_normal((1, 8)) * 0.1).astype(np.float32)
    loud = quiet * 100.0
    harm = {s.tensor: s.harm for s in localise_error(
        model, broken, plan, [({"x": quiet}, 1), ({"x": loud}, 1)]).tensors}
    ratios = []
    for x in (quiet, loud):
        h = (x.astype(np.float64) @ weights["w1"].astype(np.float64))
        ratios.append(float(np.sum(offset.astype(np.float64) ** 2) / np.sum(h ** 2)))
    assert ratios[0] > 100 * ratios[1]
    assert harm["w1"] == pytest.approx(np.mean(ratios), rel=1e-4)


def test_an_error_where_the_float_model_computes_zeros_is_the_largest_ratio() -> None:
    """A layer the float model computes as all zeros (a zero-initialised weight) that the
    quantized model computes otherwise: noise with no signal, ratio 1 (noise as large as the
    signal), not a division by zero."""
    rng = np.random.default_rng(23)
    weights = {"w1": np.zeros((8, 8), np.float32),
               "w2": (rng.standard_normal((8, 8)) * 0.5).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w2"], ["y"], name="mm2")]
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 8])], ["y"], weights))
    plan = plan_quantization(model, SelectionRules())
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    for tensor in broken.graph.initializer:
        if tensor.name == "w1":
            tensor.CopyFrom(numpy_helper.from_array(np.full((8, 8), 1e-3, np.float32), "w1"))
    x = rng.standard_normal((1, 8)).astype(np.float32)
    harm = {s.tensor: s.harm for s in localise_error(model, broken, plan, [({"x": x}, 1)]).tensors}
    assert harm["w1"] == 1.0


def test_a_quantized_graph_output_is_blamed_for_its_own_rounding() -> None:
    """x -> Conv -> Relu -> Conv -> y, a graph output the plan quantizes (a Conv's, so that it
    runs in integers): no node reads y, so no jump shows its rounding, and a UNet's logits,
    rounded to 8 bits, were no candidate to keep float. Its harm is its own rounding, as numpy
    computes it from the float model's y on the quantized model's grid."""
    rng = np.random.default_rng(23)
    weights = {"w1": (rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float32),
               "w2": (rng.standard_normal((8, 32, 1, 1)) * 0.2).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="head")]
    model, _ = prepare_model(build_model(nodes, [float_input("x", ["N", 16, 6, 6])], ["y"],
                                         weights))
    plan = plan_quantization(model, SelectionRules())
    assert "y" in {a.tensor for a in plan.activations}

    x = rng.standard_normal((4, 16, 6, 6)).astype(np.float32)
    y = run(model, {"x": x})[0]
    scale = np.float32(np.abs(y).max() / 6)  # a coarse grid: 13 steps over the range
    rounded_model = onnx.ModelProto()
    rounded_model.CopyFrom(model)
    graph = rounded_model.graph
    next(n for n in graph.node if n.name == "head").output[0] = "y_pre"
    graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), "s"),
                              numpy_helper.from_array(np.array(0, np.int8), "z")])
    graph.node.extend([helper.make_node("QuantizeLinear", ["y_pre", "s", "z"], ["y_q"]),
                       helper.make_node("DequantizeLinear", ["y_q", "s", "z"], ["y"])])

    batches = [({"x": x[i:i + 1]}, 1) for i in range(4)]
    harm = {s.tensor: s.harm for s in localise_error(model, rounded_model, plan, batches).tensors}
    y64 = y.astype(np.float64).reshape(4, -1)
    rounded = np.clip(np.rint(y / scale), -128, 127).astype(np.float64).reshape(4, -1) * float(scale)
    expected = np.mean(np.sum((rounded - y64) ** 2, axis=1) / np.sum(y64 ** 2, axis=1))
    assert 0.001 < expected < 0.1
    assert harm["y"] == pytest.approx(expected, rel=1e-6)
