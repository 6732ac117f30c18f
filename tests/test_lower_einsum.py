"""Einsums that are matrix products become MatMuls (lower-einsum), computing the same values.

Each case builds a one-Einsum model, prepares it, and compares the prepared model's outputs
with numpy's einsum of the same inputs (float64): the lowering is exact to float32 precision.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _onnx_testing import build_model, float_input
from click.testing import CliRunner
from onnx import helper

from qcal.config import CalibrationConfig
from qcal.graph.model import prepare_model
from qcal.pipeline import calibrate

# equation, operand shapes, which operand is a constant (None: both are inputs)
LOWERED = [
    ("bhqd,bhkd->bhqk", [(2, 4, 5, 8), (2, 4, 6, 8)], None),  # attention scores
    ("bhqk,bhkd->bhqd", [(2, 4, 5, 6), (2, 4, 6, 8)], None),  # attention applied
    ("bqhd,bkhd->bhqk", [(2, 5, 4, 8), (2, 6, 4, 8)], None),  # heads in the middle
    ("btd,df->btf", [(2, 5, 8), (8, 12)], 1),  # a projection
    ("btd,dhe->bhte", [(2, 5, 8), (8, 4, 3)], 1),  # into heads, output transposed
    ("bhqe,hed->bqd", [(2, 4, 5, 3), (4, 3, 8)], 1),  # out of heads: two indices summed
    ("df,btd->btf", [(8, 12), (2, 5, 8)], 0),  # the constant written first
    ("ecd,edf->ecf", [(4, 5, 8), (4, 8, 6)], 1),  # experts: a batch of weights
    ("...d,df->...f", [(2, 5, 8), (8, 12)], 1),  # leading axes behind an ellipsis
    ("...id,fd->...if", [(2, 3, 5, 8), (12, 8)], 1),  # ... and a weight to transpose
    ("df,...d->...f", [(8, 12), (2, 5, 8)], 0),  # the ellipsis second
    ("...d,df->...f", [(2, 5, 8), (8, 12)], None),  # a 2-D second operand that is an input
]

KEPT = [
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),  # an ellipsis in both operands
    ("...di,df->...if", [(2, 8, 3), (8, 12)]),  # axes after the ellipsis out of product order
    ("bij,bjk", [(2, 3, 4), (2, 4, 5)]),  # implicit output
    ("bii,bij->bj", [(2, 3, 3), (2, 3, 4)]),  # a diagonal
    ("bij,bk->bi", [(2, 3, 4), (2, 5)]),  # an index summed within one operand
]


def _model(equation: str, shapes: list[tuple[int, ...]], constant: int | None,
           rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray],
                                              list[np.ndarray]]:
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    names = ["a", "b"]
    inputs = [float_input(n, list(s)) for i, (n, s) in enumerate(zip(names, shapes))
              if i != constant]
    inits = {names[constant]: arrays[constant]} if constant is not None else {}
    node = helper.make_node("Einsum", names, ["y"], name="einsum", equation=equation)
    feeds = {n: a for i, (n, a) in enumerate(zip(names, arrays)) if i != constant}
    return build_model([node], inputs, ["y"], inits), feeds, arrays


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


@pytest.mark.parametrize(("equation", "shapes", "constant"), LOWERED)
def test_a_matrix_product_einsum_becomes_a_matmul_of_the_same_values(
    equation: str, shapes: list[tuple[int, ...]], constant: int | None
) -> None:
    model, feeds, arrays = _model(equation, shapes, constant, np.random.default_rng(31))
    prepared, steps = prepare_model(model)
    ops = Counter(n.op_type for n in prepared.graph.node)
    assert ops["Einsum"] == 0 and ops["MatMul"] == 1, ops
    assert ("lower-einsum", "wrote 1 Einsum as MatMul") in [(s.name, s.detail) for s in steps]
    # the MatMul keeps the Einsum's name: node globs and reports still find it
    assert next(n.name for n in prepared.graph.node if n.op_type == "MatMul") == "einsum"
    onnx.checker.check_model(prepared, full_check=True)
    expected = np.einsum(equation, *[a.astype(np.float64) for a in arrays])
    got = _run(prepared, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("equation", "shapes"), KEPT)
def test_other_einsums_stay_as_they_are(equation: str, shapes: list[tuple[int, ...]]) -> None:
    model, feeds, arrays = _model(equation, shapes, None, np.random.default_rng(32))
    prepared, steps = prepare_model(model)
    assert [n.op_type for n in prepared.graph.node] == ["Einsum"]
    assert "lower-einsum" not in [s.name for s in steps]
    np.testing.assert_allclose(_run(prepared, feeds),
                               np.einsum(equation, *[a.astype(np.float64) for a in arrays]),
                               rtol=1e-5, atol=1e-5)


def test_an_einsum_transformer_block_runs_its_products_in_integers(tmp_path: Path) -> None:
    """A projection, attention scores and the weighted sum, all written as einsum: each becomes
    a MatMul that onnxruntime runs on integers, and the output stays close to float."""
    rng = np.random.default_rng(33)
    nodes = [
        helper.make_node("Einsum", ["x", "wq"], ["q"], name="query", equation="btd,dhe->bhte"),
        helper.make_node("Einsum", ["x", "wk"], ["k"], name="key", equation="btd,dhe->bhte"),
        helper.make_node("Einsum", ["q", "k"], ["s"], name="scores",
                         equation="bhqe,bhke->bhqk"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("Einsum", ["p", "k"], ["o"], name="mix", equation="bhqk,bhke->bhqe"),
        helper.make_node("Einsum", ["o", "wo"], ["y"], name="out", equation="bhqe,hed->bqd"),
    ]
    weights = {name: (rng.standard_normal(shape) * 0.3).astype(np.float32)
               for name, shape in (("wq", (16, 4, 4)), ("wk", (16, 4, 4)), ("wo", (4, 4, 16)))}
    model = build_model(nodes, [float_input("x", ["N", 6, 16])], ["y"], weights)
    data = rng.standard_normal((16, 6, 16)).astype(np.float32)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=data)
    result = calibrate(tmp_path / "m.onnx", CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz"),
                       enforce_gates=False)
    coverage = result.report["coverage"]
    assert coverage["compute_nodes"] == 5 and coverage["macs_quantized_fraction"] > 0.5
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(result.model.SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    ran = Counter(n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node)
    assert ran["MatMulIntegerToFloat"] + ran["QLinearMatMul"] >= 3, ran
    assert ran["Einsum"] == 0
    got, want = _run(result.model, {"x": data[:4]}), _run(model, {"x": data[:4]})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


def test_a_constant_operand_read_elsewhere_stays() -> None:
    """The weight of a lowered projection is stored as its matrix; the original stays while
    another node (here inside an If branch) still reads it."""
    rng = np.random.default_rng(34)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    branch = helper.make_graph(
        [helper.make_node("ReduceSum", ["w"], ["total"], name="total", keepdims=0)], "branch",
        [], [helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Einsum", ["x", "w"], ["y"], name="project", equation="btd,df->btf"),
        helper.make_node("If", ["flag"], ["z"], name="choose", then_branch=branch,
                         else_branch=branch),
    ]
    flag = helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, [])
    model = build_model(nodes, [float_input("x", [2, 5, 8]), flag], ["y", "z"], {"w": w})
    prepared, _ = prepare_model(model)
    assert "w" in {t.name for t in prepared.graph.initializer}
    onnx.checker.check_model(prepared, full_check=True)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    session = ort.InferenceSession(prepared.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    y, z = session.run(None, {"x": x, "flag": np.array(True)})
    np.testing.assert_allclose(y, np.einsum("btd,df->btf", x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z, w.sum(), rtol=1e-5)


def test_the_quantized_model_is_timed_against_the_users_einsum_not_the_matmul(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """"Slower than float" is about the model the user gave: the not-slower gate times the
    quantized model against the file's Einsum, not the MatMul qcal wrote for it."""
    import qcal._users_model as stage
    from qcal.cli import main

    rng = np.random.default_rng(32)
    model, _, _ = _model("bij,jk->bik", [(4, 8, 16), (16, 32)], 1, rng)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", a=rng.standard_normal((8, 4, 8, 16)).astype(np.float32))
    timed: list[onnx.ModelProto] = []
    real = stage.time_side_by_side

    def spy(float_model: onnx.ModelProto, *args: Any, **kwargs: Any) -> Any:
        timed.append(float_model)
        return real(float_model, *args, **kwargs)

    monkeypatch.setattr(stage, "time_side_by_side", spy)
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "calib.npz"),
        "-o", str(tmp_path / "q.onnx"), "--report", str(tmp_path / "q.json"), "--allow-slower"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [[n.op_type for n in m.graph.node] for m in timed] == [["Einsum"]]

