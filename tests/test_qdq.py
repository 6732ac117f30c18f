"""InsertQDQ: structure, numerics against an independent numpy model, onnxruntime fusion.

Quantization parameters and weight codes are computed here with numpy, independently of qcal's
schemes. The numpy reference applies ONNX's definitions: QuantizeLinear is
``saturate(rne(x / scale) + zero_point)`` and DequantizeLinear ``(q - zero_point) * scale``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.model import ActivationTarget, BiasTarget, QuantPlan, WeightTarget
from qcal.graph.names import NameAllocator
from qcal.graph.qdq import InsertQDQ, PassResult, QuantizedWeight
from qcal.numerics.errors import ModelError
from qcal.numerics.onnx_mapping import OnnxQParams

RANGES: dict[int, tuple[int, int, type[np.integer]]] = {
    TensorProto.INT8: (-128, 127, np.int8),
    TensorProto.UINT8: (0, 255, np.uint8),
    TensorProto.INT16: (-32768, 32767, np.int16),
    TensorProto.UINT16: (0, 65535, np.uint16),
    TensorProto.INT4: (-8, 7, np.int8),
    TensorProto.UINT4: (0, 15, np.uint8),
}
DISABLED = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
EXTENDED = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
ALL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL


# -- parameters, computed independently -------------------------------------------------------


def make_qparams(
    dtype: int,
    scale: object,
    zero_point: object,
    axis: int | None = None,
    clip_min: object = None,
    clip_max: object = None,
) -> OnnxQParams:
    storage = RANGES[dtype][2]
    wide = dtype not in (TensorProto.INT8, TensorProto.UINT8)
    return OnnxQParams(
        dtype=dtype,
        scale=np.asarray(scale, dtype=np.float32),
        zero_point=np.asarray(zero_point).astype(storage),
        axis=axis,
        clip_min=None if clip_min is None else np.asarray(clip_min, dtype=np.float32),
        clip_max=None if clip_max is None else np.asarray(clip_max, dtype=np.float32),
        exact=True,
        deviations=(),
        replacement=None,
        min_opset=21 if wide else 13 if axis is not None else 10,
    )


def asymmetric_u8(values: np.ndarray) -> OnnxQParams:
    """uint8 affine over [min(values, 0), max(values, 0)]."""
    low, high = min(float(values.min()), 0.0), max(float(values.max()), 0.0)
    scale = np.float32((high - low) / 255.0)
    zero_point = np.clip(-np.rint(low / scale), 0, 255)
    return make_qparams(TensorProto.UINT8, scale, zero_point)


def symmetric_weight(
    weight: np.ndarray, axis: int | None, qmax: int = 63, dtype: int = TensorProto.INT8
) -> QuantizedWeight:
    """Symmetric codes in [-qmax-1, qmax] with zero point 0, per channel on `axis`.

    7-bit codes (qmax 63) by default: on x86 without VNNI, onnxruntime's u8s8 integer kernels
    add pairs of products in int16 and saturate with full-range int8 weights.
    """
    reduce = tuple(i for i in range(weight.ndim) if i != axis) if axis is not None else None
    scale = (np.abs(weight).max(axis=reduce) / qmax).astype(np.float32)
    codes = np.clip(np.rint(weight / broadcast(scale, axis, weight.ndim)), -qmax - 1, qmax)
    storage = RANGES[dtype][2]
    return QuantizedWeight(
        codes.astype(storage), make_qparams(dtype, scale, np.zeros(scale.shape), axis)
    )


def broadcast(values: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    values = np.asarray(values)
    if axis is None:
        return values
    shape = [1] * ndim
    shape[axis] = values.size
    return values.reshape(shape)


def fake_quant(x: np.ndarray, qparams: OnnxQParams) -> np.ndarray:
    """Clip, QuantizeLinear then DequantizeLinear, in float32 as ONNX defines them."""
    x = np.asarray(x, dtype=np.float32)
    low, high, _ = RANGES[qparams.dtype]
    scale = broadcast(qparams.scale, qparams.axis, x.ndim).astype(np.float32)
    zero_point = broadcast(qparams.zero_point, qparams.axis, x.ndim).astype(np.int64)
    if qparams.clip_min is not None:
        x = np.maximum(x, broadcast(qparams.clip_min, qparams.axis, x.ndim))
    if qparams.clip_max is not None:
        x = np.minimum(x, broadcast(qparams.clip_max, qparams.axis, x.ndim))
    codes = np.clip(np.rint(x / scale).astype(np.int64) + zero_point, low, high)
    return ((codes - zero_point).astype(np.float32) * scale).astype(np.float32)


def dequantized(weight: QuantizedWeight) -> np.ndarray:
    q = weight.onnx
    codes = weight.codes.astype(np.int64) - broadcast(q.zero_point, q.axis, weight.codes.ndim)
    return (codes.astype(np.float32) * broadcast(q.scale, q.axis, weight.codes.ndim)).astype(
        np.float32
    )


# -- onnxruntime ------------------------------------------------------------------------------


def run(
    model: onnx.ModelProto,
    feed: Mapping[str, np.ndarray],
    outputs: Sequence[str] = (),
    *,
    level: ort.GraphOptimizationLevel = DISABLED,
    optimized_path: Path | None = None,
) -> dict[str, np.ndarray]:
    """Run `model` on the CPU provider; `outputs` adds intermediate values to its outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in outputs:
        probe.graph.output.append(helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feed))))


