"""GPTQ weight rounding: the algorithm against its definition, the input Hessians against an
independent unfolding, and `--weight-rounding gptq` end to end (better outputs, same bytes
whatever the batching and data order)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qcal.calibration import hessians
from qcal.calibration.hessians import HessianTarget, collect_hessians, hessian_target
from qcal.cli import main
from qcal.numerics import bias_correction
from qcal.numerics.bias_correction import output_mean_shift
from qcal.numerics.gptq import gptq_codes, output_error
from qcal.numerics.onnx_mapping import OnnxQParams

SAMPLE_MODELS = Path(__file__).resolve().parents[1] / "sample_models"


def _symmetric(weights: np.ndarray, levels: int = 63) -> tuple:
    """A per-row symmetric quantizer of (groups, rows, inputs) weights, and its inverse."""
    scale = np.abs(weights).max(axis=2).reshape(-1) / levels

    def quantize(column: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(column / scale), -levels - 1, levels).astype(np.int8)

    def dequantize(codes: np.ndarray) -> np.ndarray:
        return codes.astype(np.float64) * scale.reshape((-1,) + (1,) * (codes.ndim - 1))

    return quantize, dequantize


def _correlated(rng: np.random.Generator, groups: int, inputs: int) -> np.ndarray:
    mix = rng.normal(size=(inputs, inputs)) * 0.4 + np.eye(inputs)
    x = rng.normal(size=(groups, 800, inputs)) @ mix
    return np.einsum("gpi,gpj->gij", x, x)


def test_output_error_is_the_relative_squared_output_error() -> None:
    rng = np.random.default_rng(1)
    w, delta = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5)) * 0.01
    x = rng.normal(size=(2, 40, 5))
    hessian = np.einsum("gpi,gpj->gij", x, x)
    expected = sum(np.sum((x[g] @ delta[g].T) ** 2) for g in range(2)) / sum(
        np.sum((x[g] @ w[g].T) ** 2) for g in range(2))
    assert output_error(delta, w, hessian) == pytest.approx(expected, rel=1e-12)


def test_gptq_lowers_the_output_error_of_correlated_inputs() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 16, 150))
    hessian = _correlated(rng, 3, 150)
    quantize, dequantize = _symmetric(w)
    result = gptq_codes(w, hessian, quantize, dequantize)
    nearest = np.stack([quantize(w.reshape(48, 150)[:, j]) for j in range(150)], axis=1)
    restored = lambda c: np.stack([dequantize(c[:, j]) for j in range(c.shape[1])], 1)
    # The errors it reports are the definition's, computed here independently.
    assert result.error_nearest == pytest.approx(
        output_error(restored(nearest).reshape(w.shape) - w, w, hessian), rel=1e-12)
    assert result.error_gptq == pytest.approx(
        output_error(restored(result.codes).reshape(w.shape) - w, w, hessian), rel=1e-12)
    assert result.error_gptq < 0.7 * result.error_nearest
    assert result.codes.dtype == np.int8 and result.codes.min() >= -64 and result.codes.max() <= 63
    assert not np.array_equal(result.codes, nearest)


def test_uncorrelated_inputs_give_the_nearest_codes() -> None:
    """With H a multiple of the identity no column's error can be absorbed by another."""
    rng = np.random.default_rng(2)
    w = rng.normal(size=(1, 8, 30))
    quantize, dequantize = _symmetric(w)
    result = gptq_codes(w, np.eye(30)[None] * 7.0, quantize, dequantize)
    nearest = np.stack([quantize(w[0][:, j]) for j in range(30)], axis=1)
    assert np.array_equal(result.codes, nearest)
    assert result.error_gptq == result.error_nearest


def test_inputs_that_never_vary_keep_their_nearest_codes() -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(size=(1, 6, 20))
    hessian = _correlated(rng, 1, 20)
    hessian[:, 4, :] = hessian[:, :, 4] = 0.0  # input 4 is always zero
    quantize, dequantize = _symmetric(w)
    result = gptq_codes(w, hessian, quantize, dequantize)
    assert np.array_equal(result.codes[:, 4], quantize(w[0][:, 4]))
    assert result.error_gptq <= result.error_nearest


# ---------------------------------------------------------------------- input Hessians


def _act(scale: float, zero_point: int) -> OnnxQParams:
    return OnnxQParams(dtype=TensorProto.UINT8, scale=np.array(scale, np.float32),
                       zero_point=np.array(zero_point, np.uint8), axis=None, clip_min=None,
                       clip_max=None, exact=True, deviations=(), replacement=None, min_opset=10)


