"""Per-tensor sensitivity against independent measurements: the real QDQ model with one tensor
quantized (written by InsertQDQ, run by onnxruntime) and numpy fake-quant of the tensor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, run
from _pipeline_testing import calibrate_capturing_sensitivity, save_with_data
from onnx import TensorProto, helper

from qcal.accuracy.sensitivity import _Models, measure_sensitivity
from qcal.accuracy.sensitivity._models import switch_flags
from qcal.config import CalibrationConfig
from qcal.graph.qdq import InsertQDQ
from qcal.pipeline import calibrate

SAMPLE_MODELS = Path(__file__).resolve().parents[1] / "sample_models"


def small_net(seed: int = 0) -> onnx.ModelProto:
    """x -> MatMul -> Relu -> Mul(scale) -> Add(skip) -> MatMul -> y: a few tensors of each kind."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "w2": (rng.standard_normal((16, 4)) / 4).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, 16).astype(np.float32),
        "skip": rng.standard_normal((8, 16)).astype(np.float32),
    }
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "w1"], ["h"], name="fc1"),
        n("Relu", ["h"], ["r"], name="relu"),
        n("Mul", ["r", "scale"], ["s"], name="scale_mul"),
        n("MatMul", ["x", "skip"], ["k"], name="skip_mm"),
        n("Add", ["s", "k"], ["a"], name="add"),
        n("MatMul", ["a", "w2"], ["y"], name="fc2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    return build_model(nodes, [x], ["y"], inits)


def batches(data: np.ndarray, size: int = 4) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    for start in range(0, len(data), size):
        chunk = data[start:start + size]
        yield {"x": chunk}, len(chunk)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, object]:
    path, data = save_with_data(tmp_path_factory.mktemp("sens"), "net", small_net(), 3, evaluate=12)
    return path, data, calibrate(path, CalibrationConfig(min_product_macs=0))


def _pieces(path: Path) -> tuple[onnx.ModelProto, object, dict, dict]:
    """Prepared model, plan and parameters as the pipeline computed them."""
    captured = calibrate_capturing_sensitivity(
        path, CalibrationConfig(min_product_macs=0, sensitivity=True, sensitivity_samples=2)
    )
    return captured["model"], captured["plan"], captured["acts"], captured["weights"]  # type: ignore[return-value]