def optimized_op_types(
    model: onnx.ModelProto, feed: Mapping[str, np.ndarray], tmp_path: Path, level: object
) -> tuple[list[str], np.ndarray]:
    """Op types of the graph onnxruntime builds (saved with optimized_model_filepath)."""
    path = tmp_path / f"optimized_{level}.onnx"
    outputs = run(model, feed, level=level, optimized_path=path)  # type: ignore[arg-type]
    graph = onnx.load(str(path)).graph
    return [node.op_type for node in graph.node], outputs[model.graph.output[0].name]


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, list[int]]],
    outputs: list[tuple[str, list[int]]],
    initializers: Mapping[str, np.ndarray],
    opset: int = 13,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def plan(
    activations: Mapping[str, Sequence[str]],
    weights: Sequence[tuple[str, str, str, int | None]] = (),
    biases: Sequence[tuple[str, str, str, str]] = (),
) -> QuantPlan:
    return QuantPlan(
        activations=tuple(ActivationTarget(t, tuple(c)) for t, c in sorted(activations.items())),
        weights=tuple(WeightTarget(*w) for w in sorted(weights)),
        biases=tuple(BiasTarget(*b) for b in sorted(biases)),
        nodes=(),
    )


def nodes_by_output(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    (found,) = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(found)


# -- the CNN: Conv + Relu + MaxPool + Flatten + Gemm ----------------------------------------


@dataclasses.dataclass
class Case:
    model: onnx.ModelProto
    feed: dict[str, np.ndarray]
    plan: QuantPlan
    activations: dict[str, OnnxQParams]
    weights: dict[str, QuantizedWeight]

    def insert(self) -> PassResult:
        return InsertQDQ(self.plan, self.activations, self.weights)(self.model)


def conv3x3(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """NCHW convolution, 3x3 kernel, padding 1, stride 1, in float64."""
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    height, width = x.shape[2:]
    out = np.zeros((x.shape[0], w.shape[0], height, width))
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i : i + height, j : j + width]
            out += np.einsum("nchw,oc->nohw", window, w[:, :, i, j].astype(np.float64))
    return out + b.astype(np.float64)[None, :, None, None]


def maxpool2(x: np.ndarray) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def cnn_case(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((6, 1, 3, 3)).astype(np.float32)
    b1 = (0.2 * rng.standard_normal(6)).astype(np.float32)
    w2 = (0.1 * rng.standard_normal((10, 96))).astype(np.float32)
    b2 = (0.1 * rng.standard_normal(10)).astype(np.float32)
    x = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    model = make_model(
        [
            helper.make_node("Conv", ["x", "W1", "B1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node(
                "MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
            ),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "W2", "B2"], ["y"], name="gemm", transB=1),
        ],
        [("x", [2, 1, 8, 8])],
        [("y", [2, 10])],
        {"W1": w1, "B1": b1, "W2": w2, "B2": b2},
    )
    # Calibrate on the float activations; pooling and flatten share the Relu output's
    # parameters so that onnxruntime can drop their Q/DQ pairs.
    relu = np.maximum(conv3x3(x, w1, b1), 0).astype(np.float32)
    relu_params = asymmetric_u8(relu)
    activations = {
        "x": asymmetric_u8(x),
        "r": relu_params,
        "p": relu_params,
        "f": relu_params,
        "y": asymmetric_u8(relu),
    }
    return Case(
        model,
        {"x": x},
        plan(
            {"x": ["conv"], "r": ["pool"], "p": ["flatten"], "f": ["gemm"], "y": []},
            [("W1", "conv", "Conv", 0), ("W2", "gemm", "Gemm", 0)],
            [("B1", "conv", "x", "W1"), ("B2", "gemm", "f", "W2")],
        ),
        activations,
        {"W1": symmetric_weight(w1, 0), "W2": symmetric_weight(w2, 0)},
    )


def bias_codes(
    bias: np.ndarray, in_scale: np.ndarray, w_scale: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    scale = (np.float32(in_scale) * w_scale.astype(np.float32)).astype(np.float32)
    ratio = bias.astype(np.float64) / scale.astype(np.float64)
    return np.clip(np.rint(ratio), -(2**31), 2**31 - 1).astype(np.int32), scale


def simulate_cnn(case: Case) -> np.ndarray:
    """The quantized CNN in numpy: float ops on dequantized values, fake-quant at each Q."""
    a, w = case.activations, case.weights
    b1_codes, b1_scale = bias_codes(initializer(case.model, "B1"), a["x"].scale, w["W1"].onnx.scale)
    b2_codes, b2_scale = bias_codes(initializer(case.model, "B2"), a["f"].scale, w["W2"].onnx.scale)
    x = fake_quant(case.feed["x"], a["x"])
    conv = conv3x3(x, dequantized(w["W1"]), (b1_codes * b1_scale).astype(np.float32))
    relu = fake_quant(np.maximum(conv, 0), a["r"])
    pooled = fake_quant(maxpool2(relu), a["p"])
    flat = fake_quant(pooled.reshape(pooled.shape[0], -1), a["f"])
    gemm = flat.astype(np.float64) @ dequantized(w["W2"]).T.astype(np.float64)
    return (gemm + (b2_codes * b2_scale).astype(np.float32)).astype(np.float32)


def cnn_flip_bound(case: Case) -> float:
    """Output change if each quantized Relu/pool/flatten code moved by one step."""
    w2 = dequantized(case.weights["W2"])
    return float(case.activations["f"].scale) * float(np.abs(w2).sum(axis=1).max()) + 1e-5


def cnn_float_bound(case: Case) -> np.ndarray:
    """Worst-case |quantized - float| per output, propagated elementwise from the scales.

    For a linear map, ``|x'w' - xw| <= |x' - x| |w'| + |x| |w' - w|``; a Q adds at most s/2
    (it clamps to a range holding the float value); Relu and MaxPool do not grow errors.
    """
    a, w = case.activations, case.weights
    x = case.feed["x"]
    w1, w2 = dequantized(w["W1"]), dequantized(w["W2"])
    s1, s2 = w["W1"].onnx.scale, w["W2"].onnx.scale
    _, b1_scale = bias_codes(initializer(case.model, "B1"), a["x"].scale, s1)
    _, b2_scale = bias_codes(initializer(case.model, "B2"), a["f"].scale, s2)
    zero = np.zeros_like(b1_scale)
    conv = (
        conv3x3(np.full_like(x, a["x"].scale / 2), np.abs(w1), zero)
        + conv3x3(np.abs(x), np.broadcast_to(s1[:, None, None, None] / 2, w1.shape), zero)
        + b1_scale[None, :, None, None] / 2
    )
    pooled = maxpool2(conv + a["r"].scale / 2) + a["p"].scale / 2 + a["f"].scale / 2
    flat_error = pooled.reshape(len(x), -1)
    float_conv = conv3x3(x, initializer(case.model, "W1"), initializer(case.model, "B1"))
    float_flat = maxpool2(np.maximum(float_conv, 0)).reshape(len(x), -1)
    return (
        flat_error @ np.abs(w2).T
        + np.abs(float_flat).sum(axis=1, keepdims=True) * s2 / 2
        + b2_scale / 2
        + 1e-5
    )


def test_cnn_layout_names_and_types() -> None:
    case = cnn_case()
    result = case.insert()
    assert result.modified
    model = result.model
    producers = nodes_by_output(model)
    # One pair per quantized activation, read by its consumers only.
    for tensor, consumer in (("x", "conv"), ("r", "pool"), ("p", "flatten"), ("f", "gemm")):
        dq = producers[f"{tensor}_dequantized"]
        q = producers[f"{tensor}_quantized"]
        assert (q.op_type, q.name, dq.op_type, dq.name) == (
            "QuantizeLinear",
            f"{tensor}_QuantizeLinear",
            "DequantizeLinear",
            f"{tensor}_DequantizeLinear",
        )
        assert list(q.input) == [tensor, f"{tensor}_scale", f"{tensor}_zero_point"]
        assert list(dq.input) == [f"{tensor}_quantized", f"{tensor}_scale", f"{tensor}_zero_point"]
        readers = [n.name for n in model.graph.node if f"{tensor}_dequantized" in n.input]
        assert readers == [consumer]
        assert initializer(model, f"{tensor}_zero_point").dtype == np.uint8
        assert initializer(model, f"{tensor}_scale").shape == ()
    # The graph output keeps its float producer and gets no pair (nothing would read it).
    assert "y_quantized" not in producers and producers["y"].op_type == "Gemm"
    # Weights: integer initializers + per-channel DequantizeLinear; the floats are gone.
    names = {t.name for t in model.graph.initializer}
    assert not names & {"W1", "W2", "B1", "B2"}
    for weight, axis in (("W1", 0), ("W2", 0)):
        dq = producers[f"{weight}_dequantized"]
        assert list(dq.input) == [f"{weight}_quantized", f"{weight}_scale", f"{weight}_zero_point"]
        assert helper.get_attribute_value(dq.attribute[0]) == axis
        np.testing.assert_array_equal(
            initializer(model, f"{weight}_quantized"), case.weights[weight].codes
        )
        assert initializer(model, f"{weight}_quantized").dtype == np.int8
    # Biases: int32 codes with scale f32(input scale x weight scale), zero point 0.
    for bias, source, weight in (("B1", "x", "W1"), ("B2", "f", "W2")):
        codes, scale = bias_codes(
            initializer(case.model, bias),
            case.activations[source].scale,
            case.weights[weight].onnx.scale,
        )
        np.testing.assert_array_equal(initializer(model, f"{bias}_quantized"), codes)
        np.testing.assert_array_equal(initializer(model, f"{bias}_scale"), scale)
        zero_point = initializer(model, f"{bias}_zero_point")
        assert zero_point.dtype == np.int32 and not zero_point.any()
    conv = producers["c"]
    assert list(conv.input) == ["x_dequantized", "W1_dequantized", "B1_dequantized"]
    # Each activation pair sits right after the producer of its tensor.
    order = [n.name for n in model.graph.node]
    assert order.index("r_QuantizeLinear") == order.index("relu") + 1
    assert order.index("p_QuantizeLinear") == order.index("pool") + 1


def test_cnn_qdq_matches_numpy_simulation() -> None:
    case = cnn_case()
    model = case.insert().model
    values = run(model, case.feed, [t for s in "xrpf" for t in (s, f"{s}_dequantized")])
    for tensor in "xrpf":  # every Q/DQ pair is ONNX fake-quant, bit for bit
        np.testing.assert_array_equal(
            values[f"{tensor}_dequantized"], fake_quant(values[tensor], case.activations[tensor])
        )
    difference = np.abs(values["y"] - simulate_cnn(case)).max()
    assert difference <= cnn_flip_bound(case)


def test_cnn_output_is_within_the_scale_derived_bound_of_the_float_model() -> None:
    case = cnn_case()
    quantized = run(case.insert().model, case.feed)["y"]
    reference = run(case.model, case.feed)["y"]
    bound = cnn_float_bound(case)
    assert np.all(np.abs(quantized - reference) <= bound)
    assert bound.max() < 0.5 * np.abs(reference).max()  # the bound says something


@pytest.mark.parametrize("level", [EXTENDED, ALL], ids=["extended", "all"])
def test_onnxruntime_fuses_cnn_into_integer_kernels(tmp_path: Path, level: object) -> None:
    case = cnn_case()
    ops, output = optimized_op_types(case.insert().model, case.feed, tmp_path, level)
    assert "QLinearConv" in ops  # ai.onnx, or com.microsoft NHWC at ORT_ENABLE_ALL
    assert "QGemm" in ops  # com.microsoft, float output
    assert not {"Conv", "FusedConv", "Gemm", "Relu", "DequantizeLinear"} & set(ops)
    # Relu absorbed (uint8 zero point 0), MaxPool/Flatten run on uint8: only the input Q is left.
    assert ops.count("QuantizeLinear") == 1
    # Integer kernels requantize with their own rounding: allow a code or two per step.
    assert np.abs(output - simulate_cnn(case)).max() <= 2 * cnn_flip_bound(case)


def test_output_is_byte_identical_across_runs_and_orders() -> None:
    case = cnn_case()
    first = case.insert().model.SerializeToString()
    shuffled = QuantPlan(
        activations=tuple(reversed(case.plan.activations)),
        weights=tuple(reversed(case.plan.weights)),
        biases=tuple(reversed(case.plan.biases)),
        nodes=(),
    )
    again = InsertQDQ(
        shuffled,
        dict(reversed(list(case.activations.items()))),
        dict(reversed(list(case.weights.items()))),
    )(case.model)
    assert again.model.SerializeToString() == first
    assert case.insert().model.SerializeToString() == first


def test_input_model_is_not_changed() -> None:
    case = cnn_case()
    before = case.model.SerializeToString()
    case.insert()
    assert case.model.SerializeToString() == before


def test_bias_stays_float_when_its_input_is_not_quantized() -> None:
    case = cnn_case()
    case.plan = dataclasses.replace(
        case.plan, activations=tuple(t for t in case.plan.activations if t.tensor != "x")
    )
    model = case.insert().model
    conv = nodes_by_output(model)["c"]
    assert list(conv.input) == ["x", "W1_dequantized", "B1"]
    np.testing.assert_array_equal(initializer(model, "B1"), initializer(case.model, "B1"))
    assert "B2_quantized" in {t.name for t in model.graph.initializer}


def test_empty_plan_changes_nothing() -> None:
    case = cnn_case()
    result = InsertQDQ(plan({}), {}, {})(case.model)
    assert not result.modified
    assert result.model.SerializeToString() == case.model.SerializeToString()


# -- MatMul + Add, Concat ---------------------------------------------------------------------


def matmul_case() -> Case:
    """x -> MatMul(W1) -> h -> Add(h, b1) -> a -> MatMul(W2) -> y, weights per column."""
    rng = np.random.default_rng(1)
    w1 = (0.3 * rng.standard_normal((16, 12))).astype(np.float32)
    b1 = rng.standard_normal(12).astype(np.float32)
    w2 = (0.3 * rng.standard_normal((12, 5))).astype(np.float32)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
            helper.make_node("Add", ["h", "b1"], ["a"], name="add"),
            helper.make_node("MatMul", ["a", "W2"], ["y"], name="mm2"),
        ],
        [("x", [4, 16])],
        [("y", [4, 5])],
        {"W1": w1, "b1": b1, "W2": w2},
    )
    h = (x.astype(np.float64) @ w1).astype(np.float32)
    # The Add's constant is quantized like an activation (uint8): QLinearAdd needs both inputs
    # of one type.
    b1_params = asymmetric_u8(b1)
    b1_codes = np.clip(np.rint(b1 / b1_params.scale) + b1_params.zero_point, 0, 255)
    return Case(
        model,
        {"x": x},
        plan(
            {"x": ["mm1"], "h": ["add"], "a": ["mm2"]},
            [("W1", "mm1", "MatMul", 1), ("W2", "mm2", "MatMul", 1), ("b1", "add", "Add", None)],
        ),
        {"x": asymmetric_u8(x), "h": asymmetric_u8(h), "a": asymmetric_u8(h + b1)},
        {
            "W1": symmetric_weight(w1, 1),
            "W2": symmetric_weight(w2, 1),
            "b1": QuantizedWeight(b1_codes.astype(np.uint8), b1_params),
        },
    )


