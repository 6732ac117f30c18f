"""A ReduceMean over every spatial axis whose mean a layer reads (a squeeze-excitation block, a
pooling head) becomes a GlobalAveragePool (pool-spatial-means): the prepared model computes the
same values, and quantized, onnxruntime runs the pool on the integer codes instead of a float
ReduceMean between a DequantizeLinear and a QuantizeLinear."""

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


def _se_block(*, axes: list[int] | None = None, keepdims: int = 1, mean_reader: str = "Conv",
              opset: int = 13, spatial: int = 2) -> onnx.ModelProto:
    """x [N, 8, (7,) 7] -> Conv -> Relu -> h; mean of h over `axes` -> `mean_reader` ...;
    a squeeze-excitation gate sigmoid(Conv(mean)) * h -> Conv -> y."""
    rng = np.random.default_rng(0)
    kernel = [1] * spatial
    axes = list(range(2, 2 + spatial)) if axes is None else axes
    inits: dict[str, np.ndarray] = {
        "w0": (rng.standard_normal((8, 8, *kernel)) * 0.4).astype(np.float32),
        "w1": (rng.standard_normal((8, 8, *kernel)) * 0.4).astype(np.float32),
        "w2": (rng.standard_normal((4, 8, *kernel)) * 0.4).astype(np.float32),
    }
    mean_inputs = ["h"]
    mean_attributes = {"keepdims": keepdims}
    if opset >= 18:
        inits["axes"] = np.array(axes, np.int64)
        mean_inputs.append("axes")
    else:
        mean_attributes["axes"] = axes
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"], name="conv0"),
        helper.make_node("Relu", ["c"], ["h"], name="relu0"),
        helper.make_node("ReduceMean", mean_inputs, ["m"], name="mean", **mean_attributes),
    ]
    if mean_reader == "Conv":
        nodes += [helper.make_node("Conv", ["m", "w1"], ["s"], name="squeeze"),
                  helper.make_node("Sigmoid", ["s"], ["g"], name="gate"),
                  helper.make_node("Mul", ["h", "g"], ["e"], name="excite")]
    else:  # instance norm written out: the mean is subtracted
        nodes.append(helper.make_node("Sub", ["h", "m"], ["e"], name="centre"))
    nodes.append(helper.make_node("Conv", ["e", "w2"], ["y"], name="head"))
    shape = ["N", 8] + [7] * spatial
    return build_model(nodes, [float_input("x", shape)], ["y"], inits, opset=opset)


def _feed(spatial: int = 2) -> dict[str, np.ndarray]:
    shape = (3, 8) + (7,) * spatial
    return {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("case", [{}, {"axes": [-1, -2]}, {"opset": 18}, {"spatial": 3}],
                         ids=["axes 2 3", "negative axes", "axes as input", "3-D"])
def test_a_spatial_mean_a_layer_reads_becomes_a_global_average_pool(case: dict) -> None:
    model = _se_block(**case)
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["ReduceMean"] == 0 and _ops(prepared)["GlobalAveragePool"] == 1
    (pool,) = [n for n in prepared.graph.node if n.op_type == "GlobalAveragePool"]
    assert (pool.name, list(pool.input), list(pool.output)) == ("mean", ["h"], ["m"])
    assert [s.name for s in steps if s.name == "pool-spatial-means"] == ["pool-spatial-means"]
    assert "axes" not in {t.name for t in prepared.graph.initializer}  # opset 18's, unread now
    onnx.checker.check_model(prepared, full_check=True)
    feed = _feed(case.get("spatial", 2))
    (reference,), (got,) = run(model, feed), run(prepared, feed)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [{"mean_reader": "Sub"}, {"keepdims": 0}, {"axes": [3]}, {"axes": [1, 2, 3]}],
    ids=["a normalization's mean", "dimensions dropped", "one spatial axis", "channels too"],
)
def test_other_means_stay_reduce_means(case: dict) -> None:
    model = _se_block(**case) if case.get("keepdims", 1) else _se_block_dropping_dims()
    prepared, steps = prepare_model(model)
    assert _ops(prepared)["ReduceMean"] == 1 and _ops(prepared)["GlobalAveragePool"] == 0
    assert not [s for s in steps if s.name == "pool-spatial-means"]


def _se_block_dropping_dims() -> onnx.ModelProto:
    """A pooling head: mean over H, W without keeping them -> Gemm -> y."""
    rng = np.random.default_rng(2)
    inits = {"w": rng.standard_normal((8, 5)).astype(np.float32)}
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], name="mean", axes=[2, 3], keepdims=0),
             helper.make_node("Gemm", ["m", "w"], ["y"], name="fc")]
    return build_model(nodes, [float_input("x", ["N", 8, 7, 7])], ["y"], inits)


def test_a_layer_norm_over_the_last_axis_of_a_sequence_stays() -> None:
    # [N, T, C] averaged over C (axis 2 = "the axes after the channels" of a rank-3 tensor):
    # a LayerNorm's mean, which onnxruntime fuses; rank 3 is never rewritten.
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], name="mean", axes=[2]),
             helper.make_node("MatMul", ["m", "w"], ["y"], name="proj")]
    model = build_model(nodes, [float_input("x", ["N", 6, 8])], ["y"],
                        {"w": rng.standard_normal((1, 4)).astype(np.float32)})
    prepared, _ = prepare_model(model)
    assert _ops(prepared)["ReduceMean"] == 1


def test_the_quantized_squeeze_excitation_pools_the_codes(tmp_path: Path) -> None:
    model = _se_block()
    onnx.save(model, tmp_path / "m.onnx")
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 8, 7, 7)).astype(np.float32))
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(data=tmp_path / "calib.npz"),
                       enforce_gates=False)
    quantized = result.model
    onnx.checker.check_model(quantized)
    decisions = {d["name"]: d for d in result.report["nodes"]}
    assert decisions["mean"]["op_type"] == "GlobalAveragePool" and decisions["mean"]["quantized"]
    optimized = optimized_ops(quantized, tmp_path)
    assert optimized["QLinearGlobalAveragePool"] == 1 and optimized["ReduceMean"] == 0
    (reference,), (got,) = run(model, _feed()), run(quantized, _feed())
    noise = np.sum((got - reference) ** 2)
    assert 10 * np.log10(np.sum(reference**2) / noise) > 25  # dB; int8 codes through 4 layers
