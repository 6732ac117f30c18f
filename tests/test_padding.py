"""A token model fed padded sentences: its outputs at the padding positions (where the attention
mask is 0) are values nothing reads, so float and quantized models are compared on the real
tokens only, in the evaluation and in sensitivity. The mask is found by what it does (it reaches
the attention's softmax), not by its name."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.accuracy.decision_counts import DecisionRule
from qcal.accuracy.evaluate import compare_models
from qcal.accuracy.sensitivity._results import _OutputNoise
from qcal.cli import main
from qcal.graph.attention_masks import attention_mask

VOCAB, WIDTH, CLASSES, LENGTH = 24, 8, 4, 12
SCHEMA = Path(__file__).resolve().parents[1] / "qcal" / "report.schema.json"


def _tagger(*, padding_noise: float = 0.0, mask_name: str = "m", mask_dim: str | int = "seq",
            output_dim: str | int = "seq", mask_type: int = TensorProto.INT64,
            mask_to_softmax: bool = True, start_scores: bool = False,
            extra: onnx.ValueInfoProto | None = None, spelling: str = "1 real") -> onnx.ModelProto:
    """input_ids [batch, seq] -> embedding (Gather) -> one attention layer whose scores get
    -10000 where the mask is 0 (Cast, Sub, Mul, Unsqueeze, Add, Softmax: torch.onnx's spelling)
    -> residual -> logits [batch, seq, 4]. `padding_noise`: a change of every padding position's
    features before the head that raises its least likely class by that much, as a quantized
    model may change the values nobody reads there.
    `mask_to_softmax` False: no attention, the mask read only where the noise is added.
    `start_scores`: a second output of one score per position [batch, seq] (a span's start).
    `extra`: one more input, read by nothing (an encoder's states, another sequence).
    `spelling`: "1 real" (Hugging Face's mask), "1 padding" (PyTorch's key_padding_mask, True
    where padding), "additive" (the mask holds 0 and -10000, added as it is), "rows" (a mask
    of 1 on real tokens applied to the queries' rows, not to the keys: no padding mask)."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (VOCAB, WIDTH))
    w = rng.normal(0, 1, (WIDTH, CLASSES))
    # the feature change that raises the padding token's least likely class by padding_noise
    least = np.eye(CLASSES)[np.argmin(table[0] @ w)] * padding_noise
    inits = {
        "table": table.astype(np.float32), "w": w.astype(np.float32),
        "w_start": rng.normal(0, 1, (WIDTH, 1)).astype(np.float32),
        "one": np.array(1.0, np.float32), "big": np.array(-10000.0, np.float32),
        "noise": (w @ np.linalg.solve(w.T @ w, least)).astype(np.float32),
        "axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64),
        "last": np.array([-1], np.int64),
    }
    make = helper.make_node
    nodes = [make("Gather", ["table", "ids"], ["emb"], name="embedding"),
             make("Cast", [mask_name], ["mask_f"], name="mask_cast", to=TensorProto.FLOAT),
             make("Identity", ["mask_f"], ["pad"], name="pad") if spelling == "1 padding"
             else make("Div", ["mask_f", "big"], ["pad"], name="pad") if spelling == "additive"
             else make("Sub", ["one", "mask_f"], ["pad"], name="pad")]
    if mask_to_softmax:
        nodes += [make("Transpose", ["emb"], ["emb_t"], name="keys", perm=[0, 2, 1]),
                  make("MatMul", ["emb", "emb_t"], ["scores"], name="scores"),
                  make("Identity", ["mask_f"], ["neg"], name="neg") if spelling == "additive"
                  else make("Mul", ["pad", "big"], ["neg"], name="neg"),
                  make("Unsqueeze", ["neg", "axis2" if spelling == "rows" else "axis1"],
                       ["neg3"], name="neg3"),
                  make("Add", ["scores", "neg3"], ["masked"], name="masked"),
                  make("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
                  make("MatMul", ["probs", "emb"], ["ctx"], name="ctx"),
                  make("Add", ["ctx", "emb"], ["h"], name="residual")]
    else:
        nodes.append(make("Identity", ["emb"], ["h"], name="no_attention"))
    nodes += [make("Unsqueeze", ["pad", "axis2"], ["pad3"], name="pad3"),
              make("Mul", ["pad3", "noise"], ["pad_noise"], name="pad_noise"),
              make("Add", ["h", "pad_noise"], ["h_out"], name="h_out"),
              make("MatMul", ["h_out", "w"], ["logits"], name="head")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                             ["batch", output_dim, CLASSES])]
    if start_scores:
        nodes += [make("MatMul", ["h_out", "w_start"], ["start3"], name="start_head"),
                  make("Squeeze", ["start3", "last"], ["start"], name="start_squeeze")]
        outputs.append(helper.make_tensor_value_info("start", TensorProto.FLOAT,
                                                     ["batch", output_dim]))
    graph = helper.make_graph(
        nodes, "tagger",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info(mask_name, mask_type, ["batch", mask_dim]),
         *([] if extra is None else [extra])],
        outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def run_model(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feed)]


def _padded(samples: int, seed: int = 1) -> dict[str, np.ndarray]:
    """Sentences of 3 to LENGTH tokens padded to LENGTH with token 0, mask 0 there."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, LENGTH + 1, samples)
    ids = np.where(np.arange(LENGTH) < lengths[:, None],
                   rng.integers(1, VOCAB, (samples, LENGTH)), 0).astype(np.int64)
    return {"ids": ids, "m": (ids != 0).astype(np.int64)}


def _batches(data: dict[str, np.ndarray], size: int = 4):  # type: ignore[no-untyped-def]
    n = len(data["ids"])
    for start in range(0, n, size):
        yield {k: v[start:start + size] for k, v in data.items()}, min(size, n - start)


def test_the_mask_is_found_by_what_it_does_and_the_outputs_by_their_positions() -> None:
    found = attention_mask(_tagger(mask_name="padding_flags"))
    assert found is not None and found.input == "padding_flags"
    assert found.outputs == {"logits"}
    for mask_type in (TensorProto.BOOL, TensorProto.FLOAT):
        assert attention_mask(_tagger(mask_type=mask_type)) is not None
    # a rank-2 input that never reaches a softmax's scores is no attention mask
    assert attention_mask(_tagger(mask_to_softmax=False)) is None
    # exporters name axes per tensor (torch.onnx's list axes, tf2onnx's unk__N): a name of
    # its own is no other sequence's
    renamed = attention_mask(_tagger(output_dim="logits_dynamic_axes_1", start_scores=True))
    assert renamed is not None and renamed.outputs == {"logits"}  # one score a position:
    # only along the tokens' own axis (a sentence embedding's width gets invented names too)
    # ...but the name of another input's sequence is
    other = helper.make_tensor_value_info("decoder_flags", TensorProto.FLOAT,
                                          ["batch", "decoder_seq"])
    assert attention_mask(_tagger(output_dim="decoder_seq", extra=other)) is None
    # where the mask's tokens share its axis name, a decoder's ids along another are apart
    decoder_ids = helper.make_tensor_value_info("decoder_ids", TensorProto.INT64,
                                                ["batch", "decoder_seq"])
    assert attention_mask(_tagger(output_dim="decoder_seq", extra=decoder_ids)) is None
    # where nothing shares the mask's (dynamo's s53 beside its tokens' s70), tokens are not
    tokens = attention_mask(_tagger(mask_dim="s53", output_dim="seq"))
    assert tokens is not None and tokens.outputs == {"logits"}
    # a mask beside an encoder's states (a decoder step's cross-attention mask), even where
    # the two sequences have one static length
    states = helper.make_tensor_value_info("encoder_states", TensorProto.FLOAT,
                                           ["batch", LENGTH, WIDTH])
    assert attention_mask(_tagger(mask_dim=LENGTH, output_dim=LENGTH, extra=states)) is None
    # one score per position counts where its axis is the tokens': a fixed width is none
    static = attention_mask(_tagger(start_scores=True, output_dim=LENGTH))
    assert static is not None and static.outputs == {"logits"}
    fixed = attention_mask(_tagger(start_scores=True, mask_dim=LENGTH, output_dim=LENGTH))
    assert fixed is not None and fixed.outputs == {"logits"}  # static lengths alike


def test_padding_positions_are_left_out_of_the_comparison() -> None:
    data = _padded(40)
    float_model = _tagger(start_scores=True)
    # changed only where the mask is 0: a quantized model's noise nothing reads
    other = _tagger(padding_noise=50.0, start_scores=True)
    comparison = compare_models(float_model, other, _batches(data))
    logits, start = comparison.outputs
    assert logits.top1_agreement == 1.0 and logits.sqnr_db is None and logits.max_abs_error == 0
    assert logits.sequence_agreement == 1.0
    assert start.top1_agreement == 1.0 and start.sqnr_db is None
    real = int(data["m"].sum())
    assert logits.decision_count == real
    assert comparison.padding is not None
    assert comparison.padding.to_json() == {
        "input": "m", "padding_value": 0, "positions_left_out": data["m"].size - real,
        "positions": data["m"].size}
    # counted everywhere, the same two models disagree on most padding positions
    unmasked = _tagger(padding_noise=50.0, start_scores=True, mask_to_softmax=False)
    plain = compare_models(_tagger(mask_to_softmax=False, start_scores=True), unmasked,
                           _batches(data))
    assert plain.padding is None and plain.outputs[0].top1_agreement < 0.8


@pytest.mark.parametrize(("spelling", "left_out"), [
    ("1 padding", "the positions where the mask is 1"),
    ("rows", None),  # the padding's content changes the real tokens' outputs: no padding mask
    ("additive", None),  # values 0 and -10000: no mask of 0 and 1
])
def test_which_value_marks_padding_is_measured(spelling: str, left_out: str | None) -> None:
    """PyTorch's key_padding_mask is True where padding: the float model run again with the
    content of one value's positions changed shows which value's positions no output reads."""
    data = _padded(24)
    mask = {"1 padding": data["m"] == 0, "rows": data["m"],
            "additive": (1 - data["m"]) * -10000.0}[spelling]
    feed = {"ids": data["ids"], "m": mask.astype(np.float32 if spelling == "additive" else
                                                 bool if spelling == "1 padding" else np.int64)}
    mask_type = {"1 padding": TensorProto.BOOL, "rows": TensorProto.INT64,
                 "additive": TensorProto.FLOAT}[spelling]
    model = _tagger(spelling=spelling, mask_type=mask_type)
    assert attention_mask(model) is not None  # by data flow: it reaches the scores
    comparison = compare_models(model, _tagger(spelling=spelling, mask_type=mask_type,
                                               padding_noise=50.0), _batches(feed))
    if left_out is None:
        assert comparison.padding is None
        assert comparison.outputs[0].decision_count == 24 * LENGTH
    else:
        assert comparison.padding is not None
        assert comparison.padding.left_out == int((data["m"] == 0).sum())
        assert comparison.padding.value == 1
        assert comparison.outputs[0].top1_agreement == 1.0
    # a mask of zeros alone (no padding in the data, or an additive mask with none to add)
    # leaves nothing out: there was no real token to compare otherwise
    full = {"ids": np.where(data["ids"] == 0, 5, data["ids"]),
            "m": np.zeros_like(feed["m"])}
    whole = compare_models(model, model, _batches(full))
    assert whole.padding is None and whole.outputs[0].decision_count == 24 * LENGTH


def test_a_span_label_counts_among_the_real_positions() -> None:
    """Left padding moves a span's start among a sample's real positions: labels (absolute
    positions) are counted among them, so the float model's own choices score 100 %."""
    data = _padded(16)
    left = {k: v[:, ::-1].copy() for k, v in data.items()}  # padding first
    model = _tagger(start_scores=True)
    start = run_model(model, left)[1]
    labels = np.argmax(np.where(left["m"] == 1, start, -np.inf), axis=1)
    comparison = compare_models(model, model, _batches(left), labels=labels)
    assert comparison.padding is not None
    assert comparison.outputs[1].float_accuracy == 1.0


def test_a_mask_of_other_values_and_a_batch_without_padding_change_nothing() -> None:
    data = _padded(8)
    full = {"ids": np.where(data["ids"] == 0, 5, data["ids"]), "m": np.ones_like(data["m"])}
    other = _tagger(padding_noise=50.0)
    comparison = compare_models(_tagger(), other, _batches(full))
    assert comparison.padding is None and comparison.outputs[0].decision_count == 8 * LENGTH
    weights = {"ids": data["ids"], "m": data["m"] * 2}  # 0 and 2: not a mask of 0 and 1
    comparison = compare_models(_tagger(), other, _batches(weights))
    assert comparison.padding is None and comparison.outputs[0].decision_count == 8 * LENGTH


def test_sensitivity_sums_leave_padding_out() -> None:
    x = np.random.default_rng(2).normal(size=(2, 5, 3))
    y = x.copy()
    y[0, 3:] += 10.0  # only at padding
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    masked = _OutputNoise.empty(1, [DecisionRule(linear=True)], (True,))
    masked.add([x], [y], valid)
    assert masked.noise == [0.0] and masked.rows == [8] and masked.agree == [8]
    counted = _OutputNoise.empty(1, [DecisionRule(linear=True)], (False,))
    counted.add([x], [y], valid)
    assert counted.noise[0] > 0 and counted.rows == [10]


def test_a_calibration_of_padded_sentences_reports_the_positions_left_out(tmp_path: Path) -> None:
    onnx.save(_tagger(), tmp_path / "tagger.onnx")
    data = _padded(64, seed=3)
    np.savez(tmp_path / "calib.npz", **data)
    result = CliRunner().invoke(main, [
        "calibrate", str(tmp_path / "tagger.onnx"), "--data", str(tmp_path / "calib.npz"),
        "--min-product-macs", "0", "--min-coverage", "0", "--allow-slower", "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q.qcal.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    padding = report["evaluation"]["padding"]
    assert padding["input"] == "m"
    samples = report["evaluation"]["samples"]
    assert padding["positions"] == samples * LENGTH
    (logits,) = report["evaluation"]["outputs"]
    assert logits["decision_count"] == padding["positions"] - padding["positions_left_out"]
    assert "where 'm' is 0 (padding) left out" in " ".join(result.output.split())
    compared = CliRunner().invoke(main, [
        "compare", str(tmp_path / "tagger.onnx"), str(tmp_path / "q.onnx"), "--data",
        str(tmp_path / "calib.npz"), "--json", str(tmp_path / "compare.json")])
    assert compared.exit_code == 0, compared.output
    left_out = json.loads((tmp_path / "compare.json").read_text())["padding"]
    assert left_out["positions"] == 64 * LENGTH
    assert left_out["positions_left_out"] == int((data["m"] == 0).sum())
    assert f"the {left_out['positions_left_out']} positions" in " ".join(compared.output.split())