def simulate_matmul(case: Case) -> np.ndarray:
    a, w = case.activations, case.weights
    x = fake_quant(case.feed["x"], a["x"]).astype(np.float64)
    h = fake_quant(x @ dequantized(w["W1"]), a["h"])
    added = fake_quant(h + dequantized(w["b1"]), a["a"]).astype(np.float64)
    return (added @ dequantized(w["W2"])).astype(np.float32)


def test_matmul_add_matches_simulation_and_float_bound() -> None:
    case = matmul_case()
    model = case.insert().model
    values = run(model, case.feed, ["h", "h_dequantized", "a", "a_dequantized"])
    for tensor in ("h", "a"):
        np.testing.assert_array_equal(
            values[f"{tensor}_dequantized"], fake_quant(values[tensor], case.activations[tensor])
        )
    w2 = dequantized(case.weights["W2"])
    flip = float(case.activations["a"].scale) * float(np.abs(w2).sum(axis=0).max()) + 1e-5
    assert np.abs(values["y"] - simulate_matmul(case)).max() <= flip
    # Float bound, per layer: |x'w' - xw| <= |x'-x||w'| + |x||w'-w|; each Q adds s/2.
    a, w, x = case.activations, case.weights, case.feed["x"]
    w1 = dequantized(w["W1"])
    h_err = (
        a["x"].scale / 2 * np.abs(w1).sum(axis=0)
        + np.abs(x).sum(axis=1).max() * w["W1"].onnx.scale / 2
    ).max() + a["h"].scale / 2
    a_err = h_err + w["b1"].onnx.scale / 2 + a["a"].scale / 2
    a_float = x.astype(np.float64) @ initializer(case.model, "W1") + initializer(case.model, "b1")
    y_err = (
        a_err * np.abs(w2).sum(axis=0) + np.abs(a_float).sum(axis=1).max() * w["W2"].onnx.scale / 2
    ).max() + 1e-5
    reference = run(case.model, case.feed)["y"]
    assert np.abs(values["y"] - reference).max() <= y_err < 0.5 * np.abs(reference).max()


