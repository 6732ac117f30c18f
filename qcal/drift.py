"""Two reports of the same model compared: what moved between an old run and a new one (scales
and zero points per tensor, the tensors quantized, coverage, per output quality), and whether
anything moved more than its threshold allows (`qcal diff`, `qcal calibrate --baseline`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qcal.numerics.errors import ConfigError

__all__ = ["THRESHOLDS", "UNITS", "Drift", "Move", "compare_reports", "drift_thresholds"]

# name -> (default, what it bounds); a move is over its threshold when its change is larger.
THRESHOLDS: dict[str, tuple[float, str]] = {
    "scale": (1.0, "relative change of a tensor's scale (largest over its channels), %"),
    "zero-point": (1.0, "change of a tensor's zero point (largest over its channels), steps"),
    "tensors": (0.0, "tensors quantized in one report only, or with another type"),
    "coverage": (1.0, "drop of the quantized share of Conv/MatMul/Gemm compute, points of %"),
    "sqnr": (1.0, "drop of an output's SQNR, dB"),
    "agreement": (0.5, "drop of an output's top-1 agreement, points of %"),
    "f1": (1.0, "drop of an output's F1 of yes decisions (a map's, detections'), points of %"),
}


def drift_thresholds(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The defaults, with `overrides` (option values by name) checked and applied."""
    thresholds = {name: default for name, (default, _) in THRESHOLDS.items()}
    for name, value in (overrides or {}).items():
        if name not in THRESHOLDS:
            raise ConfigError(f"--drift-threshold: unknown measure {name!r}; choose one of "
                              f"{', '.join(THRESHOLDS)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not value >= 0 or math.isnan(value):
            raise ConfigError(f"--drift-threshold: {name}={value!r} must be a number >= 0")
        thresholds[name] = float(value)
    return thresholds


@dataclass(frozen=True)
class Move:
    """One figure that differs. `change` is in the threshold's unit; positive is worse for the
    quality measures (a drop), any direction for scales and zero points; inf when a figure
    appears or disappears (an exact output becoming inexact)."""

    name: str       # tensor or output name; "(model)" for the model-wide measures
    measure: str    # a THRESHOLDS key
    old: str
    new: str
    change: float
    threshold: float

    @property
    def over(self) -> bool:
        return self.change > self.threshold

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "measure": self.measure, "old": self.old, "new": self.new,
                "change": None if math.isinf(self.change) else self.change,
                "threshold": self.threshold, "over": self.over}


@dataclass(frozen=True)
class Drift:
    moves: tuple[Move, ...]                       # over their threshold first, largest first
    notes: tuple[str, ...] = ()                   # settings and inputs that differ
    thresholds: Mapping[str, float] = field(default_factory=dict)

    @property
    def over(self) -> list[Move]:
        return [m for m in self.moves if m.over]

    def describe(self) -> str:
        """One line: what is over its threshold."""
        over = self.over
        if not over:
            return f"no drift over the thresholds ({len(self.moves)} figure(s) moved within them)"
        said = "; ".join(f"{m.measure} of {m.name} {_change_text(m)} (threshold "
                         f"{m.threshold:g})" for m in over[:3])
        more = f"; and {len(over) - 3} more" if len(over) > 3 else ""
        return f"{len(over)} figure(s) moved over the drift thresholds: {said}{more}"

    def to_json(self) -> dict[str, Any]:
        return {"over": len(self.over), "moved": len(self.moves), "notes": list(self.notes),
                "thresholds": dict(self.thresholds), "moves": [m.to_json() for m in self.moves]}


UNITS = {"scale": " %", "zero-point": " steps", "tensors": "", "coverage": " points",
         "sqnr": " dB", "agreement": " points", "f1": " points"}


def _change_text(move: Move) -> str:
    unit = UNITS[move.measure]
    return "changed" if math.isinf(move.change) else f"moved {move.change:.4g}{unit}"


def compare_reports(old: Mapping[str, Any], new: Mapping[str, Any],
                    thresholds: Mapping[str, float] | None = None) -> Drift:
    limits = drift_thresholds(thresholds)
    moves = _tensor_moves(old, new, limits) + _coverage_moves(old, new, limits)
    moves += _output_moves(old, new, limits)
    moves.sort(key=lambda m: (not m.over, -m.change, m.measure, m.name))
    return Drift(tuple(moves), tuple(_notes(old, new)), limits)