def test_each_tensor_alone_matches_the_real_qdq_model(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    result = measure_sensitivity(model, plan, acts, weights, batches(data))
    assert result.samples == len(data)
    planned = {t.tensor for t in plan.activations if t.consumers} | {w.tensor for w in plan.weights}
    assert {s.tensor for s in result.tensors} == planned
    reference = run(model, {"x": data})[0].astype(np.float64)
    for s in result.tensors:
        alone = dataclasses.replace(  # only this tensor's Q/DQ, read by the same consumers
            plan, biases=(),
            activations=tuple(a for a in plan.activations if a.tensor == s.tensor),
            weights=tuple(w for w in plan.weights if w.tensor == s.tensor))
        quantized = InsertQDQ(alone, acts, weights)(model).model
        y = run(quantized, {"x": data})[0].astype(np.float64)
        noise = float(((reference - y) ** 2).sum())
        if noise == 0.0:
            assert s.output_sqnr_db is None and s.noise_ratio == 0.0
            continue
        expected = 10 * math.log10(float((reference**2).sum()) / noise)
        assert s.output_sqnr_db == pytest.approx(expected, abs=1e-3), s.tensor
    ratios = [s.noise_ratio for s in result.tensors]
    assert ratios == sorted(ratios, reverse=True)  # worst first


def test_local_sqnr_is_the_tensor_against_its_fake_quant(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    result = measure_sensitivity(model, plan, acts, weights, batches(data)).by_tensor()
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    h = run(exposed, {"x": data})[1].astype(np.float32)  # the scaled Relu output
    q = acts["s"]
    codes = np.clip(np.rint(h / q.scale) + q.zero_point, 0 if q.dtype == TensorProto.UINT8 else -128,
                    255 if q.dtype == TensorProto.UINT8 else 127)
    faked = ((codes - q.zero_point) * q.scale).astype(np.float64)
    expected = 10 * math.log10(float((h.astype(np.float64) ** 2).sum())
                               / float(((h - faked) ** 2).sum()))
    assert result["s"].local_sqnr_db == pytest.approx(expected, abs=1e-3)


def test_no_unit_switched_is_the_float_model_bit_for_bit(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    models = _Models.build(model, plan, acts, weights)
    float_out = run(model, {"x": data})[0]
    flags = switch_flags(len(models.units))
    switched = run(models.switch, {"x": data, models.selector: flags})[0]
    np.testing.assert_array_equal(float_out, switched)


def test_batches_are_streamed_once(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    consumed = []

    def once() -> Iterator[tuple[dict[str, np.ndarray], int]]:
        for feed, n in batches(data, 3):
            consumed.append(n)
            yield feed, n

    one_pass = measure_sensitivity(model, plan, acts, weights, once())
    assert sum(consumed) == len(data) and one_pass.samples == len(data)
    whole = measure_sensitivity(model, plan, acts, weights, batches(data, len(data)))
    for a, b in zip(one_pass.tensors, whole.tensors):  # batching does not change the sums
        assert a.tensor == b.tensor
        assert a.noise_ratio == pytest.approx(b.noise_ratio, rel=1e-9)


def test_sensitivity_in_the_report_and_held_out_data(tmp_path: Path) -> None:
    model = SAMPLE_MODELS / "digits_cnn.onnx"
    data = np.load(SAMPLE_MODELS / "digits_cnn.calib.npz")["image"][:40]
    np.savez(tmp_path / "calib.npz", image=data)
    result = calibrate(model, CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", sensitivity=True,
                                                eval_data=None, sensitivity_samples=4))
    report = result.report
    # digits_cnn.eval.npz sits beside the model: it is the evaluation data.
    assert report["sensitivity"]["data"].endswith("digits_cnn.eval.npz")
    assert report["sensitivity"]["samples"] == 4
    assert report["fallback"] is None and report["data"]["samples"] == 40
    copy = tmp_path / "digits.onnx"
    copy.write_bytes(model.read_bytes())
    held = calibrate(copy, CalibrationConfig(min_product_macs=0, data=tmp_path / "calib.npz", sensitivity=True,
                                             sensitivity_samples=4))
    # No evaluation data: the last quarter of the calibration samples is held out.
    assert held.report["data"]["samples"] == 30
    assert held.report["evaluation"]["samples"] == 10
    assert "held out" in held.report["sensitivity"]["data"]
    names = {t["tensor"] for t in held.report["sensitivity"]["tensors"]}
    read_quantized = {t["name"] for t in held.report["tensors"] if t["role"] != "bias" and t["consumers"]}
    assert names == read_quantized  # every tensor something reads through a Q/DQ pair


def test_screening_measures_harmless_tensors_on_the_first_samples_only(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    full = measure_sensitivity(model, plan, acts, weights, batches(data)).by_tensor()
    first = measure_sensitivity(model, plan, acts, weights, batches(data[:4])).by_tensor()
    screened = measure_sensitivity(model, plan, acts, weights, batches(data), screen_samples=4,
                                   screen_fraction=0.3)
    assert screened.samples == len(data)
    worst = max(s.harm for s in first.values())
    kept = {s.tensor for s in screened.tensors if s.samples == len(data)}
    dropped = {s.tensor for s in screened.tensors if s.samples == 4}
    assert kept and dropped and kept | dropped == set(full)
    for s in screened.tensors:
        # Screening decides on the first 4 samples; what it keeps is measured on all of them.
        assert (s.tensor in kept) == (first[s.tensor].harm >= 0.3 * worst), s.tensor
        reference = full[s.tensor] if s.tensor in kept else first[s.tensor]
        assert s.noise_ratio == pytest.approx(reference.noise_ratio, rel=1e-9, abs=1e-300)
        assert s.local_sqnr_db == pytest.approx(full[s.tensor].local_sqnr_db, rel=1e-9)


def softmax_net(seed: int = 0) -> onnx.ModelProto:
    """x -> MatMul -> Add -> Softmax -> p: a classifier whose output is probabilities."""
    rng = np.random.default_rng(seed)
    inits = {"w": (3 * rng.standard_normal((8, 10))).astype(np.float32),
             "b": rng.standard_normal(10).astype(np.float32)}
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["m"], name="fc"), n("Add", ["m", "b"], ["logits"], name="bias"),
             n("Softmax", ["logits"], ["p"], name="softmax", axis=-1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    return build_model(nodes, [x], ["p"], inits)


def test_softmax_outputs_are_also_measured_on_their_logits(tmp_path: Path) -> None:
    path, data = save_with_data(tmp_path, "cls", softmax_net(), 5, evaluate=12)
    assert data is not None
    prepared, plan, acts, weights = _pieces(path)
    result = measure_sensitivity(prepared, plan, acts, weights, batches(data))
    exposed = onnx.ModelProto()
    exposed.CopyFrom(prepared)
    exposed.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]))
    p_ref, logits_ref = (a.astype(np.float64) for a in run(exposed, {"x": data}))
    assert result.tensors
    for s in result.tensors:
        alone = dataclasses.replace(
            plan, biases=(),
            activations=tuple(a for a in plan.activations if a.tensor == s.tensor),
            weights=tuple(w for w in plan.weights if w.tensor == s.tensor))
        p, logits = (a.astype(np.float64) for a in
                     run(InsertQDQ(alone, acts, weights)(exposed).model, {"x": data}))
        expected = float(((logits_ref - logits) ** 2).sum() / (logits_ref**2).sum())
        assert s.logit_noise_ratio == pytest.approx(expected, rel=1e-6), s.tensor
        assert s.harm == s.logit_noise_ratio
        assert s.noise_ratio == pytest.approx(
            float(((p_ref - p) ** 2).sum() / (p_ref**2).sum()), rel=1e-6)
    harms = [s.harm for s in result.tensors]
    assert harms == sorted(harms, reverse=True)  # ranked by the logits


def test_outputs_without_softmax_have_no_logit_figure(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    for s in measure_sensitivity(model, plan, acts, weights, batches(data)).tensors:
        assert s.logit_noise_ratio is None and s.harm == s.noise_ratio


def test_refinement_stops_when_its_run_budget_is_spent(calibrated: tuple) -> None:
    path, data, _ = calibrated
    model, plan, acts, weights = _pieces(path)
    from qcal.accuracy import sensitivity

    full = measure_sensitivity(model, plan, acts, weights, batches(data)).by_tensor()
    first8 = measure_sensitivity(model, plan, acts, weights, batches(data[:8])).by_tensor()
    relevant = {s.tensor for s in measure_sensitivity(
        model, plan, acts, weights, batches(data[:4])).tensors
        if s.harm >= sensitivity._NEGLIGIBLE}
    assert relevant
    # Screened on the first batch of 4; the budget pays for one more batch of the relevant ones.
    capped = measure_sensitivity(model, plan, acts, weights, batches(data), screen_samples=4,
                                 screen_fraction=0.0, refine_runs=4 * len(relevant))
    assert capped.samples == len(data)
    for s in capped.tensors:
        assert s.samples == (8 if s.tensor in relevant else 4), s.tensor
        if s.tensor in relevant:
            assert s.noise_ratio == pytest.approx(first8[s.tensor].noise_ratio, rel=1e-9)
        assert s.local_sqnr_db == pytest.approx(full[s.tensor].local_sqnr_db, rel=1e-9)