def test_onnxruntime_fuses_matmul_and_add(tmp_path: Path) -> None:
    case = matmul_case()
    ops, output = optimized_op_types(case.insert().model, case.feed, tmp_path, EXTENDED)
    assert "QLinearMatMul" in ops  # mm1: DQ -> MatMul -> Q
    assert "QLinearAdd" in ops  # com.microsoft
    assert "MatMulIntegerToFloat" in ops  # mm2: float output, com.microsoft
    assert not {"MatMul", "Add", "DequantizeLinear"} & set(ops)
    w2 = dequantized(case.weights["W2"])
    flip = float(case.activations["a"].scale) * float(np.abs(w2).sum(axis=0).max()) + 1e-5
    assert np.abs(output - simulate_matmul(case)).max() <= 2 * flip


def concat_case() -> Case:
    rng = np.random.default_rng(2)
    w = (0.3 * rng.standard_normal((8, 3))).astype(np.float32)
    x1 = rng.standard_normal((4, 3)).astype(np.float32)
    x2 = (3.0 * rng.standard_normal((4, 5))).astype(np.float32)
    model = make_model(
        [
            helper.make_node("Concat", ["x1", "x2"], ["cat"], name="concat", axis=1),
            helper.make_node("MatMul", ["cat", "W"], ["y"], name="mm"),
        ],
        [("x1", [4, 3]), ("x2", [4, 5])],
        [("y", [4, 3])],
        {"W": w},
    )
    cat = np.concatenate([x1, x2], axis=1)
    return Case(
        model,
        {"x1": x1, "x2": x2},
        plan({"x1": ["concat"], "x2": ["concat"], "cat": ["mm"]}, [("W", "mm", "MatMul", 1)]),
        {"x1": asymmetric_u8(x1), "x2": asymmetric_u8(x2), "cat": asymmetric_u8(cat)},
        {"W": symmetric_weight(w, 1)},
    )


