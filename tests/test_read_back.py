"""What qcal reports as quantized is what onnxruntime runs in integers, in every form of graph.

The read-back check (qcal.accuracy.runnable) finds the planned weights onnxruntime's optimized
graph still dequantizes into a float Conv/MatMul/Gemm. These cases hide that behind a Cast
(a Cast to float16 before a Conv: onnxruntime's CPU kernels take float32, so it casts the
dequantized weight and runs the float kernel) or inside an If branch (onnxruntime fuses nothing across a body's edge).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from onnx import TensorProto, helper

from qcal.config import CalibrationConfig
from qcal.pipeline import CalibrationResult, calibrate


def _calibrate(model: onnx.ModelProto, tmp_path: Path, feeds: dict[str, np.ndarray]) -> CalibrationResult:
    """Calibrated as planned (no fallback): what onnxruntime runs of the plan is under test,
    not the floor, which these random-weight models' pooled values may miss."""
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", **feeds)
    config = CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", fallback=False)
    return calibrate(tmp_path / "m.onnx", config, enforce_gates=False)


def _ops_run(model: onnx.ModelProto, folder: Path) -> Counter[str]:
    """Op types of every graph onnxruntime runs after its optimizations, bodies included."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(folder / "optimized.onnx")
    graphs = [optimized.graph]
    ops: Counter[str] = Counter()
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            ops[node.op_type] += 1
            graphs += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    return ops


def _outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def _weights(rng: np.random.Generator, dtype: type) -> dict[str, np.ndarray]:
    return {"w1": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(dtype),
            "w2": (rng.standard_normal((4, 8, 3, 3)) * 0.3).astype(dtype)}


def test_a_float16_model_runs_its_convolutions_in_integers_as_reported(tmp_path: Path) -> None:
    """Conv -> Relu -> Conv -> Relu in float16: onnxruntime's CPU provider has integer kernels
    for float32 graphs only, so the model is computed in float32 inside (its float16 input and
    output cast at the edges) and both Convs run as QLinearConv, as the report says."""
    rng = np.random.default_rng(20)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Cast", ["r2"], ["y"], name="to_float", to=TensorProto.FLOAT),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 8, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = build_model(nodes, [x], [y], _weights(rng, np.float16))
    data = rng.standard_normal((8, 8, 8, 8)).astype(np.float16)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["conv1"]["quantized"] and decisions["conv2"]["quantized"]
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == 2 == result.report["coverage"]["quantized_compute_nodes"], ops
    assert [g.option for g in result.gates if not g.passed] == []
    got = _outputs(result.model, {"x": data[:2]})
    expected = _outputs(model, {"x": data[:2]})
    assert got.dtype == np.float32 and np.corrcoef(got.ravel(), expected.ravel())[0, 1] > 0.99


def test_convolutions_inside_if_branches_are_not_reported_as_integer(tmp_path: Path) -> None:
    """A Conv -> Relu, then an If whose branches each hold a Conv: onnxruntime runs the branch
    Convs in float on dequantized weights, so they are kept float (and say why). The first
    Conv's only readers are then float ones inside the branches: they read its
    DequantizeLinear from the outer scope, so that it still runs as QLinearConv."""
    rng = np.random.default_rng(21)
    weights = _weights(rng, np.float32)

    def branch(name: str, scale: float) -> onnx.GraphProto:
        w = helper.make_tensor(f"{name}_w", TensorProto.FLOAT, [4, 8, 3, 3],
                               (weights["w2"] * scale).ravel().tolist())
        conv = helper.make_node("Conv", ["r1", f"{name}_w"], [f"{name}_out"], name=f"{name}_conv",
                                pads=[1, 1, 1, 1])
        return helper.make_graph([conv], name, [], [helper.make_tensor_value_info(
            f"{name}_out", TensorProto.FLOAT, None)], [w])

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("If", ["flag"], ["y"], name="choose",
                         then_branch=branch("then", 1.0), else_branch=branch("else", -0.5)),
    ]
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8]), flag], ["y"],
                        {"w1": weights["w1"]})
    feeds = {"x": rng.standard_normal((8, 8, 8, 8)).astype(np.float32),
             "flag": np.array([True, False] * 4)}
    result = _calibrate(model, tmp_path, feeds)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    for name in ("then_conv", "else_conv"):
        assert not decisions[name]["quantized"], decisions[name]
        assert "onnxruntime runs it in float" in decisions[name]["reason"]
    integer = sum(d["quantized"] for d in decisions.values() if d["op_type"] == "Conv")
    assert decisions["conv1"]["quantized"] and integer == 1
    assert _ops_run(result.model, tmp_path)["QLinearConv"] == integer
    assert result.report["coverage"]["quantized_compute_nodes"] == integer
    # The branches' work is not in the figure, and the report says so.
    assert result.report["coverage"]["note"].startswith(
        "2 Conv/MatMul/Gemm nodes inside If/Loop/Scan bodies are not counted (0 of them")
    # Both branches compute with what the integer Conv wrote: outputs close to float.
    feeds = {"x": np.random.default_rng(22).standard_normal((2, 8, 8, 8)).astype(np.float32)}
    for flag in (True, False):
        got = _outputs(result.model, {**feeds, "flag": np.array(flag)})
        want = _outputs(model, {**feeds, "flag": np.array(flag)})
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_node_keeps_what_calibration_said_when_another_is_kept_float(tmp_path: Path) -> None:
    """Two paths: a ConvTranspose, which onnxruntime's CPU provider runs in float on its
    dequantized weight (so the read-back keeps it float and plans again), and a MatMul whose
    input is a million times below the preset's smallest step (left float after calibration).
    Planning again for the first must not drop what calibration said of the second: its
    decision still names its float input, as coverage (which does not count it) implies."""
    rng = np.random.default_rng(23)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "wt"], ["y1"], name="deconv"),
        helper.make_node("Mul", ["v", "tiny_factor"], ["tiny"], name="shrink"),
        helper.make_node("MatMul", ["tiny", "w"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["y2"], name="relu"),
    ]
    weights = {
        "wt": (rng.standard_normal((3, 4, 3, 3)) * 0.3).astype(np.float32),
        "tiny_factor": np.array(1e-9, dtype=np.float32),
        "w": (rng.standard_normal((16, 8)) * 0.3).astype(np.float32),
    }
    model = build_model(nodes, [float_input("x", ["N", 3, 8, 8]), float_input("v", ["N", 16])],
                        ["y1", "y2"], weights)
    feeds = {"x": rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
             "v": rng.standard_normal((8, 16)).astype(np.float32)}
    result = _calibrate(model, tmp_path, feeds)
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert not decisions["deconv"]["quantized"]
    assert "onnxruntime runs it in float" in decisions["deconv"]["reason"]
    assert "input 'tiny' left float" in decisions["mm"]["reason"], decisions["mm"]
    assert "smallest scale the preset allows" in decisions["mm"]["reason"]
    assert result.report["coverage"]["quantized_compute_nodes"] == 0


@pytest.mark.parametrize(("then", "integer"), [("Resize", 2), ("Relu", 3), ("MaxPool", 3)])
def test_a_narrow_grouped_convolution_runs_in_float_between_integer_ones(
    tmp_path: Path, then: str, integer: int
) -> None:
    """A depth multiplier of 2 (one input, two output channels per group) between two Convs.
    Upsampled by a Resize before the next Conv it stays float: onnxruntime runs the other two
    as QLinearConv. Read by the next Conv through a Relu or a MaxPool, onnxruntime would
    quantize its weight itself (per tensor) and run it as QLinearConv all the same: qcal
    quantizes it, per channel. Either way the report
    counts what onnxruntime runs in integers, and the outputs stay close to the float model's."""
    rng = np.random.default_rng(24)
    after = {
        "MaxPool": helper.make_node("MaxPool", ["g1"], ["r2"], name="pool", kernel_shape=[1, 1]),
        "Relu": helper.make_node("Relu", ["g1"], ["r2"], name="relu2"),
        "Resize": helper.make_node("Resize", ["g1", "", "scales"], ["r2"], name="upsample",
                                   mode="linear"),
    }[then]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wg"], ["g1"], name="multiplier", group=8,
                         pads=[1, 1, 1, 1]),
        after,
        helper.make_node("Conv", ["r2", "w2"], ["c3"], name="pointwise"),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="average"),
    ]
    weights = {"w1": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
               "wg": (rng.standard_normal((16, 1, 3, 3)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((4, 16, 1, 1)) * 0.3).astype(np.float32),
               "scales": np.array([1, 1, 2, 2], dtype=np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["y"], weights)
    data = rng.standard_normal((16, 8, 12, 12)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decision = next(n for n in result.report["nodes"] if n["name"] == "multiplier")
    assert decision["quantized"] is (integer == 3)
    if integer == 2:
        assert "grouped convolution with 1 input and 2 output channels" in decision["reason"]
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == integer == result.report["coverage"]["quantized_compute_nodes"]
    onnx.checker.check_model(result.model, full_check=True)
    got, want = _outputs(result.model, {"x": data[:4]}), _outputs(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


def test_a_stack_of_weight_matrices_is_quantized_per_tensor_and_runs_in_integers(
    tmp_path: Path,
) -> None:
    """A grouped linear layer (ConvBERT's: a MatMul of [groups, tokens, k] by a constant
    [groups, k, n]): onnxruntime's integer MatMul takes per-column scales for a 2-D B only and
    failed at run time on the stack, which was then kept float. Per tensor, it runs as an
    integer kernel, counted as such, with outputs close to float."""
    rng = np.random.default_rng(25)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], name="split_groups", perm=[1, 0, 2]),
        helper.make_node("MatMul", ["xt", "w"], ["m"], name="grouped"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["rt"], name="join_groups", perm=[1, 0, 2]),
        helper.make_node("MatMul", ["rt", "w2"], ["y"], name="head"),
    ]
    weights = {"w": (rng.standard_normal((6, 16, 12)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((12, 4)) * 0.3).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 6, 16])], ["y"], weights)
    data = rng.standard_normal((32, 6, 16)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    stack = next(t for t in result.report["tensors"] if t["name"] == "w")
    assert stack["qparams"]["axis"] is None  # per tensor
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["grouped"]["quantized"], decisions["grouped"]
    assert result.report["coverage"]["quantized_compute_nodes"] == 2
    ran = _ops_run(result.model, tmp_path)
    assert ran["MatMulIntegerToFloat"] + ran["QLinearMatMul"] == 2, ran
    feed = {"x": data[:4]}
    got, want = _outputs(result.model, feed), _outputs(model, feed)
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("between", ["Relu", "MaxPool"])
def test_a_conv_kept_float_between_quantized_neighbours_is_reported_as_integer(
    tmp_path: Path, between: str,
) -> None:
    """A Conv excluded by name between two quantized Convs (through a Relu, or a MaxPool that
    onnxruntime moves the QuantizeLinear up through): onnxruntime quantizes its weight itself
    (per tensor) when it loads the model, and runs it as QLinearConv. The report says so in its
    decision and a warning, and counts it as integer compute, as onnxruntime runs it; excluding
    its input tensor too keeps it float indeed."""
    rng = np.random.default_rng(26)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="middle", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2") if between == "Relu" else
        helper.make_node("MaxPool", ["c2"], ["r2"], name="max", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="pool"),
    ]
    weights = {"w1": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
               "w3": (rng.standard_normal((4, 8, 1, 1)) * 0.3).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 8, 8, 8])], ["y"], weights)
    data = rng.standard_normal((16, 8, 8, 8)).astype(np.float32)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=data)
    for exclude_tensors, integer in (((), 3), (("r1",), 2)):
        config = CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", exclude_nodes=("middle",),
                                   exclude_tensors=exclude_tensors)
        result = calibrate(tmp_path / "m.onnx", config, enforce_gates=False)
        middle = next(n for n in result.report["nodes"] if n["name"] == "middle")
        assert not middle["quantized"]
        said = "onnxruntime quantizes its weight itself" in middle["reason"]
        warned = any("onnxruntime quantizes 1 Conv/Gemm node that qcal keeps float ('middle')"
                     in w for w in result.report["warnings"])
        assert said is warned is (integer == 3), (middle, result.report["warnings"])
        ran = _ops_run(result.model, tmp_path)
        assert ran["QLinearConv"] == integer == \
            result.report["coverage"]["quantized_compute_nodes"], ran


