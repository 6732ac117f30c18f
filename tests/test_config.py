from __future__ import annotations

from pathlib import Path

import pytest

from qcal.config import CalibrationConfig, config_from_mapping, load_config_file
from qcal.numerics.errors import ConfigError


def test_flag_names_with_dashes_or_underscores_are_the_same_key() -> None:
    a = config_from_mapping({"batch-size": 4, "exclude-op-types": ["Softmax"]})
    b = config_from_mapping({"batch_size": 4, "exclude_op_types": ["Softmax"]})
    assert a == b
    assert a.batch_size == 4 and a.exclude_op_types == ("Softmax",)


def test_unknown_key_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="'batchsize'"):
        config_from_mapping({"batchsize": 4})


@pytest.mark.parametrize(
    ("key", "value"),
    [("batch_size", "4"), ("batch_size", True), ("per_channel", 1), ("method", 3),
     ("percentile", "high"), ("exclude_nodes", [1, 2]), ("data", 5), ("tensors", [])],
)
def test_wrong_types_are_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        config_from_mapping({key: value})


@pytest.mark.parametrize(
    "values",
    [{"method": "kl"}, {"percentile": 0.0}, {"percentile": 100.5}, {"batch_size": 0},
     {"limit": 0}, {"synthetic": 0}, {"bins": 4}, {"quantized_bins": 4096},
     {"synthetic": 4, "data": "x.npz"}, {"threads": -1}],
)
def test_invalid_values_are_refused(values: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        config_from_mapping(values)


def test_config_file_paths_resolve_against_its_folder(tmp_path: Path) -> None:
    cfg = tmp_path / "sub" / "qcal.toml"
    cfg.parent.mkdir()
    cfg.write_text('data = "calib.npz"\nmethod = "percentile"\n[tensors."x"]\nmethod = "minmax"\n')
    config = config_from_mapping(load_config_file(cfg))
    assert config.data == tmp_path / "sub" / "calib.npz"
    assert config.method_for("x") == "minmax" and config.method_for("y") == "percentile"
    assert config.uses_histograms


def test_tensor_override_unknown_key(tmp_path: Path) -> None:
    cfg = tmp_path / "qcal.toml"
    cfg.write_text('[tensors."x"]\nmethd = "minmax"\n')
    with pytest.raises(ConfigError, match="methd"):
        config_from_mapping(load_config_file(cfg))


def test_tensor_override_skip_with_a_range_names_both_keys(tmp_path: Path) -> None:
    """It said the tensor was "not a quantized activation of this model", which is false."""
    cfg = tmp_path / "qcal.toml"
    for key in ('method = "minmax"', "percentile = 99.9"):
        cfg.write_text(f'[tensors."x"]\nskip = true\n{key}\n')
        with pytest.raises(ConfigError, match=r"qcal.toml: tensors.x.skip = true keeps it "
                           rf"float: {key.split()[0]} cannot apply"):
            config_from_mapping(load_config_file(cfg), where=f"{cfg}: ")
    cfg.write_text('[tensors."x"]\nskip = false\nmethod = "minmax"\n')
    assert config_from_mapping(load_config_file(cfg)).method_for("x") == "minmax"


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "broken.toml"
    cfg.write_text("method = \n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config_file(cfg)


def test_to_json_is_plain_data() -> None:
    import json

    config = CalibrationConfig(data=Path("a.npz"), exclude_nodes=("conv*",))
    text = json.dumps(config.to_json())
    assert '"data": "a.npz"' in text and '"exclude_nodes": ["conv*"]' in text


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"target_sqnr": float("nan")}, "target-sqnr: NaN"),
        ({"percentile": float("nan")}, "percentile: NaN"),
        ({"min_coverage": float("inf")}, "min-coverage: inf is not a finite number"),
        ({"fail_under_sqnr": float("inf")}, "fail-under-sqnr: inf"),
        ({"seed": -1}, "seed: -1 must be 0 or more"),
    ],
)
def test_numbers_at_the_edge_of_their_type_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_mapping(values)


def test_minus_infinity_turns_the_sqnr_gate_off() -> None:
    assert config_from_mapping({"fail_under_sqnr": float("-inf")}).fail_under_sqnr is None


def test_one_key_spelled_two_ways_is_a_conflict() -> None:
    with pytest.raises(ConfigError, match="batch-size is given twice, as 'batch-size' and 'batch_size'"):
        config_from_mapping({"batch-size": 2, "batch_size": 4})
    with pytest.raises(ConfigError, match="providers is given twice"):
        config_from_mapping({"provider": ["CPUExecutionProvider"], "providers": ["CPUExecutionProvider"]})


def test_the_flag_name_is_accepted_and_an_unknown_key_lists_the_accepted_ones() -> None:
    assert config_from_mapping({"provider": ["CPUExecutionProvider"]}).providers == (
        "CPUExecutionProvider",)
    with pytest.raises(ConfigError, match=r"unknown key 'batchsize' \(accepted: .*batch-size"):
        config_from_mapping({"batchsize": 2})


def test_weight_rounding_names_the_layers_gptq_rounds() -> None:
    auto = config_from_mapping({"weight_rounding": "auto"})
    assert [auto.rounds_with_gptq(op) for op in ("MatMul", "Gemm", "Conv", "ConvTranspose")] == [
        True, True, False, False]
    gptq = config_from_mapping({"weight-rounding": "gptq"})
    assert [gptq.rounds_with_gptq(op) for op in ("MatMul", "Gemm", "Conv")] == [True] * 3
    nearest = config_from_mapping({"weight_rounding": "nearest"})
    assert not any(nearest.rounds_with_gptq(op) for op in ("MatMul", "Gemm", "Conv"))
    with pytest.raises(ConfigError, match="weight-rounding: unknown 'gtpq'; choose one of "
                                          "nearest, gptq, auto"):
        config_from_mapping({"weight_rounding": "gtpq"})
