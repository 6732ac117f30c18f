"""Turning typed flags and a config file into a CalibrationConfig (flags win)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from qcal.config import CalibrationConfig, config_from_mapping, load_config_file
from qcal.numerics.errors import ConfigError

# Flags that shape the run but are not part of CalibrationConfig; the config file may set them too.
_OUTPUT_KEYS = ("output", "report", "force")

F = TypeVar("F", bound=Callable[..., Any])


def _parse_option_value(text: str) -> Any:
    """A TOML value (true, 3, 0.5, "x", [1, 2]); anything else is taken as a bare string."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _key_values(values: tuple[str, ...], option: str, form: str = "KEY=VALUE") -> dict[str, Any]:
    """`option`'s KEY=VALUE items, each value read by `_parse_option_value`."""
    options: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option}: expected {form}, got {item!r}")
        options[key.strip()] = _parse_option_value(value.strip())
    return options


def _preset_options(values: tuple[str, ...]) -> dict[str, Any]:
    return _key_values(values, "--preset-option")


def _list_option(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _explicit(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _build_config(ctx: click.Context, params: Mapping[str, Any]) -> tuple[CalibrationConfig, dict[str, Any]]:
    """File values first, then every flag the user typed; returns the config and output options."""
    file_values: dict[str, Any] = {}
    if params.get("config") is not None:
        file_values = load_config_file(params["config"])
    outputs = _file_outputs(params.get("config"), file_values)
    config = config_from_mapping(file_values, where=f"{params['config']}: ") if file_values else CalibrationConfig()
    flags: dict[str, Any] = {}
    for name, value in params.items():
        if name in {"model", "config", "quiet", "debug", *_OUTPUT_KEYS} or not _explicit(ctx, name):
            continue
        if name == "preset_option":
            flags["preset_options"] = {**config.preset_options, **_preset_options(value)}
        elif name == "provider":
            flags["providers"] = list(value)
        elif name in {"op_types", "exclude_op_types", "exclude_nodes", "exclude_tensors"}:
            flags[name] = _list_option(value)
        elif isinstance(value, Path):
            flags[name] = str(value)
        else:
            flags[name] = value
    for key in _OUTPUT_KEYS:
        if _explicit(ctx, key) or key not in outputs:
            outputs[key] = params[key]
    return config_from_mapping(flags, base=config, where="--"), outputs


def _file_outputs(config_path: Path | None, file_values: dict[str, Any]) -> dict[str, Any]:
    """Take output, report and force out of the config file's values, checked like the rest."""
    outputs: dict[str, Any] = {}
    for key in _OUTPUT_KEYS:
        if key not in file_values:
            continue
        value = file_values.pop(key)
        if key == "force":
            if not isinstance(value, bool):
                raise ConfigError(f"{config_path}: force: expected true or false, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ConfigError(f"{config_path}: {key}: expected a path string, got {value!r}")
        elif config_path is not None:
            value = str(config_path.parent / value)  # relative to the file, as the README says
        outputs[key] = value
    return outputs


def ray_options(command: F) -> F:
    """--ray [ADDRESS] and --workers, for the commands that collect statistics."""
    command = click.option(
        "--workers", type=int, metavar="N",
        help="Ray workers [default: the CPUs of the local Ray or the cluster].")(command)
    return click.option(
        "--ray", "ray_address", is_flag=False, flag_value="local", default=None,
        metavar="[ADDRESS]",
        help="Collect the statistics on Ray workers, the data in shards, and merge them (no "
             "address: a local Ray for this run; needs qcal[ray]). Put it after MODEL.")(command)