def _conv_model(weight: np.ndarray, **attrs: object) -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 7, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _naive_conv_hessian(x: np.ndarray, target: HessianTarget, weight_shape: tuple,
                        limit: int) -> np.ndarray:
    """Output position by output position, the patch each sees, in plain loops: H of each
    sample's first `limit` positions, evenly spaced, when it has more; the sums of all."""
    lo, hi = target.code_range
    codes = np.clip(np.rint(x.astype(np.float32) / np.float32(target.scale)) + target.zero_point,
                    lo, hi).astype(np.int64) - target.zero_point
    (kh, kw), (sh, sw), (dh, dw) = target.kernel, target.strides, target.dilations
    top, left, bottom, right = target.pads
    per_group = weight_shape[1]
    hessian = np.zeros((target.groups, target.inputs_per_group, target.inputs_per_group), np.int64)
    sums = np.zeros((target.groups, target.inputs_per_group), np.int64)
    count = 0
    height, width = x.shape[2] + top + bottom, x.shape[3] + left + right
    rows, cols = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    total = rows * cols
    # H sees `limit` evenly spaced positions of each sample; the sums see every position
    chosen = set(range(total) if total <= limit else [i * total // limit for i in range(limit)])
    for sample in codes:
        for position in range(total):
            oy, ox = divmod(position, cols)
            for g in range(target.groups):
                patch = []
                for c in range(g * per_group, (g + 1) * per_group):
                    for i in range(kh):
                        for j in range(kw):
                            y, xx = oy * sh + i * dh - top, ox * sw + j * dw - left
                            inside = 0 <= y < x.shape[2] and 0 <= xx < x.shape[3]
                            patch.append(sample[c, y, xx] if inside else 0)
                v = np.array(patch, np.int64)
                if position in chosen:
                    hessian[g] += np.outer(v, v)
                sums[g] += v
            count += 1
    return hessian, sums, count


@pytest.mark.parametrize(("attrs", "limit"), [
    ({"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2], "group": 2}, 4096),
    ({"pads": [0, 0, 0, 0], "strides": [1, 1]}, 4096),
    ({"pads": [1, 1, 1, 1], "strides": [1, 1]}, 7),  # only 7 positions of each sample
])
def test_conv_hessian_matches_the_patches_it_sees(
    attrs: dict, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hessians, "POSITIONS_PER_SAMPLE", limit)
    rng = np.random.default_rng(4)
    group = int(attrs.get("group", 1))
    weight = rng.normal(size=(6, 4 // group, 3, 2)).astype(np.float32)
    model = _conv_model(weight, **attrs)
    target = hessian_target(model.graph.node[0], weight.shape, _act(0.05, 11))
    assert isinstance(target, HessianTarget)
    x = rng.normal(size=(3, 4, 7, 6)).astype(np.float32) * 3
    measured = collect_hessians(model, [target], lambda: [({"x": x}, 3)])["conv"]
    one_by_one = collect_hessians(
        model, [target], lambda: [({"x": x[i : i + 1]}, 1) for i in (2, 0, 1)])["conv"]
    whole = measured.hessian
    assert whole is not None and whole.dtype == np.int64
    expected, sums, count = _naive_conv_hessian(x, target, weight.shape, limit)
    assert np.array_equal(whole, expected)
    assert np.array_equal(measured.sums, sums) and measured.count == count
    assert one_by_one.hessian is not None  # any batching, any order: integers
    assert np.array_equal(whole, one_by_one.hessian)
    assert np.array_equal(measured.sums, one_by_one.sums)
    sums_only = dataclasses.replace(target, products=False)  # bias correction alone
    only = collect_hessians(model, [sums_only], lambda: [({"x": x}, 3)])["conv"]
    assert only.hessian is None
    assert np.array_equal(only.sums, sums) and only.count == count
    # The float input's means, from every patch of the unquantized input (zero padding)
    assert np.array_equal(measured.real_sums, one_by_one.real_sums)
    real = _naive_patch_means(x, target, weight.shape)
    assert np.allclose(measured.real_means(), real, rtol=0, atol=target.scale / 2**16)
    assert not np.allclose(measured.means(), real, rtol=0, atol=target.scale / 2**16)


def _naive_patch_means(x: np.ndarray, target: HessianTarget, weight_shape: tuple) -> np.ndarray:
    (kh, kw), (sh, sw), (dh, dw) = target.kernel, target.strides, target.dilations
    top, left, bottom, right = target.pads
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (top, bottom), (left, right)])
    rows = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
    cols = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    patches = [padded[n, :, oy * sh + i * dh, ox * sw + j * dw]
               for n in range(x.shape[0]) for oy in range(rows) for ox in range(cols)
               for i in range(kh) for j in range(kw)]
    per_tap = np.array(patches).reshape(-1, kh * kw, x.shape[1])  # (positions, taps, channels)
    means = per_tap.mean(axis=0).T  # (channels, taps)
    return means.reshape(target.groups, weight_shape[1] * kh * kw)


def test_matmul_hessian_is_the_codes_gram_matrix() -> None:
    rng = np.random.default_rng(5)
    weight = rng.normal(size=(5, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    target = hessian_target(model.graph.node[0], weight.shape, _act(0.02, 128))
    assert isinstance(target, HessianTarget)
    x = rng.normal(size=(2, 4, 5)).astype(np.float32)
    codes = np.clip(np.rint(x / np.float32(0.02)) + 128, 0, 255).astype(np.int64) - 128
    rows = codes.reshape(-1, 5)
    got = collect_hessians(model, [target], lambda: [({"x": x}, 2)])["mm"]
    assert got.hessian is not None and np.array_equal(got.hessian, (rows.T @ rows)[None])
    assert np.array_equal(got.sums, rows.sum(axis=0)[None]) and got.count == 8
    assert got.means() == pytest.approx(rows.mean(axis=0)[None] * float(np.float32(0.02)), rel=1e-12)
    real = x.astype(np.float64).reshape(-1, 5).mean(axis=0)[None]
    assert np.allclose(got.real_means(), real, rtol=0, atol=0.02 / 2**16)


# ---------------------------------------------------------------------- end to end


def _calibrate(tmp: Path, model: Path, name: str, *args: str) -> dict:
    result = CliRunner().invoke(main, [
        "calibrate", "--min-product-macs", "0", str(model), "-o", str(tmp / f"{name}.onnx"), "--report",
        str(tmp / f"{name}.json"), "--no-fallback", "-q", *args])
    assert result.exit_code == 0, result.output
    return json.loads((tmp / f"{name}.json").read_text())


@pytest.mark.parametrize("model", ["digits_cnn", "transformer_block"])
def test_gptq_improves_the_quantized_model(tmp_path: Path, model: str) -> None:
    path = SAMPLE_MODELS / f"{model}.onnx"
    nearest = _calibrate(tmp_path, path, "nearest", "--weight-rounding", "nearest")
    gptq = _calibrate(tmp_path, path, "gptq", "--weight-rounding", "gptq")
    onnx.checker.check_model(str(tmp_path / "gptq.onnx"))
    sqnr = lambda r: min(o["sqnr_db"] for o in r["evaluation"]["outputs"])
    assert sqnr(gptq) > sqnr(nearest) + 1.0
    rounded = [t for t in gptq["tensors"] if "rounding" in t]
    assert rounded and all(t["role"] == "weight" for t in rounded)
    assert all(t["rounding"]["output_error"] < t["rounding"]["output_error_nearest"]
               for t in rounded)
    assert "rounding" not in json.dumps(nearest["tensors"])
    # Same scales as rounding to nearest: only the codes differ.
    scales = lambda r: {t["name"]: t["onnx"]["scale"] for t in r["tensors"]}
    assert scales(gptq) == scales(nearest)


def test_gptq_output_does_not_depend_on_batching_or_order(tmp_path: Path) -> None:
    with np.load(SAMPLE_MODELS / "digits_cnn.calib.npz") as data:
        arrays = {k: data[k][:64] for k in data.files}
    forward, backward = tmp_path / "forward.npz", tmp_path / "backward.npz"
    np.savez(forward, **arrays)
    np.savez(backward, **{k: v[::-1] for k, v in arrays.items()})
    model = SAMPLE_MODELS / "digits_cnn.onnx"
    common = ["--weight-rounding", "gptq", "--eval-data", str(forward)]
    _calibrate(tmp_path, model, "a", "--data", str(forward), *common)
    _calibrate(tmp_path, model, "b", "--data", str(backward), "--batch-size", "7", *common)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


# ---------------------------------------------------------------------- bias correction


def test_output_mean_shift_is_the_quantized_mean_less_the_float_mean() -> None:
    rng = np.random.default_rng(6)
    weight = rng.normal(size=(6, 2, 3, 3))  # a Conv with 2 groups of 3 output channels
    scale = np.abs(weight).reshape(6, -1).max(axis=1) / 63.5
    codes = np.clip(np.rint(weight / scale[:, None, None, None]), -64, 63).astype(np.int8)
    means = rng.normal(size=(2, 18))
    real = means + rng.normal(size=(2, 18)) * 0.1  # the input before quantization
    shift = output_mean_shift(weight, codes, row_axis=0, scale=scale,
                              zero_point=np.zeros(6, np.int8), input_means=means,
                              real_means=real)
    for o in range(6):
        restored = codes[o].astype(np.float64).reshape(-1) * scale[o]
        expected = restored @ means[o // 3] - weight[o].reshape(-1) @ real[o // 3]
        assert shift[o] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    same = output_mean_shift(weight, codes, row_axis=0, scale=scale,
                             zero_point=np.zeros(6, np.int8), input_means=means,
                             real_means=means)  # an input quantized without a mean error
    for o in range(6):
        restored = codes[o].astype(np.float64).reshape(-1) * scale[o]
        expected = (restored - weight[o].reshape(-1)) @ means[o // 3]
        assert same[o] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # MatMul weights (K, N): the output channels are the columns.
    w2 = rng.normal(size=(5, 4))
    c2 = np.rint(w2 / 0.05).astype(np.int8)
    mean2 = rng.normal(size=(1, 5))
    got = output_mean_shift(w2, c2, row_axis=1, scale=np.float32(0.05),
                            zero_point=np.int8(0), input_means=mean2, real_means=mean2)
    assert got == pytest.approx((c2 * float(np.float32(0.05)) - w2).T @ mean2[0], rel=1e-9)


@pytest.mark.parametrize(("shape", "row_axis", "groups"), [
    ((24, 8, 3, 3), 0, 1), ((24, 1, 3, 3), 0, 24), ((24, 4, 3, 3), 0, 6), ((40, 24), 1, 1)])
def test_output_mean_shift_in_blocks_of_rows_is_the_shift_of_the_whole_weight(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], row_axis: int, groups: int
) -> None:
    """A large weight is converted to float64 a block of rows at a time (memory); the shift is
    the one the whole weight gives, exactly where rows are contiguous (Conv weights)."""
    rng = np.random.default_rng(7)
    weight = rng.normal(size=shape).astype(np.float32)
    rows = shape[row_axis]
    along = [1] * len(shape)
    along[row_axis] = rows
    scale = (np.abs(weight).max(axis=tuple(a for a in range(len(shape)) if a != row_axis))
             / 127).astype(np.float32)
    codes = np.clip(np.rint(weight / scale.reshape(along)), -127, 127).astype(np.int8)
    inputs = weight.size // rows
    means, real = rng.normal(size=(groups, inputs)), rng.normal(size=(groups, inputs))
    kwargs = {"row_axis": row_axis, "scale": scale, "zero_point": np.zeros(rows, np.int8),
              "input_means": means, "real_means": real}
    whole = output_mean_shift(weight, codes, **kwargs)
    for block in (1, 5, 40):  # fewer values than one row, a few rows, several groups
        monkeypatch.setattr(bias_correction, "_BLOCK_VALUES", block)
        blocked = output_mean_shift(weight, codes, **kwargs)
        if row_axis == 0:
            assert np.array_equal(blocked, whole), block
        else:
            np.testing.assert_allclose(blocked, whole, rtol=1e-12, atol=1e-12)


def test_bias_correction_removes_the_mean_output_error(tmp_path: Path) -> None:
    """digits CNN: the biases take back the mean shift of the 7-bit weights, measured on the
    evaluation data (which the correction never saw), and only the biases change."""
    path = SAMPLE_MODELS / "digits_cnn.onnx"
    plain = _calibrate(tmp_path, path, "plain", "--no-bias-correction")
    corrected = _calibrate(tmp_path, path, "corrected", "--bias-correction")
    onnx.checker.check_model(str(tmp_path / "corrected.onnx"))
    sqnr = lambda r: min(o["sqnr_db"] for o in r["evaluation"]["outputs"])
    assert sqnr(corrected) > sqnr(plain) + 1.0
    shifted = [t for t in corrected["tensors"] if "bias_correction" in t]
    assert shifted and all(t["role"] == "weight" for t in shifted)
    changed = _differing_initializers(tmp_path / "plain.onnx", tmp_path / "corrected.onnx")
    assert changed and all(i.data_type == TensorProto.INT32 for i in changed)  # biases only


def _differing_initializers(a: Path, b: Path) -> list[onnx.TensorProto]:
    first = {i.name: i for i in onnx.load(str(a)).graph.initializer}
    return [i for i in onnx.load(str(b)).graph.initializer
            if i.name in first and i.SerializeToString() != first[i.name].SerializeToString()]