def test_concat_fuses_and_matches_simulation(tmp_path: Path) -> None:
    case = concat_case()
    model = case.insert().model
    order = [n.name for n in model.graph.node]
    # Graph inputs get their pairs at the front, sorted by tensor name.
    assert order[:4] == [
        "x1_QuantizeLinear",
        "x1_DequantizeLinear",
        "x2_QuantizeLinear",
        "x2_DequantizeLinear",
    ]
    a = case.activations
    parts = [fake_quant(case.feed[t], a[t]) for t in ("x1", "x2")]
    cat = fake_quant(np.concatenate(parts, axis=1), a["cat"]).astype(np.float64)
    expected = (cat @ dequantized(case.weights["W"])).astype(np.float32)
    w = dequantized(case.weights["W"])
    flip = float(a["cat"].scale) * float(np.abs(w).sum(axis=0).max()) + 1e-5
    np.testing.assert_allclose(run(model, case.feed)["y"], expected, rtol=0, atol=flip)
    ops, output = optimized_op_types(model, case.feed, tmp_path, EXTENDED)
    assert "QLinearConcat" in ops and "MatMulIntegerToFloat" in ops
    assert not {"Concat", "MatMul", "DequantizeLinear"} & set(ops)
    assert np.abs(output - expected).max() <= 2 * flip