def _tensor_moves(old: Mapping[str, Any], new: Mapping[str, Any],
                  limits: Mapping[str, float]) -> list[Move]:
    before = {t["name"]: t["onnx"] for t in old["tensors"]}
    after = {t["name"]: t["onnx"] for t in new["tensors"]}
    # a bias's scale is its input's times its weight's: those are compared, not it
    derived = {t["name"] for t in (*old["tensors"], *new["tensors"]) if t["role"] == "bias"}
    moves = []
    changed_set = []
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a is None or b is None or a["type"] != b["type"]:
            changed_set.append((name, "float" if a is None else a["type"],
                                "float" if b is None else b["type"]))
            continue
        if name in derived:
            continue
        scale = _largest_relative(a["scale"], b["scale"])
        if scale:
            moves.append(Move(name, "scale", _values(a["scale"]), _values(b["scale"]), scale,
                              limits["scale"]))
        zero = _largest_absolute(a["zero_point"], b["zero_point"])
        if zero:
            moves.append(Move(name, "zero-point", _values(a["zero_point"]),
                              _values(b["zero_point"]), zero, limits["zero-point"]))
    if changed_set:
        over = len(changed_set) > limits["tensors"]
        # one line per tensor, each carrying the count the threshold bounds
        for name, was, now in changed_set:
            moves.append(Move(name, "tensors", was, now,
                              float(len(changed_set)) if over else 0.0, limits["tensors"]))
    return moves


def _largest_relative(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        if x != y:
            worst = max(worst, math.inf if x == 0 else 100.0 * abs(y - x) / abs(x))
    return worst


def _largest_absolute(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((abs(float(y) - float(x)) for x, y in zip(a, b)), default=0.0)


def _values(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return f"{min(values):.3g} to {max(values):.3g} ({len(values)} channels)"


def _coverage_moves(old: Mapping[str, Any], new: Mapping[str, Any],
                    limits: Mapping[str, float]) -> list[Move]:
    a, b = _coverage(old), _coverage(new)
    if a == b:
        return []
    return [Move("(model)", "coverage", f"{a:.2f} %", f"{b:.2f} %", round(a - b, 6),
                 limits["coverage"])]


def _coverage(report: Mapping[str, Any]) -> float:
    cov = report["coverage"]
    if "macs_quantized_fraction" in cov:
        return 100.0 * float(cov["macs_quantized_fraction"])
    return 100.0 * cov["quantized"] / cov["nodes"] if cov["nodes"] else 0.0


def _output_moves(old: Mapping[str, Any], new: Mapping[str, Any],
                  limits: Mapping[str, float]) -> list[Move]:
    before = {o["name"]: o for o in (old["evaluation"] or {}).get("outputs", [])}
    after = {o["name"]: o for o in (new["evaluation"] or {}).get("outputs", [])}
    moves = []
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        sqnr_a = math.inf if a["sqnr_db"] is None else float(a["sqnr_db"])
        sqnr_b = math.inf if b["sqnr_db"] is None else float(b["sqnr_db"])
        if sqnr_a != sqnr_b:
            drop = math.inf if math.isinf(sqnr_a) else (
                -math.inf if math.isinf(sqnr_b) else round(sqnr_a - sqnr_b, 6))
            moves.append(Move(name, "sqnr", _db(a["sqnr_db"]), _db(b["sqnr_db"]), drop,
                              limits["sqnr"]))
        for measure, key in (("agreement", "top1_agreement"), ("f1", "yes_f1")):
            share_a, share_b = a.get(key), b.get(key)
            if share_a is not None and share_b is not None and share_a != share_b:
                moves.append(Move(name, measure, f"{share_a:.2%}", f"{share_b:.2%}",
                                  round(100.0 * (share_a - share_b), 6), limits[measure]))
    return moves


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.2f} dB"


def _notes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    notes = []
    if old["input_model"]["sha256"] != new["input_model"]["sha256"]:
        notes.append("the input models differ (sha256)")
    if old["preset"]["name"] != new["preset"]["name"]:
        notes.append(f"preset {old['preset']['name']} -> {new['preset']['name']}")
    for key in sorted(old["config"].keys() | new["config"].keys()):
        a, b = old["config"].get(key), new["config"].get(key)
        if a != b and key not in ("preset",):
            notes.append(f"{key}: {a!r} -> {b!r}")
    a_data, b_data = old["data"], new["data"]
    if (a_data["path"], a_data["samples"]) != (b_data["path"], b_data["samples"]):
        notes.append(f"calibration data {a_data['path']} ({a_data['samples']} samples) -> "
                     f"{b_data['path']} ({b_data['samples']} samples)")
    if old["versions"] != new["versions"]:
        changed = [f"{k} {old['versions'].get(k)} -> {v}" for k, v in new["versions"].items()
                   if old["versions"].get(k) != v]
        notes.append("versions: " + ", ".join(changed))
    missing = sorted({o["name"] for o in (old["evaluation"] or {}).get("outputs", [])}
                     ^ {o["name"] for o in (new["evaluation"] or {}).get("outputs", [])})
    if missing:
        notes.append(f"outputs evaluated in one report only: {', '.join(missing)}")
    return notes
