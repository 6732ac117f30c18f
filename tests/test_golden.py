"""Golden vectors: every vector of every JSON file runs through qcal's presets, observers,
``compute_qparams`` and fake-quant, and must match bit for bit (format: tests/golden/README.md
of the shared spec; meanings: SEMANTICS.md).

``QCAL_GOLDEN_DIR`` names another directory of vector files in the same format. An API string or
parameter qcal does not understand fails the test; nothing is skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qcal.numerics.errors import EmptyStatisticsError
from qcal.numerics.observers import (
    Granularity,
    MindSporeObserver,
    MinMaxStats,
    PerChannel,
    PerTensor,
)
from qcal.numerics.presets import TensorRecipe, build_preset
from qcal.numerics.schemes import QParams

GOLDEN_DIR = Path(os.environ.get("QCAL_GOLDEN_DIR", Path(__file__).parent / "golden"))

Computed = dict[str, Any]


def _array(data: Mapping[str, Any]) -> np.ndarray:
    values = [np.nan if v is None else float(v) for v in data["values"]]
    return np.asarray(values, dtype=np.float32).reshape(data["shape"])


def _feed(
    recipe: TensorRecipe, method: str, granularity: Granularity, batches: list[Any]
) -> MinMaxStats:
    observer = recipe.observer(method, granularity)
    for batch in batches:
        observer.update(_array(batch))
    state = observer.state()
    assert isinstance(state, MinMaxStats)
    return state


def _params_fields(qparams: QParams) -> Computed:
    fields: Computed = {
        "scale": qparams.scale,
        "zero_point": qparams.zero_point,
        "quant_min": qparams.quant_min,
        "quant_max": qparams.quant_max,
    }
    fields.update(qparams.extras)
    return fields


def _run(recipe: TensorRecipe, stats: MinMaxStats, vector: Mapping[str, Any]) -> Computed:
    qparams = recipe.qparams(stats)
    computed = _params_fields(qparams)
    computed.update(min_val=stats.min, max_val=stats.max)
    computed["output"] = recipe.fake_quantize(_array(vector["input"]), qparams)
    return computed


# ---------------------------------------------------------------------------------------------
# one adapter per API: vector params -> preset knobs, observer method, granularity


def _torch_observer(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    preset = build_preset("pytorch", params)
    per_channel = "PerChannel" in params["observer"]
    granularity: Granularity = PerChannel(params.get("ch_axis", 0)) if per_channel else PerTensor()
    try:
        stats = _feed(preset.activation, preset.native_method, granularity, vector["batches"])
    except EmptyStatisticsError:
        # qcal refuses to invent parameters; PyTorch's unobserved state is (+inf, -inf) (§1.2),
        # which compute_qparams maps to scale 1.0 / zero point 0 as PyTorch does (§1.3).
        stats = MinMaxStats(np.float32(np.inf), np.float32(-np.inf))
    return _run(preset.activation, stats, vector)


def _torch_fake_quant(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    qmin, qmax = params.pop("quant_min"), params.pop("quant_max")
    scale, zero_point, axis = (
        params.pop("scale"),
        params.pop("zero_point"),
        params.pop("axis", None),
    )
    assert not params, f"unsupported fake-quant arguments {sorted(params)}"
    dtype = (
        "quint8"
        if 0 <= qmin and qmax <= 255
        else "qint8"
        if -128 <= qmin and qmax <= 127
        else "qint32"
    )
    qscheme = "per_channel_affine" if axis is not None else "per_tensor_affine"
    recipe = build_preset(
        "pytorch", {"dtype": dtype, "qscheme": qscheme, "quant_min": qmin, "quant_max": qmax}
    ).activation
    shape = (-1,) if axis is not None else ()
    qparams = QParams(
        np.asarray(scale, dtype=np.float32).reshape(shape),
        np.asarray(zero_point, dtype=np.int64).reshape(shape),
        qmin,
        qmax,
        axis,
    )
    return {"output": recipe.fake_quantize(_array(vector["input"]), qparams)}


def _tensorflow(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    assert not vector["batches"], "quantize_and_dequantize_v2 is stateless: no batches expected"
    preset = build_preset("tensorflow", params)
    axis = params.get("axis")
    granularity: Granularity = PerChannel(axis) if axis is not None else PerTensor()
    x = _array(vector["input"])
    observer = preset.activation.observer("minmax", granularity)
    observer.update(x)
    try:
        stats = observer.state()
    except EmptyStatisticsError:
        # TF maps an empty tensor to an empty tensor and computes no parameters (§2.4).
        scheme = preset.activation.scheme
        nothing = [None]
        return {
            "output": x,
            "quant_min": scheme.quant_min,
            "quant_max": scheme.quant_max,
            **{
                k: nothing
                for k in ("scale", "zero_point", "multiplier", "adjusted_min", "adjusted_max")
            },
        }
    return _run(preset.activation, stats, vector)


def _oneflow(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    formula = params.pop("quantization_formula", "google")
    assert params.pop("training", True), "OneFlow observers update only in training mode"
    stop = params.pop("stop_update_after_iters", None)
    assert stop is None or stop >= len(vector["batches"]), (
        "updates stopping mid-run are not modelled"
    )
    observer = vector["api"].split("+")[0].rsplit(".", 1)[-1]
    preset = build_preset(f"oneflow-{formula}", {**params, "observer": observer})
    per_layer = params.get("per_layer_quantization", True)
    granularity: Granularity = PerTensor() if per_layer else PerChannel(0)
    stats = _feed(preset.activation, preset.native_method, granularity, vector["batches"])
    computed = _run(preset.activation, stats, vector)
    computed.update(moving_min=stats.min, moving_max=stats.max)
    if "shift" in computed:  # cambricon reports the shift exponent as its "scale" (§3.1)
        computed["effective_scale"] = computed["scale"]
        computed["scale"] = computed.pop("shift")
    return computed


def _mindspore(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    training = params.pop("training", True)
    maxq = params.pop("maxq", None)
    preset = build_preset("mindspore", params)
    knobs = preset.knobs
    axis = int(knobs["channel_axis"])  # type: ignore[call-overload]
    granularity: Granularity = PerChannel(axis) if knobs["per_channel"] else PerTensor()
    if knobs["mode"] == "LEARNED_SCALE":
        # maxq is the trained parameter: the range it stands for is [-maxq, maxq] ([0, maxq]).
        alpha = np.asarray(maxq, dtype=np.float32).reshape((-1,) if knobs["per_channel"] else ())
        low = np.zeros_like(alpha) if knobs["neg_trunc"] else -alpha
        stats = MinMaxStats(low, alpha, axis if knobs["per_channel"] else None)
    else:
        observer = MindSporeObserver(
            granularity,
            ema=bool(knobs["ema"]),
            ema_decay=float(knobs["ema_decay"]),  # type: ignore[arg-type]
            min_init=knobs["min_init"],  # type: ignore[arg-type]
            max_init=knobs["max_init"],  # type: ignore[arg-type]
        )
        if training:
            for batch in vector["batches"]:
                observer.update(_array(batch))
            stats = observer.state()
        else:  # eval mode: the stored range is used as it is (§4.2)
            assert not vector["batches"], "eval-mode cells do not observe batches"
            stats = observer.initial_state(int(knobs["num_channels"]))  # type: ignore[call-overload]
    return _run(preset.activation, stats, vector)


def _horizon(vector: Mapping[str, Any]) -> Computed:
    params = dict(vector["params"])
    training = params.pop("training", True)
    given = params.pop("set_qparams", None)
    preset = build_preset("horizon", params)
    recipe = preset.activation
    ch_axis = int(preset.knobs["ch_axis"])  # type: ignore[call-overload]
    if given is not None:
        # set_qparams(scale, zero_point=None): the zero point resets to 0 (§5.4).
        scale = np.asarray(given["scale"], dtype=np.float32).reshape((-1,) if ch_axis >= 0 else ())
        zero_point = np.asarray(
            given["zero_point"] or np.zeros(scale.shape), dtype=np.int64
        ).reshape(scale.shape)
        scheme = recipe.scheme
        qparams = QParams(
            scale, zero_point, scheme.quant_min, scheme.quant_max, ch_axis if ch_axis >= 0 else None
        )
        computed = _params_fields(qparams)
        computed["output"] = recipe.fake_quantize(_array(vector["input"]), qparams)
        return computed
    assert training, "an eval-mode FakeQuantize without set_qparams has no parameters"
    granularity: Granularity = PerChannel(ch_axis) if ch_axis >= 0 else PerTensor()
    stats = _feed(recipe, preset.native_method, granularity, vector["batches"])
    return _run(recipe, stats, vector)


ADAPTERS: Mapping[str, Callable[[Mapping[str, Any]], Computed]] = {
    "torch.ao.quantization.observer.MinMaxObserver": _torch_observer,
    "torch.ao.quantization.observer.MovingAverageMinMaxObserver": _torch_observer,
    "torch.ao.quantization.observer.PerChannelMinMaxObserver": _torch_observer,
    "torch.ao.quantization.observer.MovingAveragePerChannelMinMaxObserver": _torch_observer,
    "torch.fake_quantize_per_tensor_affine": _torch_fake_quant,
    "torch.fake_quantize_per_channel_affine": _torch_fake_quant,
    "tf.quantization.quantize_and_dequantize_v2": _tensorflow,
    "oneflow.nn.MinMaxObserver+oneflow.nn.FakeQuantization": _oneflow,
    "oneflow.nn.MovingAverageMinMaxObserver+oneflow.nn.FakeQuantization": _oneflow,
    "mindspore.nn.FakeQuantWithMinMaxObserver": _mindspore,
    "horizon_plugin_pytorch.quantization.FakeQuantize": _horizon,
}


# ---------------------------------------------------------------------------------------------
# comparison (README: float32 bit for bit, NaN == NaN, -0.0 == 0.0, integers exactly)


def _mismatch(expected: Any, got: Any) -> str | None:
    """None when equal, else a short description of the first difference."""
    if isinstance(expected, dict):  # a tensor: {shape, values}
        got_array = np.asarray(got)
        if list(got_array.shape) != list(expected["shape"]):
            return f"shape {list(got_array.shape)} != {expected['shape']}"
        return _mismatch(expected["values"], got_array.ravel())
    if not isinstance(expected, list):
        return (
            None
            if isinstance(got, (int, np.integer)) and int(got) == expected
            else f"{got!r} != {expected!r}"
        )
    if all(e is None for e in expected):
        return (
            None
            if got is not None and all(g is None for g in np.ravel(np.asarray(got, dtype=object)))
            else f"{got!r} != {expected!r}"
        )
    got_flat = np.ravel(np.asarray(got))
    if got_flat.size != len(expected):
        return f"{got_flat.size} values, expected {len(expected)}"
    if got_flat.dtype.kind in "iu":
        wrong = [
            i
            for i, (g, e) in enumerate(zip(got_flat.tolist(), expected, strict=True))
            if not isinstance(e, int) or g != e
        ]
    else:
        want = np.asarray([float(e) for e in expected], dtype=np.float32)
        have = got_flat.astype(np.float32)
        same = (have == want) | (np.isnan(have) & np.isnan(want))
        wrong = np.flatnonzero(~same).tolist()
    if not wrong:
        return None
    i = wrong[0]
    first = f"first at {i}: got {got_flat[i]!r}, expected {expected[i]!r}"
    return f"{len(wrong)} of {len(expected)} differ; {first}"


def _vectors() -> Iterator[Any]:
    paths = sorted(GOLDEN_DIR.glob("*.json"))
    for path in paths:
        data = json.loads(path.read_text())
        for vector in data["vectors"]:
            yield pytest.param(vector, id=f"{path.stem}:{vector['id']}")
    if not paths:
        yield pytest.param(None, id="no-vector-files")


@pytest.mark.parametrize("vector", list(_vectors()))
def test_golden_vector(vector: Mapping[str, Any] | None) -> None:
    assert vector is not None, f"no golden vector files in {GOLDEN_DIR}"
    adapter = ADAPTERS.get(vector["api"])
    assert adapter is not None, f"API {vector['api']!r} is not supported by qcal"
    computed = adapter(vector)
    problems = []
    for key, expected in vector["expected"].items():
        if key not in computed:
            problems.append(f"{key}: not produced")
            continue
        difference = _mismatch(expected, computed[key])
        if difference:
            problems.append(f"{key}: {difference}")
    assert not problems, f"{vector['id']}: " + "; ".join(problems)


def test_golden_directory_has_vectors() -> None:
    files = sorted(GOLDEN_DIR.glob("*.json"))
    assert files, f"no golden vector files in {GOLDEN_DIR}"
    for path in files:
        data = json.loads(path.read_text())
        assert data["format_version"] == 1
        assert data["count"] == len(data["vectors"])


def test_mindspore_documentation_example() -> None:
    """Seed 000's example: a fresh (eval-mode) cell with default arguments, SEMANTICS.md §4.6."""
    preset = build_preset("mindspore")
    stats = MindSporeObserver(PerTensor()).initial_state()  # the stored range [-6, 6]
    qparams = preset.activation.qparams(stats)
    assert qparams.scale == np.float32("0.047058824")
    assert qparams.extras["zero_point_unsigned"] == 128
    assert qparams.extras["nudged_min"] == np.float32("-6.0235295")
    x = np.array([[1, 2, 1], [-2, 0, -1]], dtype=np.float32)
    out = preset.activation.fake_quantize(x, qparams)
    documented = np.array(
        [[0.9882355, 1.9764705, 0.9882355], [-1.9764705, 0.0, -0.9882355]], dtype=np.float32
    )
    np.testing.assert_array_equal(out, documented)
    # The same formula in float64 rounds 170.5 up for x = 2 and misses the documented output.
    scale64 = 12.0 / 255.0
    nudged_min64 = (0 - round(6.0 / scale64)) * scale64
    t64 = (2.0 - nudged_min64) / scale64
    assert t64 == 170.5
    assert abs(np.floor(t64 + 0.5) * scale64 + nudged_min64 - 2.0235294) < 1e-6


