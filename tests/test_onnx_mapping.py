"""ONNX mapping (SEMANTICS.md §7): types, clip bounds, exactness flags, degenerate replacement,
and, for every configuration flagged exact, equality with onnxruntime's QuantizeLinear ->
DequantizeLinear on the same tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from qcal.numerics.errors import ConfigError
from qcal.numerics.observers import MinMaxStats
from qcal.numerics.onnx_mapping import OnnxQParams, to_onnx_qparams
from qcal.numerics.presets import TensorRecipe, build_preset
from qcal.numerics.schemes import QParams, TorchScheme, compute_qparams

f32 = np.float32
_NUMPY_TYPES = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16}


# ---------------------------------------------------------------------------------------------
# onnxruntime reference: Max/Min (clip bounds) -> QuantizeLinear -> DequantizeLinear


@cache
def _session(dtype: int, axis: int | None, rank: int, opset: int) -> ort.InferenceSession:
    """One session per signature; scale, zero point and bounds are inputs, so it is reused."""
    dims = [f"d{i}" for i in range(rank)]
    per_axis: list[str | int] = [] if axis is None else ["c"]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
        helper.make_tensor_value_info("scale", TensorProto.FLOAT, per_axis),
        helper.make_tensor_value_info("zero_point", dtype, per_axis),
        helper.make_tensor_value_info("low", TensorProto.FLOAT, [f"l{i}" for i in range(rank)]),
        helper.make_tensor_value_info("high", TensorProto.FLOAT, [f"h{i}" for i in range(rank)]),
    ]
    attrs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("Max", ["x", "low"], ["above"]),
        helper.make_node("Min", ["above", "high"], ["clipped"]),
        helper.make_node("QuantizeLinear", ["clipped", "scale", "zero_point"], ["q"], **attrs),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero_point"], ["y"], **attrs),
    ]
    outputs = [
        helper.make_tensor_value_info("q", dtype, dims),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, dims),
    ]
    graph = helper.make_graph(nodes, "qdq", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _along(values: np.ndarray, rank: int, axis: int | None) -> np.ndarray:
    if axis is None:
        return np.reshape(values, (1,) * rank)
    shape = [1] * rank
    shape[axis] = -1
    return np.reshape(values, shape)


def _run_qdq(x: np.ndarray, onnx: OnnxQParams, opset: int) -> tuple[np.ndarray, np.ndarray]:
    rank = x.ndim
    low = (
        onnx.clip_min
        if onnx.clip_min is not None
        else np.full(onnx.scale.shape, -np.inf, np.float32)
    )
    high = (
        onnx.clip_max
        if onnx.clip_max is not None
        else np.full(onnx.scale.shape, np.inf, np.float32)
    )
    feeds = {
        "x": x,
        "scale": onnx.scale,
        "zero_point": onnx.zero_point,
        "low": _along(low, rank, onnx.axis).astype(np.float32),
        "high": _along(high, rank, onnx.axis).astype(np.float32),
    }
    q, y = _session(onnx.dtype, onnx.axis, rank, opset).run(["q", "y"], feeds)
    return np.asarray(q), np.asarray(y)


# ---------------------------------------------------------------------------------------------
# configurations flagged exact


@dataclass(frozen=True)
class _Config:
    name: str
    knobs: Mapping[str, object] = field(default_factory=dict)
    role: str = "activation"
    axis: int | None = None  # per-channel axis, None per tensor
    opset: int = 13
    # The API multiplies by a reciprocal (PyTorch f32(1/s), TF's multiplier) or rounds x/s + zp
    # as a whole (OneFlow affine): one code apart from ONNX within an ulp of a .5 tie (§7).
    near_ties_differ: bool = False
    range_given: bool = False


_EXACT = [
    _Config("pytorch", near_ties_differ=True),
    _Config("pytorch-symmetric", near_ties_differ=True),
    _Config("pytorch-symmetric", {"dtype": "quint8"}, near_ties_differ=True),
    _Config("pytorch", role="weight", axis=0, near_ties_differ=True),
    _Config("pytorch", {"reduce_range": True}, near_ties_differ=True),
    _Config(
        "pytorch",
        {"dtype": "qint8", "qscheme": "per_tensor_symmetric", "quant_min": -8, "quant_max": 7},
        near_ties_differ=True,
    ),
    _Config("pytorch", {"qscheme": "per_channel_affine"}, axis=1, near_ties_differ=True),
    _Config("tensorflow", near_ties_differ=True),
    _Config("tensorflow", {"narrow_range": True, "num_bits": 4}, near_ties_differ=True),
    _Config("tensorflow", role="weight", axis=1, near_ties_differ=True),
    _Config("tensorflow", {"range_given": True}, near_ties_differ=True, range_given=True),
    _Config("oneflow-google"),
    _Config("oneflow-google", {"quantization_bit": 4}),
    _Config("oneflow-google", {"quantization_scheme": "affine"}, near_ties_differ=True),
    _Config("oneflow-google", role="weight", axis=0),
    _Config("oneflow-cambricon"),
    _Config("horizon-rne"),
    _Config("horizon-rne", role="weight", axis=0),
    _Config("horizon-rne", {"dtype": "qint16"}, opset=21),
    _Config("horizon-rne", {"dtype": "quint4"}),
]

_SHAPE = (3, 4, 6)


def _ranges(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    magnitude = 10.0 ** rng.uniform(-3, 3, size=count)
    a = rng.uniform(-1.0, 1.0, size=count) * magnitude
    b = rng.uniform(-1.0, 1.0, size=count) * magnitude
    return np.minimum(a, b).astype(np.float32), np.maximum(a, b).astype(np.float32)


def _data(
    rng: np.random.Generator, qparams: QParams, low: np.ndarray, high: np.ndarray, inside: bool
) -> np.ndarray:
    """Random values (some beyond the range), grid points and exact half-way points."""
    axis = qparams.axis
    low_b, high_b = _along(low, len(_SHAPE), axis), _along(high, len(_SHAPE), axis)
    width = high_b - low_b
    pad = 0.0 if inside else 0.25
    x = low_b - pad * width + rng.uniform(0.0, 1.0 + 2 * pad, size=_SHAPE) * width
    scale = _along(qparams.scale, len(_SHAPE), axis).astype(np.float64)
    zero_point = _along(qparams.zero_point, len(_SHAPE), axis).astype(np.float64)
    codes = rng.integers(qparams.quant_min - 2, qparams.quant_max + 3, size=_SHAPE)
    grid = (codes - zero_point + rng.choice([0.0, 0.5], size=_SHAPE)) * scale
    pick = rng.uniform(size=_SHAPE)
    x = np.where(pick < 0.3, grid, x)
    if inside:
        x = np.clip(x, low_b, high_b)
    return np.where(pick > 0.95, 0.0, x).astype(np.float32)


def _near_tie(x: np.ndarray, onnx: OnnxQParams) -> np.ndarray:
    t = x.astype(np.float64) / _along(onnx.scale, x.ndim, onnx.axis).astype(np.float64)
    distance = np.abs(t - np.floor(t) - 0.5)
    return np.asarray(distance <= 2.0**-20 * np.maximum(1.0, np.abs(t)))


@settings(max_examples=80, deadline=None)
@given(config=st.sampled_from(_EXACT), seed=st.integers(0, 2**32 - 1))
def test_exact_mappings_equal_onnxruntime(config: _Config, seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = _SHAPE[config.axis] if config.axis is not None else 1
    low, high = _ranges(rng, count)
    knobs = dict(config.knobs)
    if config.range_given:
        knobs.update(input_min=float(low[0]), input_max=float(high[0]))
    recipe: TensorRecipe = getattr(build_preset(config.name, knobs), config.role)
    if config.axis is None:
        stats = MinMaxStats(low[0], high[0])
    else:
        stats = MinMaxStats(low, high, config.axis)
    qparams = recipe.qparams(stats)
    onnx = recipe.to_onnx(qparams, opset=config.opset)
    if onnx.replacement is not None or any("clamped" in d for d in onnx.deviations):
        assert not onnx.exact  # degenerate range, or OneFlow zero point outside [0, 2^b-1]
        return
    assert onnx.exact, onnx.deviations
    # TensorFlow without a given range recomputes its range from each tensor, so data beyond the
    # calibration range has no TensorFlow meaning; keep it inside there.
    inside = config.name == "tensorflow" and not config.range_given
    x = _data(rng, qparams, low, high, inside)
    q, y = _run_qdq(x, onnx, config.opset)
    reference = recipe.fake_quantize(x, qparams)
    codes = recipe.quantize(x, qparams, opset=config.opset)
    compare = ~_near_tie(x, onnx) if config.near_ties_differ else np.ones(x.shape, dtype=bool)
    assert compare.mean() > 0.5  # the filter leaves most values in (about 85 % expected)
    np.testing.assert_array_equal(y[compare], reference[compare])
    np.testing.assert_array_equal(q[compare], codes[compare])


def test_int4_mapping_equals_onnxruntime() -> None:
    """qint4 at opset 21 maps to INT4 without clip bounds (zero point as an initializer)."""
    recipe = build_preset("horizon-rne", {"dtype": "qint4"}).activation
    qparams = recipe.qparams(MinMaxStats(f32(-1.3), f32(2.2)))
    onnx = recipe.to_onnx(qparams, opset=21)
    assert onnx.dtype == TensorProto.INT4 and onnx.clip_min is None and onnx.exact
    assert onnx.min_opset == 21
    x = np.linspace(-3.0, 3.0, 97, dtype=np.float32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero_point"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero_point"], ["y"]),
    ]
    initializers = [
        helper.make_tensor("scale", TensorProto.FLOAT, [], [float(onnx.scale)]),
        helper.make_tensor("zero_point", TensorProto.INT4, [], [int(onnx.zero_point)]),
    ]
    graph = helper.make_graph(
        nodes,
        "int4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [97])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [97])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": x})
    np.testing.assert_array_equal(y, recipe.fake_quantize(x, qparams))


@pytest.mark.parametrize(
    "name, knobs",
    [("horizon", {}), ("mindspore", {}), ("tensorflow", {"round_mode": "HALF_UP"})],
)
def test_half_up_flags_are_truthful(name: str, knobs: dict[str, object]) -> None:
    """Configurations flagged inexact for rounding really differ from ONNX at exact ties."""
    recipe = build_preset(name, knobs).activation
    qparams = recipe.qparams(MinMaxStats(f32(-8.0), f32(7.9375)))  # a power-of-two step
    onnx = recipe.to_onnx(qparams)
    assert not onnx.exact and any("half up" in d for d in onnx.deviations)
    step = float(onnx.scale)
    x = ((np.arange(-100, 100) + 0.5) * step).astype(np.float32)  # exact ties
    _, y = _run_qdq(x.reshape(1, -1), onnx, 13)
    assert np.any(y.ravel() != recipe.fake_quantize(x, qparams))


# ---------------------------------------------------------------------------------------------
# the table of §7


def test_default_types_and_opsets() -> None:
    activation = build_preset("pytorch").activation
    qparams = activation.qparams(MinMaxStats(f32(-1.0), f32(3.0)))
    onnx = activation.to_onnx(qparams)
    assert (onnx.dtype, onnx.axis, onnx.min_opset) == (TensorProto.UINT8, None, 10)
    assert onnx.zero_point.dtype == np.uint8 and onnx.zero_point == qparams.zero_point
    assert (
        onnx.clip_min is None and onnx.exact and onnx.deviations == () and onnx.replacement is None
    )
    weight = build_preset("pytorch").weight
    per_channel = weight.to_onnx(
        weight.qparams(MinMaxStats(np.array([-1.0, -2.0]), np.array([1.0, 0.5]), 0))
    )
    assert (per_channel.dtype, per_channel.axis, per_channel.min_opset) == (TensorProto.INT8, 0, 13)
    assert per_channel.zero_point.dtype == np.int8 and per_channel.scale.shape == (2,)


def test_narrow_ranges_use_clip_bounds_or_small_types() -> None:
    recipe = build_preset("pytorch", {"dtype": "qint8", "quant_min": -8, "quant_max": 7}).activation
    qparams = recipe.qparams(MinMaxStats(f32(-1.0), f32(3.0)))
    onnx = recipe.to_onnx(qparams)
    zp, scale = float(qparams.zero_point), qparams.scale
    assert onnx.dtype == TensorProto.INT8 and onnx.exact
    assert onnx.clip_min == f32(-8 - zp) * scale and onnx.clip_max == f32(7 - zp) * scale
    small = recipe.to_onnx(qparams, opset=21)
    assert small.dtype == TensorProto.INT4 and small.clip_min is None and small.min_opset == 21
    narrow = build_preset("tensorflow", {"narrow_range": True}).activation
    narrow_onnx = narrow.to_onnx(narrow.qparams(MinMaxStats(f32(-1.0), f32(1.0))), opset=21)
    assert narrow_onnx.dtype == TensorProto.INT8 and narrow_onnx.clip_min is not None


def test_sixteen_bit_needs_opset_21() -> None:
    recipe = build_preset("horizon", {"dtype": "qint16"}).activation
    qparams = recipe.qparams(MinMaxStats(f32(-1.0), f32(1.0)))
    with pytest.raises(ConfigError, match="opset 21"):
        recipe.to_onnx(qparams, opset=20)
    onnx = recipe.to_onnx(qparams, opset=21)
    assert (
        onnx.dtype == TensorProto.INT16
        and onnx.zero_point.dtype == np.int16
        and onnx.min_opset == 21
    )


def test_qint32_is_not_representable() -> None:
    scheme = TorchScheme.from_api(dtype="qint32", qscheme="per_tensor_symmetric")
    qparams = compute_qparams(MinMaxStats(f32(-1.0), f32(1.0)), scheme)
    with pytest.raises(ConfigError, match="qint32"):
        to_onnx_qparams(qparams, scheme)


def test_mindspore_mappings() -> None:
    default = build_preset("mindspore").activation
    qparams = default.qparams(MinMaxStats(f32(-2.0), f32(5.0)))
    onnx = default.to_onnx(qparams)
    assert onnx.dtype == TensorProto.INT8 and onnx.zero_point == qparams.zero_point
    assert not onnx.exact and len(onnx.deviations) == 2
    int4 = build_preset("mindspore", {"quant_dtype": "INT4"}).activation
    int4_params = int4.qparams(MinMaxStats(f32(-2.0), f32(5.0)))
    assert int4.to_onnx(int4_params).clip_min is not None
    assert int4.to_onnx(int4_params, opset=21).dtype == TensorProto.INT4
    learned = build_preset(
        "mindspore", {"mode": "LEARNED_SCALE", "symmetric": True, "neg_trunc": True}
    ).activation
    learned_onnx = learned.to_onnx(learned.qparams(MinMaxStats(f32(0.0), f32(2.0))))
    assert learned_onnx.dtype == TensorProto.UINT8 and learned_onnx.clip_min is None
    assert learned_onnx.scale == f32(2.0) / f32(255)
    signed = build_preset(
        "mindspore", {"mode": "LEARNED_SCALE", "symmetric": True, "narrow_range": True}
    ).activation
    signed_onnx = signed.to_onnx(signed.qparams(MinMaxStats(f32(-1.5), f32(1.5))))
    assert (
        signed_onnx.dtype == TensorProto.INT8 and signed_onnx.clip_min == -127 * signed_onnx.scale
    )


def test_tensorflow_unsigned_is_flagged() -> None:
    recipe = build_preset("tensorflow", {"signed_input": False}).activation
    onnx = recipe.to_onnx(recipe.qparams(MinMaxStats(f32(-1.0), f32(3.0))))
    assert onnx.dtype == TensorProto.UINT8 and not onnx.exact
    assert any("negative" in d for d in onnx.deviations)


def test_oneflow_zero_point_outside_the_grid_is_clamped_and_reported() -> None:
    recipe = build_preset("oneflow-google", {"quantization_scheme": "affine"}).activation
    qparams = recipe.qparams(MinMaxStats(f32(0.5), f32(2.7)))
    assert qparams.zero_point < 0  # OneFlow keeps -rne(min/scale) unclamped
    onnx = recipe.to_onnx(qparams)
    assert onnx.zero_point == 0 and not onnx.exact and "clamped" in onnx.deviations[0]
    above = recipe.to_onnx(recipe.qparams(MinMaxStats(f32(-2.7), f32(-0.5))))
    assert above.zero_point == 255


@pytest.mark.parametrize(
    "name, knobs, low, high",
    [
        ("oneflow-google", {}, 0.0, 0.0),  # scale 0
        ("oneflow-google", {"quantization_scheme": "affine"}, 1.25, 1.25),  # scale 0, zp -inf
        ("oneflow-cambricon", {}, 0.0, 0.0),  # log2(0)
        ("mindspore", {}, 0.0, 0.0),  # range [0, 0]
        ("tensorflow", {}, 0.0, 0.0),  # step 0
        ("tensorflow", {"signed_input": False}, -3.0, -1.0),  # negative step
    ],
)
def test_degenerate_parameters_are_replaced_and_reported(
    name: str, knobs: dict[str, object], low: float, high: float
) -> None:
    recipe = build_preset(name, knobs).activation
    qparams = recipe.qparams(MinMaxStats(f32(low), f32(high)))
    onnx = recipe.to_onnx(qparams)
    assert onnx.scale == 1.0 and onnx.zero_point == 0
    assert onnx.replacement is not None and "replaced" in onnx.replacement and not onnx.exact
    codes = recipe.quantize(np.array([0.0, 1.0, -1.0], dtype=np.float32), qparams)
    np.testing.assert_array_equal(codes, 0)


def test_per_channel_replacement_keeps_good_channels() -> None:
    recipe = build_preset("oneflow-google").weight
    qparams = recipe.qparams(MinMaxStats(np.array([0.0, -1.0]), np.array([0.0, 2.0]), 0))
    onnx = recipe.to_onnx(qparams)
    assert onnx.scale[0] == 1.0 and onnx.scale[1] == qparams.scale[1]
    assert onnx.replacement is not None and "1 of 2 channels" in onnx.replacement


def test_per_channel_parameters_need_an_axis() -> None:
    scheme = TorchScheme.from_api(dtype="qint8", qscheme="per_channel_symmetric")
    qparams = compute_qparams(MinMaxStats(np.array([-1.0, -2.0]), np.array([1.0, 2.0])), scheme)
    with pytest.raises(ConfigError, match="axis"):
        to_onnx_qparams(qparams, scheme)
