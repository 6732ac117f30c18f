"""A float MaxPool between a float operator and an integer Conv: onnxruntime would move the
QuantizeLinear of its output up through it and run it on uint8, in a plain channels-first loop;
qcal quantizes its input too, with parameters of its own, so that it stays float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from _pipeline_testing import calibrated_as_planned
from onnx import helper


def _swish_stem_pool(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    """A 3-channel stem Conv (float under placement "auto"), a swish written out, a MaxPool,
    then Conv -> Relu -> Conv -> global pooling: an audio-quality model's first block."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid"),
        helper.make_node("Mul", ["c1", "s1"], ["swish"], name="swish"),
        helper.make_node("MaxPool", ["swish"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="gap"),
    ]
    inits = {
        "w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.2,
        "b2": rng.standard_normal(16).astype(np.float32) * 0.1,
        "w3": rng.standard_normal((4, 16, 1, 1)).astype(np.float32) * 0.3,
        "b3": rng.standard_normal(4).astype(np.float32) * 0.1,
    }
    return build_model(nodes, [float_input("x", ["N", 3, 32, 32])], ["y"], inits, opset=opset)


def _pool_input_types(model: onnx.ModelProto, folder: Path) -> list[str]:
    """The element type each MaxPool of the graph onnxruntime runs reads ("uint8", "float")."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.shape_inference.infer_shapes(onnx.load(folder / "optimized.onnx"))
    graph = optimized.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.input, *graph.value_info, *graph.output)}
    writers = {o: n for n in graph.node for o in n.output}
    found = []
    for node in graph.node:
        if node.op_type != "MaxPool":
            continue
        # a QuantizeLinear's output is uint8, whatever shape inference says of its domain
        writer = writers.get(node.input[0])
        quantized = writer is not None and writer.op_type == "QuantizeLinear"
        elem = types.get(node.input[0], onnx.TensorProto.UINT8 if quantized else 0)
        found.append(onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem else "float32")
    return found


def test_a_max_pool_read_by_an_integer_conv_after_float_ops_stays_float(tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    model = _swish_stem_pool(rng, opset=17)
    x = rng.standard_normal((12, 3, 32, 32)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert not decisions["pool"]["quantized"] and not decisions["stem"]["quantized"]
    assert "its input is quantized too, with parameters of its own" in decisions["pool"]["reason"]
    assert decisions["conv2"]["quantized"] and decisions["conv3"]["quantized"]
    written = result.model.graph
    writers = {o: n for n in written.node for o in n.output}
    pool = next(n for n in written.node if n.name == "pool")
    dequantize = writers[pool.input[0]]
    assert dequantize.op_type == "DequantizeLinear"
    # its own parameters: not the ones of the pool's output, which onnxruntime would drop
    after = next(n for n in written.node if n.op_type == "QuantizeLinear" and n.input[0] == "p")
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in written.initializer}
    assert initializers[dequantize.input[1]] != initializers[after.input[1]]
    assert _pool_input_types(result.model, tmp_path) == ["float32"]
    # ...where without that pair onnxruntime runs it on uint8
    unguarded = onnx.ModelProto()
    unguarded.CopyFrom(result.model)
    pool = next(n for n in unguarded.graph.node if n.name == "pool")
    pool.input[0] = "swish"
    quantize = writers[dequantize.input[0]]
    for node in [n for n in unguarded.graph.node if n.name in (quantize.name, dequantize.name)]:
        unguarded.graph.node.remove(node)
    assert _pool_input_types(unguarded, tmp_path) == ["uint8"]
    session = ort.InferenceSession(result.model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = reference.run(None, {"x": x})[0]
    actual = session.run(None, {"x": x})[0]
    assert np.abs(actual - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("opset", [13, 22])
def test_the_pair_keeps_the_pool_float_at_every_opset(tmp_path: Path, opset: int) -> None:
    rng = np.random.default_rng(22)
    model = _swish_stem_pool(rng, opset=opset)
    x = rng.standard_normal((12, 3, 32, 32)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    pool = next(n for n in result.model.graph.node if n.name == "pool")
    assert pool.input[0] != "swish"
    assert _pool_input_types(result.model, tmp_path) == ["float32"]


def test_a_pool_whose_input_an_integer_conv_writes_gets_no_pair(tmp_path: Path) -> None:
    """Conv -> MaxPool -> Conv, the first Conv wide enough to be quantized: the pool's input is
    the Conv's integer output already, and no pair of its own is added."""
    rng = np.random.default_rng(23)
    model = _swish_stem_pool(rng, opset=17)
    for node in model.graph.node:
        if node.name == "pool":
            node.input[0] = "c1"
    model.graph.node.remove(next(n for n in model.graph.node if n.name == "swish"))
    model.graph.node.remove(next(n for n in model.graph.node if n.name == "sigmoid"))
    x = rng.standard_normal((12, 3, 32, 32)).astype(np.float32)
    result = calibrated_as_planned(model, tmp_path, x=x)
    reason = next(n for n in result.report["nodes"] if n["name"] == "pool")["reason"]
    assert "parameters of its own" not in reason