def test_cambricon_vectors_report_the_shift_as_scale() -> None:
    """A cambricon vector's ``scale`` is the shift exponent and ``effective_scale`` its power
    of two (§3.1); the adapter maps both (the public vectors only use the google formula)."""
    x = np.array([-15.772991, 3.5, 22.076004, -0.3, 7.0], dtype=np.float32)
    shift = np.floor(np.log2(np.float32(22.076004))) - (4 - 2)
    step = np.float32(2.0**shift)
    expected_output = np.clip(np.rint(x / step), -8, 7) * step
    vector = {
        "id": "cambricon_4bit",
        "api": "oneflow.nn.MinMaxObserver+oneflow.nn.FakeQuantization",
        "params": {
            "quantization_formula": "cambricon",
            "quantization_bit": 4,
            "quantization_scheme": "symmetric",
            "per_layer_quantization": True,
        },
        "batches": [{"shape": [5], "values": x.tolist()}],
        "input": {"shape": [5], "values": x.tolist()},
    }
    computed = ADAPTERS[vector["api"]](vector)
    assert _mismatch([float(shift)], computed["scale"]) is None
    assert _mismatch([float(step)], computed["effective_scale"]) is None
    assert _mismatch({"shape": [5], "values": expected_output.tolist()}, computed["output"]) is None
