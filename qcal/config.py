"""The one typed description of a calibration run, from flags and/or a TOML config file.

Every option exists once, as a field of `CalibrationConfig`. The CLI builds it from its flags, the
config file supplies the same keys (flag names, with dashes or underscores), flags win, and an
unknown key is an error naming the key. Validation that needs no model or data happens here, before
anything expensive runs.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qcal.accuracy.gates import Gates
from qcal.accuracy.target import AccuracyTarget
from qcal.graph.placement import PLACEMENTS, SMALL_PRODUCT_MACS
from qcal.graph.weight_only import DEFAULT_BLOCK_SIZE, check_weight_only_options
from qcal.numerics.errors import ConfigError
from qcal.numerics.ranges import HISTOGRAM_METHODS, METHODS, HistogramSettings
from qcal.numerics.smoothing import smoothing_alpha

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_PRESET",
    "METHODS",
    "WEIGHT_ROUNDINGS",
    "CalibrationConfig",
    "TensorOverride",
    "config_from_mapping",
    "load_config_file",
]


# uint8 asymmetric activations with int8 symmetric per-channel weights (PyTorch's x86 default) is
# the layout onnxruntime's CPU kernels are fastest on, and its QDQ mapping is exact.
DEFAULT_PRESET = "pytorch"
# How weight codes are chosen: rounding to nearest, or GPTQ (a second pass over the calibration
# data measures each layer's inputs; see qcal.numerics.gptq), per the layers each choice gives
# to GPTQ. "auto" gives it the MatMul/Gemm layers alone: their Hessian is in_features^2, cheap
# to measure, and GPTQ closes most of a transformer's gap; a Conv's is measured over every
# output position, which on Conv-heavy models costs several times the calibration.
GPTQ_OP_TYPES: Mapping[str, frozenset[str]] = {
    "nearest": frozenset(),
    "gptq": frozenset({"Conv", "MatMul", "Gemm"}),
    "auto": frozenset({"MatMul", "Gemm"}),
}
WEIGHT_ROUNDINGS = tuple(GPTQ_OP_TYPES)
# Presets of accelerators whose toolchains quantize every operator: their users emulate that
# arithmetic, so Q/DQ goes on every node with a rule (placement "all") unless they say otherwise.
ACCELERATOR_PRESETS = frozenset({"horizon", "horizon-rne"})
# The accuracy floor every run checks on held-back data unless --no-fallback: 99 % of decisions
# agree (`qcal.accuracy.decisions`), probabilities' yes decisions keep an F1 of 0.97 (a box F1 of
# about 0.99), other outputs 14 dB SQNR (a cosine of about 0.98). The figures: README, Accuracy.
DEFAULT_FLOOR_AGREEMENT_DROP = 1.0  # percent
DEFAULT_FLOOR_SQNR_DB = 14.0
DEFAULT_FLOOR_YES_F1 = 0.97


@dataclass(frozen=True)
class TensorOverride:
    """Per-tensor settings from the config file's `[tensors."name"]` tables."""

    method: str | None = None
    percentile: float | None = None
    skip: bool = False


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """Everything that decides what a calibration run computes (paths of outputs excluded)."""

    preset: str = DEFAULT_PRESET
    preset_options: Mapping[str, Any] = field(default_factory=dict)
    method: str = "auto"  # mse, but the exact extremes on the output side (numerics.ranges)
    percentile: float = 99.99
    bins: int = 2048
    quantized_bins: int = 128
    per_channel: bool = True
    weight_rounding: str = "nearest"  # "gptq", "auto": codes chosen for the layer's output error
    bias_correction: bool = True  # biases absorb the mean output shift quantization causes
    weight_only: str | None = None  # "int4": MatMul/Gemm weights alone, in blocks along K
    block_size: int = DEFAULT_BLOCK_SIZE
    weight_only_format: str = "matmulnbits"  # or "qdq"
    equalize: bool = False  # depthwise inputs or Conv pairs evened out (qcal._transforms)
    smooth_quant: float | str | None = None  # SmoothQuant's alpha, or "auto" per layer
    data: Path | None = None
    eval_data: Path | None = None
    labels: Path | None = None
    synthetic: int | None = None
    limit: int | None = None
    batch_size: int = 1
    seed: int = 0
    op_types: tuple[str, ...] = ()
    exclude_op_types: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    exclude_tensors: tuple[str, ...] = ()
    tensors: Mapping[str, TensorOverride] = field(default_factory=dict)
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    opset: int = 13
    # Accuracy: default exclusions, sensitivity, automatic fallback and CI gates. Percentages
    # are in percent (0-100), SQNR in dB; None means "not asked for".
    default_exclusions: bool = True
    placement: str | None = None  # None: "all" for accelerator presets, else "auto"
    min_product_macs: int = SMALL_PRODUCT_MACS  # placement auto: smaller MatMul/Gemm stay float
    fallback: bool = True  # check the accuracy floor and keep harmful tensors float below it
    sensitivity: bool = False
    sensitivity_samples: int | None = None  # None: automatic (see pipeline)
    target_sqnr: float | None = None
    max_agreement_drop: float | None = None
    min_coverage: float = 70.0  # the fallback keeps at least 70 % of compute MACs integer
    fail_under_sqnr: float | None = None
    fail_under_agreement: float | None = None
    fail_if_coverage_below: float | None = None
    fail_if_slower: float | None = None  # quantized/float latency ratio at 1 and 2 threads
    allow_slower: bool = False  # else the built-in not-slower gate fails a slower model

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.method not in METHODS:
            raise ConfigError(f"method: unknown {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ConfigError(f"weight-rounding: unknown {self.weight_rounding!r}; choose one of "
                              f"{', '.join(WEIGHT_ROUNDINGS)}")
        check_weight_only_options(self.weight_only, self.block_size, self.weight_only_format)
        if self.smooth_quant is not None:
            object.__setattr__(self, "smooth_quant", smoothing_alpha(self.smooth_quant))
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"percentile: {self.percentile} is not in (0, 100]")
        if self.bins < 8:
            raise ConfigError(f"bins: {self.bins} is too small (at least 8)")
        if not 2 <= self.quantized_bins <= self.bins:
            raise ConfigError(f"quantized-bins: {self.quantized_bins} must be between 2 and "
                              f"bins ({self.bins})")
        if self.batch_size < 1:
            raise ConfigError(f"batch-size: {self.batch_size} must be at least 1")
        for key in ("limit", "synthetic"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key}: {getattr(self, key)} must be at least 1")
        if self.synthetic is not None and self.data is not None:
            raise ConfigError("synthetic: cannot be combined with data (choose one source)")
        if not 13 <= self.opset <= 25:
            raise ConfigError(f"opset: {self.opset} is not between 13 and 25")
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ConfigError(f"placement: unknown {self.placement!r}; choose one of "
                              f"{', '.join(PLACEMENTS)}")
        for key in ("threads", "min_product_macs"):  # threads 0: onnxruntime's default
            if getattr(self, key) < 0:
                raise ConfigError(f"{key.replace('_', '-')}: {getattr(self, key)} must be 0 or more")
        self._check_accuracy_options()
        for name, override in self.tensors.items():
            if override.method is not None and override.method not in METHODS:
                raise ConfigError(
                    f"tensors.{name}.method: unknown {override.method!r}; "
                    f"choose one of {', '.join(METHODS)}"
                )

    def _check_numbers(self) -> None:
        """NaN is no value for any option; an infinite one only where it means "off"."""
        for key in sorted(_FLOAT_KEYS):
            value = getattr(self, key)
            if value is None or math.isfinite(value):
                continue
            if math.isnan(value):
                raise ConfigError(f"{key.replace('_', '-')}: NaN is not a value")
            if (key == "fail_under_sqnr" and value < 0) or (key == "fail_if_slower" and value > 0):
                # -inf SQNR / +inf ratio: nothing fails it, the gate is off
                object.__setattr__(self, key, None)
                continue
            raise ConfigError(f"{key.replace('_', '-')}: {value} is not a finite number")
        if self.seed < 0:
            raise ConfigError(f"seed: {self.seed} must be 0 or more")
        if self.fail_if_slower is not None and self.fail_if_slower <= 0:
            raise ConfigError(f"fail-if-slower: {self.fail_if_slower} is not a positive ratio")

    def _check_accuracy_options(self) -> None:
        if self.sensitivity_samples is not None and self.sensitivity_samples < 1:
            raise ConfigError(f"sensitivity-samples: {self.sensitivity_samples} must be at least 1")
        for key in ("max_agreement_drop", "min_coverage", "fail_under_agreement",
                    "fail_if_coverage_below"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= value <= 100.0:
                raise ConfigError(f"{key.replace('_', '-')}: {value} is not a percentage in [0, 100]")

    @property
    def places_for_speed(self) -> bool:
        """Whether Q/DQ goes only where onnxruntime runs integer kernels (placement "auto"
        without an --op-types list), rather than wherever a rule allows (emulation)."""
        return self.placement_mode == "auto" and not self.op_types

    @property
    def cpu_provider_only(self) -> bool:
        """Whether onnxruntime runs the model with its CPU provider alone: the graph it runs
        (its fusions, what it quantizes itself) is then the one qcal reads back."""
        return tuple(self.providers) == ("CPUExecutionProvider",)

    @property
    def placement_mode(self) -> str:
        """Where Q/DQ goes (`qcal.graph.placement`): as asked, else "all" for presets that
        emulate an accelerator's integer arithmetic end to end, else "auto"."""
        if self.placement is not None:
            return self.placement
        return "all" if self.preset in ACCELERATOR_PRESETS else "auto"

    def accuracy_target(self) -> AccuracyTarget:
        """The fallback's target: the user's, else the default floor."""
        if self.has_fallback_target:
            return AccuracyTarget(
                min_sqnr_db=self.target_sqnr,
                max_agreement_drop=None if self.max_agreement_drop is None
                else self.max_agreement_drop / 100.0,
            )
        return AccuracyTarget(min_sqnr_db=DEFAULT_FLOOR_SQNR_DB,
                              max_agreement_drop=DEFAULT_FLOOR_AGREEMENT_DROP / 100.0,
                              min_yes_f1=DEFAULT_FLOOR_YES_F1, floor_sqnr=True)

    def gates(self) -> Gates:
        """The gates of this run; missing the fallback's target (the floor or the user's) is one."""
        if self.target_sqnr is not None:
            target = ("target-sqnr", self.target_sqnr)
        elif self.max_agreement_drop is not None:
            target = ("max-agreement-drop", self.max_agreement_drop)
        else:
            target = ("accuracy-floor", 0.0)
        return Gates(self.fail_under_sqnr, self.fail_under_agreement, self.fail_if_coverage_below,
                     self.fail_if_slower, target,
                     # weight-only saves memory, placement "all" emulates: not about speed
                     not_slower=(not self.allow_slower and self.fail_if_slower is None
                                 and self.weight_only is None and self.placement_mode != "all"),
                     coverage_floor=(self.min_coverage if self.fallback and self.weight_only is None
                                     else None))

    @property
    def has_fallback_target(self) -> bool:
        """Whether the automatic float fallback runs (a target was set)."""
        return self.target_sqnr is not None or self.max_agreement_drop is not None

    @property
    def checks_accuracy(self) -> bool:
        """Whether the run measures the quantized model on held-back data (floor, target...)."""
        return self.sensitivity or self.has_fallback_target or (
            self.fallback and self.weight_only is None)

    @property
    def uses_histograms(self) -> bool:
        return self.method in HISTOGRAM_METHODS or any(
            o.method in HISTOGRAM_METHODS for o in self.tensors.values()
        )

    def averages_batches(self) -> bool:
        """Whether a moving average observes some tensor: each batch is one of its updates, so
        its result depends on the batching by design."""
        return self.method == "moving-average" or any(
            o.method == "moving-average" for o in self.tensors.values())

    def method_for(self, tensor: str) -> str:
        override = self.tensors.get(tensor)
        return override.method if override and override.method else self.method

    def rounds_with_gptq(self, op_type: str) -> bool:
        """Whether the weights of a layer of `op_type` get GPTQ codes (GPTQ_OP_TYPES)."""
        return op_type in GPTQ_OP_TYPES[self.weight_rounding]

    def histogram_settings(self) -> HistogramSettings:
        return HistogramSettings(self.percentile, self.bins, self.quantized_bins)

    def percentile_for(self, tensor: str) -> float:
        override = self.tensors.get(tensor)
        return override.percentile if override and override.percentile else self.percentile

    def to_json(self) -> dict[str, Any]:
        """The resolved configuration, as recorded in the report (the graph transforms only when
        asked for: a report without them reads as before they existed)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in _WEIGHT_ONLY_KEYS and self.weight_only is None:
                continue  # recorded in weight-only runs alone: other reports stay as they were
            value = getattr(self, f.name)
            if f.name in ("equalize", "smooth_quant") and value == f.default:
                continue
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            elif f.name == "tensors":
                value = {
                    k: {kk: vv for kk, vv in dataclasses.asdict(v).items() if vv not in (None, False)}
                    for k, v in sorted(value.items())
                }
            elif isinstance(value, Mapping):
                value = dict(sorted(value.items()))
            out[f.name] = value
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(CalibrationConfig)}
_PATH_KEYS = {"data", "eval_data", "labels"}
_WEIGHT_ONLY_KEYS = {"weight_only", "block_size", "weight_only_format"}
_LIST_KEYS = {"op_types", "exclude_op_types", "exclude_nodes", "exclude_tensors", "providers"}
_INT_KEYS = {
    "bins", "quantized_bins", "synthetic", "limit", "batch_size", "seed", "threads", "opset",
    "sensitivity_samples", "block_size", "min_product_macs",
}
_FLOAT_KEYS = {
    "percentile", "target_sqnr", "max_agreement_drop", "min_coverage", "fail_under_sqnr",
    "fail_under_agreement", "fail_if_coverage_below", "fail_if_slower",
}
_TYPES: dict[str, type | tuple[type, ...]] = {
    "preset": str,
    "method": str,
    "weight_rounding": str,
    "weight_only": str, "weight_only_format": str,
    "placement": str,
    **{key: (int, float) for key in _FLOAT_KEYS},
    "per_channel": bool,
    "default_exclusions": bool,
    "bias_correction": bool,
    "equalize": bool,
    "smooth_quant": (str, int, float),
    "fallback": bool,
    "allow_slower": bool,
    "sensitivity": bool,
    "preset_options": dict,
    "tensors": dict,
}


# Flags whose long name differs from their key: the config file accepts both spellings.
_FLAG_NAMES = {"provider": "providers"}


def _normalise_key(key: str) -> str:
    return key.replace("-", "_")


def _check_type(key: str, value: Any, where: str) -> Any:
    if key in _LIST_KEYS:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if key in _PATH_KEYS:
        if not isinstance(value, str):
            raise ConfigError(f"{where}{key}: expected a path string, got {value!r}")
        return Path(value)
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}{key}: expected an integer, got {value!r}")
        return value
    expected = _TYPES.get(key)
    if expected is not None and (
        not isinstance(value, expected) or (expected is not bool and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}{key}: expected {_type_name(expected)}, got {value!r}")
    return float(value) if key in _FLOAT_KEYS else value


def _type_name(expected: type | tuple[type, ...]) -> str:
    names = {str: "a string", bool: "true or false", dict: "a table", int: "a number"}
    first = expected[0] if isinstance(expected, tuple) else expected
    return names.get(first, first.__name__)


def _tensor_overrides(raw: Mapping[str, Any], where: str) -> dict[str, TensorOverride]:
    allowed = {f.name for f in dataclasses.fields(TensorOverride)}
    out: dict[str, TensorOverride] = {}
    for tensor, table in raw.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}tensors.{tensor}: expected a table, got {table!r}")
        values = {_normalise_key(k): v for k, v in table.items()}
        if unknown := sorted(set(values) - allowed):
            raise ConfigError(
                f"{where}tensors.{tensor}: unknown key {unknown[0]!r} "
                f"(allowed: {', '.join(sorted(allowed))})"
            )
        _check_override_types(values, f"{where}tensors.{tensor}.")
        out[tensor] = TensorOverride(**values)
    return out


def _check_override_types(values: Mapping[str, Any], where: str) -> None:
    """Per-tensor values have the types (and percentile the range) of the global keys."""
    if "method" in values and not isinstance(values["method"], str):
        raise ConfigError(f"{where}method: expected a string, got {values['method']!r}")
    if "skip" in values and not isinstance(values["skip"], bool):
        raise ConfigError(f"{where}skip: expected true or false, got {values['skip']!r}")
    if values.get("skip") and (ranged := sorted({"method", "percentile"} & set(values))):
        raise ConfigError(f"{where}skip = true keeps it float: {ranged[0]} cannot apply")
    if "percentile" in values:
        value = values["percentile"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}percentile: expected a number, got {value!r}")
        if not 0.0 < value <= 100.0:
            raise ConfigError(f"{where}percentile: {value} is not in (0, 100]")


def config_from_mapping(
    values: Mapping[str, Any], *, base: CalibrationConfig | None = None, where: str = ""
) -> CalibrationConfig:
    """Build a config from `values` (flag-named keys) on top of `base`; unknown keys are errors."""
    changes: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in values.items():
        key = _normalise_key(raw_key)
        key = _FLAG_NAMES.get(key, key)
        if key not in _FIELDS:
            accepted = ", ".join(sorted(k.replace("_", "-") for k in _FIELDS))
            raise ConfigError(f"{where}unknown key {raw_key!r} (accepted: {accepted})")
        if key in spelled:
            raise ConfigError(f"{where}{key.replace('_', '-')} is given twice, as "
                              f"{spelled[key]!r} and {raw_key!r}")
        spelled[key] = raw_key
        value = _check_type(key, value, where)
        if key == "tensors":
            value = _tensor_overrides(value, where)
        changes[key] = value
    try:
        return dataclasses.replace(base or CalibrationConfig(), **changes)
    except TypeError as err:  # pragma: no cover - keys are checked above
        raise ConfigError(f"{where}{err}") from None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into a flag-named mapping; relative paths resolve against its folder."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config file ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML ({err})") from None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        norm = _normalise_key(key)
        if norm in _PATH_KEYS and isinstance(value, str):
            value = str(path.parent / value) if not Path(value).is_absolute() else value
        out[key] = value
    return out
