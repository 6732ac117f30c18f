"""Blocks of tensors measured against the outputs (`measure_blocks`): each block's harm is the
real QDQ model's with that block alone quantized, and halving finds the one harmful tensor of a
deep chain. And the run that uses them: below the floor, the fallback searches by blocks first
(the error-jump ranking only where they fall short). Outputs that are not tensors (a classifier's ZipMap) are
left out of every measurement of the accuracy stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from _onnx_testing import build_model, float_input, run
from _pipeline_testing import calibrate_capturing_sensitivity, save_with_data
from onnx import TensorProto, helper, numpy_helper

import qcal._accuracy_stage as accuracy_stage
from qcal.accuracy.sensitivity import measure_blocks, measure_sensitivity
from qcal.config import CalibrationConfig
from qcal.graph.qdq import InsertQDQ
from qcal.numerics.errors import ModelError
from qcal.pipeline import calibrate

LAYERS, WIDTH = 6, 16


def deep_chain(seed: int = 3) -> onnx.ModelProto:
    """x -> (MatMul -> Relu) x 6 -> MatMul -> logits, where the third hidden layer has one
    channel 1000x the others that the next MatMul does not read: one per-tensor step of that
    activation wipes out the channels the rest of the chain rests on (its harm is most of the
    model's); every other tensor rounds harmlessly."""
    rng = np.random.default_rng(seed)
    inits: dict[str, np.ndarray] = {}
    nodes = []
    source = "x"
    for i in range(LAYERS):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        if i == 2:
            w[:, 0] *= 1000.0
        if i == 3:
            w[0, :] = 0.0
        inits[f"w{i}"] = w
        nodes += [helper.make_node("MatMul", [source, f"w{i}"], [f"pre{i}"], name=f"fc{i}"),
                  helper.make_node("Relu", [f"pre{i}"], [f"h{i}"], name=f"relu{i}")]
        source = f"h{i}"
    inits["head"] = rng.standard_normal((WIDTH, 10)).astype(np.float32)
    nodes.append(helper.make_node("MatMul", [source, "head"], ["logits"], name="head"))
    return build_model(nodes, [float_input("x", ["N", WIDTH])], ["logits"], inits)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    folder = tmp_path_factory.mktemp("blocks")
    path, data = save_with_data(folder, "chain", deep_chain(), 4, evaluate=8, features=WIDTH)
    captured = calibrate_capturing_sensitivity(
        path, CalibrationConfig(min_product_macs=0, sensitivity=True, sensitivity_samples=2))
    return captured["model"], captured["plan"], captured["acts"], captured["weights"], data


def _noise_ratio(model: onnx.ModelProto, quantized: onnx.ModelProto,
                 feeds: list[np.ndarray]) -> float:
    signal = noise = 0.0
    for x in feeds:
        reference = run(model, {"x": x})[0].astype(np.float64)
        got = run(quantized, {"x": x})[0].astype(np.float64)
        signal += float((reference ** 2).sum())
        noise += float(((reference - got) ** 2).sum())
    return noise / signal


def test_halving_isolates_the_harmful_tensor_and_each_block_is_its_qdq_model(
    pieces: tuple,
) -> None:
    model, plan, acts, weights, data = pieces
    feeds = [data[i:i + 1] for i in range(2)]
    blocks = measure_blocks(model, plan, acts, weights, [{"x": x} for x in feeds],
                            first_blocks=2, measurements=12)
    planned = {a.tensor for a in plan.activations if a.consumers} | {w.tensor for w in plan.weights}
    assert sorted(t for b in blocks for t in b.tensors) == sorted(planned)  # a partition
    assert blocks[0].tensors == ("h2",)  # the harmful one, alone and first
    assert [b.harm for b in blocks] == sorted((b.harm for b in blocks), reverse=True)
    assert blocks[0].harm > 10 * sum(b.harm for b in blocks[1:])
    # each harm is the real QDQ model's with the block alone quantized (to 1e-3: onnxruntime
    # runs consecutive Q/DQ pairs as integer kernels, which round the requantization apart
    # from the fake-quant in float the switch model computes)
    for block in blocks:
        alone = dataclasses.replace(
            plan, biases=(),
            activations=tuple(a for a in plan.activations if a.tensor in block.tensors),
            weights=tuple(w for w in plan.weights if w.tensor in block.tensors))
        quantized = InsertQDQ(alone, acts, weights)(model).model
        assert block.harm == pytest.approx(_noise_ratio(model, quantized, feeds), rel=1e-3,
                                           abs=1e-12), block.tensors


def test_within_the_budget_the_first_blocks_stay_whole(pieces: tuple) -> None:
    model, plan, acts, weights, data = pieces
    blocks = measure_blocks(model, plan, acts, weights, [{"x": data[:1]}], first_blocks=3,
                            measurements=3)
    assert len(blocks) == 3  # no measurement left to halve one
    assert all(len(b.tensors) > 1 for b in blocks)


def test_below_the_floor_the_fallback_searches_by_blocks_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The floor is reached by the blocks' ranking, which keeps the harmful activation float
    (checked on the written model); the error-jump ranking, made to offer nothing here, is
    never localised."""
    path, data = save_with_data(tmp_path, "chain", deep_chain(), 4, calib=64, evaluate=200,
                                features=WIDTH)
    assert data is not None
    naive = calibrate(path, CalibrationConfig(min_product_macs=0, fallback=False))
    assert naive.report["evaluation"]["outputs"][0]["top1_agreement"] < 0.99
    monkeypatch.setattr(accuracy_stage, "rank_candidates", lambda *args: [])
    # Each of the chain's seven products is 9-15 % of its MACs: with h2 float, the other
    # roundings may still flip 1-2 % of the decisions on these random weights, and the search
    # may need another product or two past the default coverage floor.
    result = calibrate(path, CalibrationConfig(min_product_macs=0, min_coverage=50.0))
    report = result.report
    fallback = report["fallback"]
    assert fallback["reached"], fallback["message"]
    assert "in blocks" in fallback["message"]
    assert fallback["kept_float"][0]["tensor"] == "h2"  # the harmful one, ranked first
    assert all("quantized alone" in k["reason"] and "output SQNR" in k["reason"]
               for k in fallback["kept_float"])  # no softmax output: the outputs' SQNR
    assert "localise blocks" in report["timings_seconds"]
    assert "localise" not in report["timings_seconds"] and report["sensitivity"] is None
    expected = run(deep_chain(), {"x": data})[0].argmax(1)
    got = run(result.model, {"x": data})[0].argmax(1)
    assert float(np.mean(expected == got)) >= 0.99
    assert report["gates"] == []


def test_a_model_the_switch_form_cannot_take_keeps_the_first_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks that cannot be measured (per-axis activations have no switch form) leave the
    error jumps' search, here offering nothing: the floor fails as a gate, with the model as
    planned, no error."""
    path, _ = save_with_data(tmp_path, "chain", deep_chain(), 4, calib=64, evaluate=200,
                             features=WIDTH)
    monkeypatch.setattr(accuracy_stage, "rank_candidates", lambda *args: [])

    def cannot(*args: object, **kwargs: object) -> None:
        raise ModelError("activation 'h2': per-axis activations cannot be measured")

    monkeypatch.setattr(accuracy_stage, "measure_blocks", cannot)
    result = calibrate(path, CalibrationConfig(min_product_macs=0), enforce_gates=False)
    report = result.report
    assert not report["fallback"]["reached"]
    assert report["fallback"]["kept_float"] == []
    (gate,) = report["gates"]
    assert gate["option"] == "accuracy-floor" and not gate["passed"]


def _with_zipmap(model: onnx.ModelProto, *, keep_logits: bool) -> onnx.ModelProto:
    """The chain with its logits also given as scikit-learn classifiers give probabilities: a
    ZipMap, a sequence of {class: score} dicts (and without the logits when not kept)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.append(helper.make_node("ZipMap", ["logits"], ["scores"], name="zipmap",
                                           domain="ai.onnx.ml",
                                           classlabels_int64s=list(range(10))))
    out.opset_import.append(helper.make_opsetid("ai.onnx.ml", 1))
    scores = onnx.TypeProto()
    scores.sequence_type.elem_type.map_type.key_type = TensorProto.INT64
    scores.sequence_type.elem_type.map_type.value_type.tensor_type.elem_type = TensorProto.FLOAT
    if not keep_logits:
        del out.graph.output[:]
    out.graph.output.append(helper.make_value_info("scores", scores))
    return out


def test_outputs_that_are_not_tensors_are_left_out_of_the_measurements(
    tmp_path: Path, pieces: tuple,
) -> None:
    """A ZipMap output (dicts) beside the logits: blocks and per-tensor sensitivity measure the
    logits alone, with the figures of the model without it; with the ZipMap as the only
    output there is nothing to compare, and nothing is measured (no error)."""
    model, plan, acts, weights, data = pieces
    feeds = [{"x": data[:1]}]
    plain = measure_blocks(model, plan, acts, weights, feeds, first_blocks=2, measurements=6)
    zipped = measure_blocks(_with_zipmap(model, keep_logits=True), plan, acts, weights, feeds,
                            first_blocks=2, measurements=6)
    assert [(b.tensors, b.harm) for b in zipped] == [(b.tensors, b.harm) for b in plain]
    alone = measure_sensitivity(_with_zipmap(model, keep_logits=True), plan, acts, weights,
                                [({"x": data[:2]}, 2)])
    expected = measure_sensitivity(model, plan, acts, weights, [({"x": data[:2]}, 2)])
    assert [(s.tensor, s.noise_ratio) for s in alone.tensors] == [
        (s.tensor, s.noise_ratio) for s in expected.tensors]
    only = _with_zipmap(model, keep_logits=False)
    assert measure_blocks(only, plan, acts, weights, feeds) == ()
    assert measure_sensitivity(only, plan, acts, weights, [({"x": data[:2]}, 2)]).tensors == ()


def test_a_run_below_the_floor_with_a_zipmap_output_localises_on_the_tensors(
    tmp_path: Path,
) -> None:
    """Below the floor, the error is localised and the fallback restores the model on the
    logits, the ZipMap of dicts beside them left out (it failed the run with an internal error);
    the agreement is recomputed from the written model."""
    model = _with_zipmap(deep_chain(), keep_logits=True)
    path, data = save_with_data(tmp_path, "chain", model, 4, calib=64, evaluate=200,
                                features=WIDTH)
    assert data is not None
    # the coverage floor as in test_below_the_floor_the_fallback_searches_by_blocks_first
    result = calibrate(path, CalibrationConfig(min_product_macs=0, allow_slower=True,
                                               min_coverage=50.0))
    report = result.report
    assert report["fallback"]["reached"], report["fallback"]["message"]
    expected = run(deep_chain(), {"x": data})[0].argmax(1)
    got = run(result.model, {"x": data})[0].argmax(1)
    assert float(np.mean(expected == got)) >= 0.99


def _with_positive_indices(model: onnx.ModelProto) -> onnx.ModelProto:
    """The chain with a second output whose length depends on the values, as a detector's
    boxes do: the indices of the positive logits (NonZero)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    out.graph.node.extend([
        helper.make_node("Greater", ["logits", "zero"], ["positive"], name="positive"),
        helper.make_node("NonZero", ["positive"], ["where"], name="where")])
    out.graph.output.append(helper.make_tensor_value_info("where", TensorProto.INT64, [2, "count"]))
    return out


def test_an_output_of_another_length_counts_as_lost_not_as_an_error(pieces: tuple) -> None:
    """Quantized, the chain finds another number of positive logits on some samples: that
    output's noise is its whole signal there (as the evaluation counts such a batch), and the
    measurements go on (they failed on arrays of two lengths)."""
    model, plan, acts, weights, data = pieces
    counted = _with_positive_indices(model)
    feeds = [{"x": data[i:i + 1]} for i in range(8)]
    shapes_differ = False
    for feed in feeds:  # the whole block quantized changes some sample's count
        every = dataclasses.replace(plan, biases=())
        quantized = InsertQDQ(every, acts, weights)(counted).model
        shapes_differ |= run(counted, feed)[1].shape != run(quantized, feed)[1].shape
    assert shapes_differ
    blocks = measure_blocks(counted, plan, acts, weights, feeds, first_blocks=1, measurements=1)
    assert len(blocks) == 1 and blocks[0].harm > 0.0
    batches = [(feed, 1) for feed in feeds]
    sensitivity = measure_sensitivity(counted, plan, acts, weights, batches)
    assert any(s.noise_ratio > 0.0 for s in sensitivity.tensors)