# -- mixed consumers, graph outputs, shared weights ------------------------------------------


def mixed_case() -> Case:
    """t feeds a quantized MatMul and a float Sigmoid and is a graph output; W is shared."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["t"], name="relu"),
            helper.make_node("MatMul", ["t", "W"], ["yq"], name="mm_quantized"),
            helper.make_node("MatMul", ["t", "W"], ["yq2"], name="mm_quantized_too"),
            helper.make_node("Sigmoid", ["t"], ["ys"], name="sigmoid"),
            helper.make_node("MatMul", ["x", "W"], ["yf"], name="mm_float"),
        ],
        [("x", [3, 6])],
        [("yq", [3, 4]), ("yq2", [3, 4]), ("ys", [3, 6]), ("yf", [3, 4]), ("t", [3, 6])],
        {"W": w},
    )
    return Case(
        model,
        {"x": x},
        plan(
            {"t": ["mm_quantized", "mm_quantized_too"]},
            [("W", "mm_quantized", "MatMul", 1), ("W", "mm_quantized_too", "MatMul", 1)],
        ),
        {"t": asymmetric_u8(np.maximum(x, 0))},
        {"W": symmetric_weight(w, 1, qmax=127)},
    )


def test_float_consumers_and_graph_outputs_keep_the_float_tensor() -> None:
    case = mixed_case()
    model = case.insert().model
    by_name = {n.name: n for n in model.graph.node}
    assert [n.op_type for n in model.graph.node].count("QuantizeLinear") == 1  # one shared pair
    assert list(by_name["mm_quantized"].input) == ["t_dequantized", "W_dequantized"]
    assert list(by_name["mm_quantized_too"].input) == ["t_dequantized", "W_dequantized"]
    assert list(by_name["sigmoid"].input) == ["t"]
    assert list(by_name["mm_float"].input) == ["x", "W"]
    assert "W" in {t.name for t in model.graph.initializer}  # still read by the float MatMul
    assert [o.name for o in model.graph.output] == ["yq", "yq2", "ys", "yf", "t"]
    quantized, reference = run(model, case.feed), run(case.model, case.feed)
    for name in ("t", "ys", "yf"):  # float paths are untouched, bit for bit
        np.testing.assert_array_equal(quantized[name], reference[name])
    t = fake_quant(reference["t"], case.activations["t"]).astype(np.float64)
    expected = (t @ dequantized(case.weights["W"])).astype(np.float32)
    np.testing.assert_allclose(quantized["yq"], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(quantized["yq"], quantized["yq2"])


# -- clips, narrow and wide types, opsets -----------------------------------------------------


def clip_case(axis: int | None, opset: int = 13) -> Case:
    rng = np.random.default_rng(4)
    x = (2.0 * rng.standard_normal((2, 3, 5))).astype(np.float32)
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["t"], name="relu"),
            helper.make_node("Sigmoid", ["t"], ["y"], name="sigmoid"),
        ],
        [("x", [2, 3, 5])],
        [("y", [2, 3, 5])],
        {},
        opset=opset,
    )
    if axis is None:
        # A [0, 127] range held in uint8 ("reduce range"): only the top needs clipping.
        scale = np.float32(6.0 / 127)
        params = make_qparams(TensorProto.UINT8, scale, 0, clip_max=127 * scale)
    else:
        scale = np.array([0.05, 0.02, 0.03], np.float32)
        params = make_qparams(
            TensorProto.INT8, scale, [0, 0, 0], axis=axis, clip_min=-7 * scale, clip_max=7 * scale
        )
    return Case(model, {"x": x}, plan({"t": ["sigmoid"]}), {"t": params}, {})


@pytest.mark.parametrize(("axis", "opset"), [(None, 13), (None, 10), (1, 13), (-2, 13)])
def test_clip_narrows_the_range_before_quantizing(axis: int | None, opset: int) -> None:
    case = clip_case(axis, opset)
    model = case.insert().model
    ops = [n.op_type for n in model.graph.node]
    if axis is None:
        assert ops == ["Relu", "Clip", "QuantizeLinear", "DequantizeLinear", "Sigmoid"]
    else:
        assert ops == ["Relu", "Max", "Min", "QuantizeLinear", "DequantizeLinear", "Sigmoid"]
        assert initializer(model, "t_clip_min").shape == (3, 1)
    values = run(model, case.feed, ["t", "t_dequantized"])
    expected = fake_quant(values["t"], case.activations["t"])
    np.testing.assert_array_equal(values["t_dequantized"], expected)
    assert np.abs(expected).max() < np.abs(values["t"]).max()  # the clip did bite


def int4_case(opset: int) -> Case:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    model = make_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [("x", [3, 8])],
        [("y", [3, 6])],
        {"W": w},
        opset=opset,
    )
    x_scale = np.float32(np.abs(x).max() / 32767)
    return Case(
        model,
        {"x": x},
        plan({"x": ["mm"]}, [("W", "mm", "MatMul", 1)]),
        {"x": make_qparams(TensorProto.INT16, x_scale, 0)},
        {"W": symmetric_weight(w, 1, qmax=7, dtype=TensorProto.INT4)},
    )


def test_int4_weights_and_int16_activations_at_opset_21() -> None:
    case = int4_case(21)
    model = case.insert().model
    stored = {t.name: t for t in model.graph.initializer}
    assert stored["W_quantized"].data_type == TensorProto.INT4
    assert stored["x_zero_point"].data_type == TensorProto.INT16
    np.testing.assert_array_equal(
        numpy_helper.to_array(stored["W_quantized"]).astype(np.int8), case.weights["W"].codes
    )
    x = fake_quant(case.feed["x"], case.activations["x"]).astype(np.float64)
    expected = (x @ dequantized(case.weights["W"])).astype(np.float32)
    np.testing.assert_allclose(run(model, case.feed)["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("case", "needed"),
    [(lambda: int4_case(13), "21"), (lambda: clip_case(1, opset=12), "13")],
    ids=["int4-at-13", "per-axis-at-12"],
)
def test_an_opset_too_low_is_an_error_not_an_upgrade(case: object, needed: str) -> None:
    built = case()  # type: ignore[operator]
    with pytest.raises(ModelError, match=rf"InsertQDQ: model opset \d+ is below {needed}"):
        built.insert()


# -- errors and names -------------------------------------------------------------------------


def test_plan_and_parameters_that_do_not_fit_the_model_are_errors() -> None:
    case = mixed_case()
    with pytest.raises(ModelError, match="no quantization parameters for activation 't'"):
        InsertQDQ(case.plan, {}, case.weights)(case.model)
    with pytest.raises(ModelError, match="node 'sigmoid_x' is not in the graph"):
        InsertQDQ(plan({"t": ["sigmoid_x"]}), case.activations, {})(case.model)
    with pytest.raises(ModelError, match="node 'mm_float' does not read it"):
        InsertQDQ(plan({"t": ["mm_float"]}), case.activations, {})(case.model)
    with pytest.raises(ModelError, match="activation 'nope' is not a tensor"):
        InsertQDQ(plan({"nope": []}), {"nope": case.activations["t"]}, {})(case.model)
    wrong_shape = QuantizedWeight(case.weights["W"].codes.T, case.weights["W"].onnx)
    with pytest.raises(ModelError, match="weight 'W'.*shape"):
        InsertQDQ(case.plan, case.activations, {"W": wrong_shape})(case.model)
    zero_scale = dataclasses.replace(case.activations["t"], scale=np.float32(0.0))
    with pytest.raises(ModelError, match="activation 't'.*scale"):
        InsertQDQ(case.plan, {"t": zero_scale}, case.weights)(case.model)


def test_new_names_never_collide_with_existing_ones() -> None:
    case = mixed_case()
    # Take the names the pass would use, as a tensor, a node name and inside a subgraph.
    taken = onnx.ModelProto()
    taken.CopyFrom(case.model)
    graph = taken.graph
    graph.node.append(helper.make_node("Identity", ["t"], ["t_quantized"], name="t_dequantized"))
    branch = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["t_scale"], name="t_QuantizeLinear")],
        "branch",
        [],
        [helper.make_tensor_value_info("t_scale", TensorProto.FLOAT, [3, 6])],
    )
    graph.initializer.append(numpy_helper.from_array(np.array(True), "condition"))
    graph.node.append(
        helper.make_node(
            "If", ["condition"], ["branch_out"], name="if", then_branch=branch, else_branch=branch
        )
    )
    graph.output.append(helper.make_tensor_value_info("t_quantized", TensorProto.FLOAT, [3, 6]))
    graph.output.append(helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, [3, 6]))
    onnx.checker.check_model(taken)
    model = InsertQDQ(case.plan, case.activations, case.weights)(taken).model
    producers = nodes_by_output(model)
    q = producers["t_quantized_1"]
    assert (q.op_type, q.name, list(q.input)) == (
        "QuantizeLinear",
        "t_QuantizeLinear_1",
        ["t", "t_scale_1", "t_zero_point"],
    )
    assert producers["t_dequantized_1"].name == "t_DequantizeLinear"
    run(model, case.feed)  # still a valid, runnable model


def test_name_allocator_counts_past_taken_names() -> None:
    names = NameAllocator(["a", "a_1", "b"])
    assert [names.allocate("a"), names.allocate("a"), names.allocate("c"), names.allocate("c")] == [
        "a_2",
        "a_3",
        "c",
        "c_1",
    ]
    assert "a_3" in names and "" not in NameAllocator([""])


def test_half_precision_tensors_get_half_precision_scales() -> None:
    w = np.arange(-6, 6, dtype=np.float16).reshape(3, 4)
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["i"], name="identity"),
            helper.make_node("MatMul", ["i", "W"], ["y"], name="mm"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    x_params = make_qparams(TensorProto.UINT8, 0.01, 128)
    weight = QuantizedWeight(w.astype(np.int8), make_qparams(TensorProto.INT8, 1.0, 0))
    quantize = InsertQDQ(
        plan({"x": ["identity"]}, [("W", "mm", "MatMul", None)]), {"x": x_params}, {"W": weight}
    )
    result = quantize(model).model
    assert initializer(result, "x_scale").dtype == np.float16
    assert initializer(result, "W_scale").dtype == np.float16
    x = np.array([[0.5, -0.3, 1.0], [0.123, 0.2, -2.0]], np.float16)
    codes = (
        np.clip(np.rint(x.astype(np.float32) / np.float32(np.float16(0.01))) + 128, 0, 255) - 128
    )
    expected = (codes * np.float16(0.01)).astype(np.float16) @ w
    np.testing.assert_allclose(run(result, {"x": x})["y"], expected, rtol=2e-3)
    model.opset_import[0].version = 13
    with pytest.raises(ModelError, match="below 19, needed by activation 'x'"):
        quantize(model)


def test_a_checker_failure_names_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    case = cnn_case()

    def refuse(model: onnx.ModelProto) -> None:
        raise onnx.checker.ValidationError("bad zero point\nmore detail")

    monkeypatch.setattr(onnx.checker, "check_model", refuse)
    with pytest.raises(
        ModelError, match=r"^InsertQDQ: wrote a model that fails onnx.checker: bad zero point$"
    ):
        case.insert()
