"""A ConvTranspose written as the Conv of its stride's phases and their interleaving computes
what onnxruntime's own ConvTranspose does, for strides, kernels, pads, output paddings, groups
and biases, 1-D and 2-D; forms it does not cover, and those of too few products per output
element to pay, are left as they are; in a calibration, the rewritten one runs in integers."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qcal.graph.passes.conv_transpose_as_conv import ConvTransposeAsConv


def _model(rank: int, channels: tuple[int, int], kernel: int, stride: int, pads: tuple[int, int],
           extra: int, group: int, bias: bool, rng: np.random.Generator,
           **attributes: object) -> onnx.ModelProto:
    c_in, c_out = channels
    weight = rng.standard_normal((c_in, c_out // group, *[kernel] * rank)).astype(np.float32)
    initializers = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if bias:
        initializers.append(numpy_helper.from_array(
            rng.standard_normal(c_out).astype(np.float32), "b"))
        inputs.append("b")
    spatial = ["L"] if rank == 1 else ["H", "W"]
    node = helper.make_node("ConvTranspose", inputs, ["y"], name="up", group=group,
                            strides=[stride] * rank, pads=[pads[0]] * rank + [pads[1]] * rank,
                            output_padding=[extra] * rank, **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, *spatial])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                       ["N", c_out, *[f"{d}_up" for d in spatial]])],
        initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


_CASES = [  # rank, (c_in, c_out), kernel, stride, pads, output_padding, group, bias
    *[(rank, (4, 6), kernel, stride, pads, extra, 1, True)
      for rank, kernel, stride in itertools.product((1, 2), (1, 2, 3, 4, 5), (1, 2, 3))
      for pads, extra in (((0, 0), 0), ((1, 1), 0), ((kernel // 2, kernel - 1), stride - 1),
                          ((kernel - 1, 0), 0))],
    (2, (4, 6), 4, 2, (1, 1), 0, 2, False),   # groups
    (2, (6, 6), 3, 2, (1, 1), 1, 6, True),    # depthwise
    (1, (4, 8), 16, 8, (4, 4), 0, 1, True),   # a vocoder's upsampler
    (1, (4, 4), 7, 3, (0, 5), 2, 4, False),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_conv_of_phases_computes_the_conv_transpose(
        case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    """Every form, however few its products (those stay float in use: below)."""
    import qcal.graph.passes.conv_transpose_as_conv as module

    monkeypatch.setattr(module, "_pays", lambda channels, axes: True)
    rank, channels, kernel, stride, pads, extra, group, bias = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    model = _model(rank, channels, kernel, stride, pads, extra, group, bias, rng)
    x = rng.standard_normal((2, channels[0], *[5, 7][:rank])).astype(np.float32)
    expected = _run(model, x)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    result = ConvTransposeAsConv()(rewritten)
    assert result.modified
    onnx.checker.check_model(result.model, full_check=True)
    ops = [n.op_type for n in result.model.graph.node]
    assert "ConvTranspose" not in ops and ops[0] == "Conv"
    assert result.model.graph.node[0].name == "up"
    got = _run(result.model, x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # the same model serves inputs of other lengths
    other = rng.standard_normal((1, channels[0], *[9, 4][:rank])).astype(np.float32)
    np.testing.assert_allclose(_run(result.model, other), _run(model, other), rtol=1e-5,
                               atol=1e-5 * np.abs(_run(model, other)).max())


@pytest.mark.parametrize(("rank", "kernel", "stride", "extra", "mode"), [
    (2, 4, 2, 0, "SAME_UPPER"), (2, 3, 1, 0, "SAME_LOWER"), (2, 2, 2, 0, "SAME_UPPER"),
    (1, 16, 8, 0, "SAME_UPPER"), (1, 5, 2, 1, "SAME_LOWER"),
])
def test_same_pads_of_an_even_total_are_written_as_convs(
        rank: int, kernel: int, stride: int, extra: int, mode: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """auto_pad SAME (paddle2onnx's padding="same"): an output of input x stride, padded by
    kernel - stride + output padding, half on each side where that is even."""
    import qcal.graph.passes.conv_transpose_as_conv as module

    monkeypatch.setattr(module, "_pays", lambda channels, axes: True)
    rng = np.random.default_rng(kernel * 10 + stride)
    model = _model(rank, (4, 6), kernel, stride, (0, 0), extra, 1, True, rng)
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != "pads"]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("auto_pad", mode)])
    x = rng.standard_normal((1, 4, *[6, 5][:rank])).astype(np.float32)
    expected = _run(model, x)
    assert expected.shape[2:] == tuple(d * stride for d in x.shape[2:])
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert ConvTransposeAsConv()(rewritten).modified
    np.testing.assert_allclose(_run(rewritten, x), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("attributes", [
    {"auto_pad": "SAME_UPPER", "pads": None},  # kernel 3, stride 2: an odd total pad
    {"output_shape": [11, 11], "pads": None},
    {"dilations": [2, 2]}, {"strides": [1, 2]},
])
def test_forms_it_does_not_cover_stay(attributes: dict) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(0)
    model = _model(2, (4, 4), 3, 2, (1, 1), 0, 1, True, rng)
    node = model.graph.node[0]
    for name, value in attributes.items():
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept)
        if value is not None:
            node.attribute.append(helper.make_attribute(name, value))
    if "output_shape" in attributes or "auto_pad" in attributes:
        kept = [a for a in node.attribute if a.name != "output_padding"]
        del node.attribute[:]
        node.attribute.extend(kept)
    assert not ConvTransposeAsConv()(model).modified
    assert [n.op_type for n in model.graph.node] == ["ConvTranspose"]


@pytest.mark.parametrize(("rank", "c_in", "kernel", "rewritten"), [
    (2, 16, 2, False), (2, 24, 2, False),    # a text detector's upsamplers: 16 and 24 a position
    (2, 16, 4, False), (2, 32, 4, True),     # 64 and 128
    (2, 128, 2, True), (1, 16, 4, True),     # 128; 1-D, 32
    (1, 8, 4, False),                        # 16
    (1, 96, 5, False), (1, 96, 8, True),     # 1-D: stride 5, stride 4 (below)
])
def test_those_of_few_products_per_output_stay(rank: int, c_in: int, kernel: int,
                                               rewritten: bool) -> None:
    """Too few products per output element, or a 1-D stride whose interleaving onnxruntime
    transposes slowly (not a power of two)."""
    stride = 5 if kernel == 5 else 4 if kernel == 8 else 2
    pads = (0, 0) if kernel == 5 else (kernel // 2 - 1, kernel // 2 - 1)
    model = _model(rank, (c_in, 8), kernel, stride, pads, 0, 1, True, np.random.default_rng(5))
    assert ConvTransposeAsConv()(model).modified == rewritten


def _decoder(folder, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    """Conv -> Relu -> ConvTranspose (64 to 32 channels, kernel 4, stride 2: 256 products an
    output element) -> Relu -> Conv, and 24 calibration samples."""
    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="c1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("ConvTranspose", ["r1", "wt", "bt"], ["t"], name="up", strides=[2, 2],
                         pads=[1] * 4),
        helper.make_node("Relu", ["t"], ["r2"]),
        helper.make_node("Conv", ["r2", "w2"], ["y"], name="c2", pads=[1] * 4),
    ]
    initializers = [numpy_helper.from_array(a, n) for n, a in (
        ("w1", weight(64, 16, 3, 3)), ("wt", weight(64, 32, 4, 4) * 2),
        ("bt", rng.standard_normal(32).astype(np.float32) * 0.1), ("w2", weight(8, 32, 3, 3)))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 24, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 48, 48])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              folder / "decoder.onnx")
    np.savez(folder / "calib.npz",
             x=np.abs(rng.standard_normal((24, 1, 16, 24, 24))).astype(np.float32))


def test_a_calibrated_decoder_runs_its_upsampling_in_integers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Placement auto: the ConvTranspose is a quantized Conv whose integer kernel onnxruntime
    runs (the whole of the compute counted), and the model computes what the float one does
    within 8-bit error; emulation (--placement all) keeps the ConvTranspose."""
    import json

    from click.testing import CliRunner

    from qcal.cli import main

    _decoder(tmp_path, np.random.default_rng(7))
    for placement, name in (("auto", "q.onnx"), ("all", "all.onnx")):
        result = CliRunner().invoke(main, [
            "calibrate", str(tmp_path / "decoder.onnx"), "--data", str(tmp_path / "calib.npz"),
            "-o", str(tmp_path / name), "--placement", placement, "--allow-slower",
            "--min-coverage", "0"])
        assert result.exit_code == 0, result.output
    quantized = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(quantized, full_check=True)
    ops = [n.op_type for n in quantized.graph.node]
    assert "ConvTranspose" not in ops and "DepthToSpace" in ops
    (up,) = [n for n in quantized.graph.node if n.name == "up"]
    assert up.op_type == "Conv"
    report = json.loads((tmp_path / "q.qcal.json").read_text())
    assert report["coverage"]["macs_quantized_fraction"] == 1.0
    x = np.load(tmp_path / "calib.npz")["x"][0]
    float_y = _run(onnx.load(tmp_path / "decoder.onnx"), x)
    error = _run(quantized, x) - float_y
    assert 10 * np.log10(np.sum(float_y**2) / np.sum(error**2)) > 25.0
    emulated = onnx.load(tmp_path / "all.onnx")
    assert "ConvTranspose" in [n.op_type for n in emulated.graph.node]