@pytest.mark.parametrize("channels", [1, 3, 7])
def test_a_stem_with_few_input_channels_runs_in_float_before_integer_convolutions(
    tmp_path: Path, channels: int
) -> None:
    """A Conv of one group with fewer than 8 input channels (an image's stem) stays float under
    placement "auto": onnxruntime's integer kernel for it, with the QuantizeLinear of the model's
    input, costs more than its float one. The input is not quantized at all, the Convs after it
    run in integers, and the report counts what runs so."""
    rng = np.random.default_rng(26)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((16, channels, 3, 3)) * 0.4).astype(np.float32),
               "w1": (rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32),
               "w2": (rng.standard_normal((8, 16, 3, 3)) * 0.2).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", channels, 16, 16])], ["y"], weights)
    data = rng.standard_normal((16, channels, 16, 16)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert not decisions["stem"]["quantized"]
    assert decisions["stem"]["reason"].startswith(
        f"placement auto: a convolution with {channels} input channel")
    assert decisions["conv1"]["quantized"] and decisions["conv2"]["quantized"]
    assert "x" not in {t["name"] for t in result.report["tensors"]}
    assert not [n for n in result.model.graph.node if "x" in n.input and n.op_type != "Conv"]
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == 2 == result.report["coverage"]["quantized_compute_nodes"]
    got, want = _outputs(result.model, {"x": data[:4]}), _outputs(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("pool_is_an_output", [False, True])
def test_a_stem_before_a_max_pool_is_quantized_so_the_pool_runs_channels_last(
    tmp_path: Path, pool_is_an_output: bool
) -> None:
    """A 3-channel 3x3 stem, Relu, MaxPool, then integer Convs (SqueezeNet 1.1, ShuffleNetV2):
    with the stem float, onnxruntime moves the MaxPool's QuantizeLinear up through it and runs
    the MaxPool on uint8 in its channels-first loop, many times its float kernel. So the stem
    is quantized, and onnxruntime runs the MaxPool in its channels-last integer kernel. Where
    the MaxPool's output is also read in float (here a model output), no QuantizeLinear moves
    and the stem stays float."""
    rng = np.random.default_rng(31)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("MaxPool", ["r0"], ["p0"], name="pool0", kernel_shape=[3, 3],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p0", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((16, 3, 3, 3)) * 0.4).astype(np.float32),
               "w1": (rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32),
               "w2": (rng.standard_normal((8, 16, 3, 3)) * 0.2).astype(np.float32)}
    outputs = ["y", "p0"] if pool_is_an_output else ["y"]
    model = build_model(nodes, [float_input("x", ["N", 3, 32, 32])], outputs, weights)
    data = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert decisions["stem"]["quantized"] is not pool_is_an_output, decisions["stem"]
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == 3 - pool_is_an_output
    assert ops["QLinearConv"] == result.report["coverage"]["quantized_compute_nodes"]
    if not pool_is_an_output:
        assert ops["NhwcMaxPool"] == 1 and ops["MaxPool"] == 0, ops
    got, want = _outputs(result.model, {"x": data[:4]}), _outputs(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


def test_a_3d_stem_before_a_max_pool_stays_float(tmp_path: Path) -> None:
    """The 3-D form of the stem above (a video network's: 3 channels, 3x3x3, then a MaxPool):
    onnxruntime's integer kernel for so narrow a 3-D Conv costs more than the channels-first
    uint8 MaxPool its float form leads to, so the stem stays float, saying why, and the Convs
    after it run in integers."""
    rng = np.random.default_rng(33)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1] * 6),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("MaxPool", ["r0"], ["p0"], name="pool0", kernel_shape=[1, 2, 2],
                         strides=[1, 2, 2]),
        helper.make_node("Conv", ["p0", "w1"], ["c1"], name="conv1", pads=[1] * 6),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1] * 6),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((16, 3, 3, 3, 3)) * 0.3).astype(np.float32),
               "w1": (rng.standard_normal((16, 16, 3, 3, 3)) * 0.1).astype(np.float32),
               "w2": (rng.standard_normal((8, 16, 3, 3, 3)) * 0.1).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 3, 4, 16, 16])], ["y"], weights)
    data = rng.standard_normal((8, 3, 4, 16, 16)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert not decisions["stem"]["quantized"]
    assert decisions["stem"]["reason"].startswith("placement auto: a convolution with 3 input")
    assert decisions["conv1"]["quantized"] and decisions["conv2"]["quantized"]
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == 2 == result.report["coverage"]["quantized_compute_nodes"]
    got, want = _outputs(result.model, {"x": data[:4]}), _outputs(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


def test_a_narrow_convolution_between_integer_ones_is_quantized(tmp_path: Path) -> None:
    """A Conv of 4 input channels read from a quantized Conv and writing straight (through a
    Relu) into another: onnxruntime would quantize its weight itself, per tensor, and run its
    integer kernel anyway, so qcal quantizes it, per channel."""
    rng = np.random.default_rng(27)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="wide", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="narrow", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="last", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((4, 8, 3, 3)) * 0.3).astype(np.float32),
               "w1": (rng.standard_normal((16, 4, 3, 3)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((8, 16, 3, 3)) * 0.2).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 8, 12, 12])], ["y"], weights)
    data = rng.standard_normal((16, 8, 12, 12)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["wide"] and decisions["narrow"] and decisions["last"]
    assert _ops_run(result.model, tmp_path)["QLinearConv"] == 3


def test_a_narrow_convolution_on_a_pooled_vector_keeps_the_chain_in_integers(
        tmp_path: Path) -> None:
    """A squeeze-excitation whose excitation Conv reads 4 channels of a pooled vector (PP-OCR's
    RSE-FPN): one output position, next to no work, so no kernel is slower, but kept float it
    would leave its HardSigmoid, the Mul scaling the feature map and what follows in float
    between integer Convs. It is quantized with them; a stem of as few channels on a map stays
    float (above)."""
    rng = np.random.default_rng(29)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="wide", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("GlobalAveragePool", ["r0"], ["p"], name="squeeze"),
        helper.make_node("Conv", ["p", "w1"], ["s1"], name="reduce"),
        helper.make_node("Relu", ["s1"], ["s2"], name="relu1"),
        helper.make_node("Conv", ["s2", "w2"], ["s3"], name="excite"),
        helper.make_node("HardSigmoid", ["s3"], ["s4"], name="gate"),
        helper.make_node("Mul", ["r0", "s4"], ["m"], name="scale"),
        helper.make_node("Conv", ["m", "w3"], ["c3"], name="last", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((16, 8, 3, 3)) * 0.3).astype(np.float32),
               "w1": (rng.standard_normal((4, 16, 1, 1)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((16, 4, 1, 1)) * 0.3).astype(np.float32),
               "w3": (rng.standard_normal((8, 16, 3, 3)) * 0.2).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 8, 24, 24])], ["y"], weights)
    data = rng.standard_normal((16, 8, 24, 24)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n for n in result.report["nodes"]}
    assert all(decisions[name]["quantized"] for name in ("wide", "reduce", "excite", "gate",
                                                           "scale", "last")), decisions
    assert decisions["excite"]["reason"].startswith("Conv rule")
    ops = _ops_run(result.model, tmp_path)
    assert ops["QLinearConv"] == 4 == result.report["coverage"]["quantized_compute_nodes"]
    assert ops["HardSigmoid"] == 0 and ops["Mul"] == 0, ops
    got, want = _outputs(result.model, {"x": data[:4]}), _outputs(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


def test_a_one_dimensional_stem_on_a_waveform_runs_in_integers(tmp_path: Path) -> None:
    """The narrow-stem rule is for 2-D Convs (onnxruntime's float kernel for them has blocked
    channels): a 1-D Conv of one input channel with a long kernel runs faster in integers."""
    rng = np.random.default_rng(28)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[38, 38], strides=[4]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1", pads=[1, 1]),
        helper.make_node("GlobalAveragePool", ["c1"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((16, 1, 80)) * 0.1).astype(np.float32),
               "w1": (rng.standard_normal((16, 16, 3)) * 0.2).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 1, 800])], ["y"], weights)
    data = rng.standard_normal((8, 1, 800)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["stem"] and decisions["conv1"]
    assert _ops_run(result.model, tmp_path)["QLinearConv"] == 2


@pytest.mark.parametrize(("kernel", "quantized"), [(3, False), (5, False), (8, True), (16, True)])
def test_a_stem_with_a_large_kernel_runs_in_integers(tmp_path: Path, kernel: int,
                                                     quantized: bool) -> None:
    """Few input channels but many taps per channel (a ViT's patch embedding: 3 channels,
    16x16, stride 16) make a long enough product for the integer kernel to pay; a 3x3 or 5x5
    stem stays float."""
    rng = np.random.default_rng(29)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", strides=[kernel, kernel]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c1"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((32, 3, kernel, kernel)) * 0.1).astype(np.float32),
               "w1": (rng.standard_normal((16, 32, 3, 3)) * 0.1).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 3, 64, 64])], ["y"], weights)
    data = rng.standard_normal((8, 3, 64, 64)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert decisions["stem"] is quantized and decisions["conv1"]
    assert _ops_run(result.model, tmp_path)["QLinearConv"] == 1 + quantized


def test_a_three_dimensional_stem_runs_in_float(tmp_path: Path) -> None:
    """A volume's first Conv3d of one channel, 3x3x3: onnxruntime's integer kernel took 15x its
    float one on a 3-D UNet."""
    rng = np.random.default_rng(30)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1] * 6),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1", pads=[1] * 6),
        helper.make_node("GlobalAveragePool", ["c1"], ["y"], name="pool"),
    ]
    weights = {"w0": (rng.standard_normal((8, 1, 3, 3, 3)) * 0.3).astype(np.float32),
               "w1": (rng.standard_normal((8, 8, 3, 3, 3)) * 0.2).astype(np.float32)}
    model = build_model(nodes, [float_input("x", ["N", 1, 8, 8, 8])], ["y"], weights)
    data = rng.standard_normal((8, 1, 8, 8, 8)).astype(np.float32)
    result = _calibrate(model, tmp_path, {"x": data})
    decisions = {n["name"]: n["quantized"] for n in result.report["nodes"]}
    assert not decisions["stem"] and decisions["conv1"]
