"""Models that draw random numbers when they run: qcal's runs give each random node fixed draws of
its distribution, so a run's statistics, figures and model do not change from one run to the
next and the comparison with the float model measures quantization; the model written still
draws at random."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.cli import main
from qcal.graph.random_draws import random_nodes, with_fixed_draws


def _noisy_model() -> onnx.ModelProto:
    """Conv, Relu, noise N(0, 0.3) added as a VITS model adds it to its latent, then two Convs."""
    rng = np.random.default_rng(3)
    weights = {"w1": rng.normal(0, 0.3, (16, 3, 3, 3)), "w2": rng.normal(0, 0.1, (16, 16, 3, 3)),
               "w3": rng.normal(0, 0.1, (3, 16, 3, 3)), "noise_scale": np.array(0.3)}
    pads = {"pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", **pads),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("RandomNormalLike", ["r1"], ["n1"], name="noise"),
             helper.make_node("Mul", ["n1", "noise_scale"], ["n2"], name="scale"),
             helper.make_node("Add", ["r1", "n2"], ["a1"], name="add"),
             helper.make_node("Conv", ["a1", "w2"], ["c2"], name="conv2", **pads),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv3", **pads)]
    return build_model(nodes, [float_input("x", ["N", 3, 32, 32])], ["y"],
                       {k: v.astype(np.float32) for k, v in weights.items()})


def _calibrate(folder: Path, model: onnx.ModelProto, data: Path, out: str) -> dict:
    onnx.save(model, folder / "noisy.onnx")
    result = CliRunner().invoke(main, ["calibrate", str(folder / "noisy.onnx"), "--data",
                                       str(data), "-o", str(folder / f"{out}.onnx"), "--force"])
    assert result.exit_code == 0, result.output
    report: dict = json.loads((folder / f"{out}.qcal.json").read_text())
    return report


def test_a_model_drawing_noise_calibrates_the_same_each_run_and_is_compared_on_quantization(
    tmp_path: Path,
) -> None:
    model = _noisy_model()
    data = tmp_path / "d.npz"
    np.savez(data, x=np.random.default_rng(4).standard_normal((32, 3, 32, 32)).astype(np.float32))
    first = _calibrate(tmp_path, model, data, "a")
    second = _calibrate(tmp_path, model, data, "b")
    # onnxruntime seeds the node anew in every process and session: on fresh draws, two runs
    # wrote two models, and the float model against itself read 7 dB.
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert first["evaluation"] == second["evaluation"]
    (output,) = first["evaluation"]["outputs"]
    assert output["sqnr_db"] > 25, output
    (note,) = [w for w in first["warnings"] if "draws random values" in w]
    assert note.startswith("'noise' draws random values")
    # The model written draws at random still, as the float one does.
    written = onnx.load(tmp_path / "a.onnx")
    onnx.checker.check_model(written, full_check=True)
    assert [n.name for n in random_nodes(written.graph)] == ["noise"]
    assert not [t.name for t in written.graph.initializer if "fixed_draws" in t.name]
    session = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    x = np.ones((1, 3, 32, 32), np.float32)
    assert not np.array_equal(session.run(None, {"x": x})[0], session.run(None, {"x": x})[0])


@pytest.mark.parametrize(("node", "inputs", "kind", "mean", "std", "support"), [
    (helper.make_node("RandomNormalLike", ["x"], ["y"], mean=2.0, scale=0.5),
     {"x": np.zeros((64, 300), np.float32)}, np.float32, 2.0, 0.5, None),
    (helper.make_node("RandomNormalLike", ["x"], ["y"], dtype=TensorProto.DOUBLE),
     {"x": np.zeros((64, 300), np.float32)}, np.float64, 0.0, 1.0, None),
    (helper.make_node("RandomUniformLike", ["x"], ["y"], low=-3.0, high=1.0),
     {"x": np.zeros((7, 5, 600), np.float16)}, np.float16, -1.0, 4 / 12 ** 0.5, (-3.0, 1.0)),
    (helper.make_node("RandomNormal", [], ["y"], shape=[3, 200, 500]),
     {}, np.float32, 0.0, 1.0, None),
    (helper.make_node("RandomUniform", [], ["y"], shape=[300000], high=2.0),
     {}, np.float32, 1.0, 2 / 12 ** 0.5, (0.0, 2.0)),
    (helper.make_node("Bernoulli", ["x"], ["y"]),
     {"x": np.full((20000,), 0.25, np.float32)}, np.float32, 0.25, 0.75 ** 0.5 * 0.5, (0, 1)),
])
def test_fixed_draws_keep_each_distribution_shape_and_type(
    node: onnx.NodeProto, inputs: dict[str, np.ndarray], kind: type, mean: float, std: float,
    support: tuple[float, float] | None,
) -> None:
    kinds = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE,
             np.float16: TensorProto.FLOAT16}
    graph_inputs = [helper.make_tensor_value_info(k, kinds[v.dtype.type], list(v.shape))
                    for k, v in inputs.items()]
    shape = list(next(iter(inputs.values())).shape) if inputs else next(
        list(a.ints) for a in node.attribute if a.name == "shape")
    model = helper.make_model(
        helper.make_graph([node], "draws", graph_inputs,
                          [helper.make_tensor_value_info("y", kinds[kind], shape)]),
        opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    fixed = with_fixed_draws(model)
    assert fixed is not None
    onnx.checker.check_model(fixed, full_check=True)
    runs = []
    for _ in range(2):  # two sessions, two runs each: always the same values
        session = ort.InferenceSession(fixed.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        runs += [session.run(None, inputs)[0] for _ in range(2)]
    drawn = runs[0]
    assert all(np.array_equal(drawn, r) for r in runs[1:])
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert drawn.dtype == expected.dtype == kind and drawn.shape == expected.shape
    values = drawn.astype(np.float64).ravel()
    assert abs(values.mean() - mean) < 0.02 * max(std, 1)
    assert abs(values.std() - std) < 0.02 * std
    if support is not None:
        assert values.min() >= support[0] and values.max() <= support[1]
    # a stretch of the table as long as the output, not the table's start repeated
    assert len(np.unique(values)) > min(values.size // 2, 1000) or node.op_type == "Bernoulli"
    assert with_fixed_draws(fixed) is None  # nothing random is left


def test_a_random_node_in_a_branch_and_two_nodes_draw_apart() -> None:
    noise = [helper.make_node("RandomNormalLike", ["x"], ["inner"], name="in_branch"),
             helper.make_node("Add", ["inner", "x"], ["b"])]
    branch = helper.make_graph(noise, "then", [], [helper.make_tensor_value_info(
        "b", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["top"], name="top"),
             helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=other)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [float_input("x", [1000]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("top", TensorProto.FLOAT, [1000]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1000])]),
        opset_imports=[helper.make_opsetid("", 13)])
    fixed = with_fixed_draws(model)
    assert fixed is not None
    assert [n.name for n in random_nodes(model.graph)] == ["top", "in_branch"]
    session = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.zeros(1000, np.float32)
    top, z = session.run(None, {"x": x, "flag": np.array(True)})
    assert np.array_equal(z, session.run(None, {"x": x, "flag": np.array(True)})[1])
    assert abs(np.corrcoef(top, z)[0, 1]) < 0.1  # each node its own draws
    assert numpy_helper.to_array(next(t for t in fixed.graph.initializer
                                      if t.name.endswith("normal"))).size == 1 << 18
