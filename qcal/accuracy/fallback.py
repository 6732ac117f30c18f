"""Automatic float fallback: keep the most harmful tensors in float until an accuracy target holds.

Candidates are the planned tensors whose quantization alone changes the outputs (from
`qcal.accuracy.sensitivity`). Each gets a harm, its output noise ratio alone (over the logits, for
softmax outputs), and a cost, the share of compute that would stop running as integer kernels
if it were kept float (from `qcal.accuracy.coverage`). They are ranked by ``harm / (cost + 1 %)``: a tensor that costs no compute
(the input of an elementwise op, a statistic) goes first unless a matmul's harm is much larger,
so that cheap elementwise tensors are given up before expensive convolutions and matmuls.

The search keeps the first k ranked tensors in float and checks the real QDQ model (written by
InsertQDQ, run by onnxruntime on the evaluation data): k = 0, then 1, 2, 4, ... until the target
holds, then bisection between the last failing and the first passing k. Coverage never goes below
the floor: when the target does not hold at the largest k above it, the search says so and keeps
the best model it checked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx

from qcal.accuracy._prefix_search import (
    CONFIRMATIONS,
    confirmed_beyond,
    largest_above_floor,
    prune,
    smallest_passing,
)
from qcal.accuracy.coverage import Coverage, CoverageMeter
from qcal.accuracy.evaluate import Comparison
from qcal.accuracy.restrict import restrict_plan
from qcal.accuracy.sensitivity import (
    BlockHarm,
    SensitivityResult,
    TensorSensitivity,
    noise_ratio_db,
)
from qcal.accuracy.target import AccuracyTarget, worst_agreement, worst_yes_f1
from qcal.graph.integer_kernels import integer_output_writers
from qcal.graph.model import QuantPlan

__all__ = [
    "CONFIRMATIONS",
    "Candidate",
    "Confirmation",
    "FallbackResult",
    "FallbackStep",
    "Missed",
    "rank_blocks",
    "rank_candidates",
    "same_error_groups",
    "search_fallback",
]

logger = logging.getLogger(__name__)

# A tensor that costs no compute is charged as if it cost 1 % of it: harm per cost stays finite
# and a tiny harm never outranks a large one just because it is free.
_FREE_COST = 0.01


@dataclass(frozen=True)
class Missed:
    """What a model's second check (`search_fallback`'s `confirm`, on the calibration samples)
    showed it missed: the samples it ran on, the words, and whether the check can tell a model
    below the target from one at it (`AccuracyTarget.tells_apart`): only then does the search
    go on past such a model, as a check that cannot tell passes a model below it by luck when
    tried on several (a classifier's 48 calibration samples all agree one time in three at
    98 %, and four more sets tried let models of 97.6-98.9 % through where the plain model
    missed)."""

    samples: int
    words: str
    conclusive: bool = True


# A model's second check: what it missed, or None.
Confirmation = Callable[[onnx.ModelProto, Comparison], "Missed | None"]


@dataclass(frozen=True)
class Candidate:
    """A tensor the search may keep in float: its harm alone and what keeping it float costs."""

    sensitivity: TensorSensitivity
    compute_lost: float  # share of compute (0..1) that stops being integer without it
    together: tuple[str, ...] = ()  # tensors carrying the same error, kept float with it
    block: bool = False  # `together` is the rest of a block measured as one (`rank_blocks`)

    @property
    def score(self) -> float:
        return self.sensitivity.harm / (self.compute_lost + _FREE_COST)

    @property
    def tensors(self) -> tuple[str, ...]:
        return (self.sensitivity.tensor, *self.together)

    def reason(self, tensor: str | None = None) -> str:
        """Why the candidate is kept float, said of `tensor` (one of its tensors)."""
        s = self.sensitivity
        if self.block:
            where = "output" if s.logit_noise_ratio is None else "softmax outputs' logits"
            sqnr = f"{where} SQNR {noise_ratio_db(s.harm):.1f} dB"  # blocks of no harm are none
            why = (f"quantized alone with the {len(self.tensors) - 1} other tensor(s) of its "
                   f"block, {sqnr}" if self.together else f"quantized alone, {sqnr}")
            return (f"kept float by the accuracy fallback: {why}; "
                    f"costs {100 * self.compute_lost:.2f} % of quantized compute")
        if s.output_sqnr_db is None and s.local_sqnr_db is None and s.harm > 0:
            why = f"the error jumps by {s.harm:.3g} (noise/signal) where it is read"
        else:
            sqnr = "unchanged" if s.output_sqnr_db is None else f"{s.output_sqnr_db:.1f} dB"
            why = f"quantized alone, output SQNR {sqnr}"
        others = [t for t in self.tensors if t != (tensor or s.tensor)]
        with_ = (f"; with {', '.join(repr(t) for t in others)} (the same error)"
                 if others else "")
        return (
            f"kept float by the accuracy fallback: {why}; "
            f"costs {100 * self.compute_lost:.2f} % of quantized compute{with_}"
        )


@dataclass(frozen=True)
class FallbackStep:
    """One checked model: the first `kept` candidates in float."""

    kept: int
    comparison: Comparison
    coverage: Coverage
    met: bool

    def to_json(self) -> dict[str, object]:
        return {
            "kept_float": self.kept,
            # over the elements both models computed finite: JSON holds no -inf, and the
            # outputs the step broke are named instead
            "worst_sqnr_db": _round(self.comparison.worst_finite_sqnr_db()),
            "worst_top1_agreement": _round(worst_agreement(self.comparison)),
            "worst_yes_f1": _round(worst_yes_f1(self.comparison)),
            "macs_quantized_fraction": _round(self.coverage.fraction),
            "target_met": self.met,
            **({"broken_outputs": list(self.comparison.broken_outputs)}
               if self.comparison.broken_outputs else {}),
        }


@dataclass(frozen=True)
class FallbackResult:
    """What the search chose.

    Attributes:
        plan: the plan with the chosen tensors kept float.
        model: the QDQ model written from it.
        comparison: that model against the float model on the evaluation data.
        coverage: its quantized share of compute.
        reached: whether the target holds.
        kept: the candidates kept float, in rank order.
        steps: every model checked, in order.
        message: one sentence saying what happened.
        missed: what the confirmation (`search_fallback`'s `confirm`) showed the model handed
            over missed, if it did.
    """

    plan: QuantPlan
    model: onnx.ModelProto
    comparison: Comparison
    coverage: Coverage
    reached: bool
    kept: tuple[Candidate, ...]
    steps: tuple[FallbackStep, ...]
    message: str
    missed: Missed | None = None

    @property
    def confirmed(self) -> bool:
        """Whether no confirmation missed the model handed over (none ran, or it passed)."""
        return self.missed is None


def rank_candidates(
    model: onnx.ModelProto,
    plan: QuantPlan,
    sensitivity: SensitivityResult,
    macs: Mapping[str, int | None],
) -> list[Candidate]:
    """Tensors whose quantization alone changes the outputs, best to keep float first.

    Tensors that carry one quantization error are one candidate (`same_error_groups`), named by
    its most harmful member.
    """
    harmful = [s for s in sensitivity.tensors if s.harm > 0.0]
    groups = same_error_groups(model, harmful)
    members = {s.tensor: groups.get(s.tensor, [s.tensor]) for s in harmful}
    # a group is listed once, under its first (most harmful) member
    return _priced(model, plan, macs, ((s, members[s.tensor], False) for s in harmful
                                       if members[s.tensor][0] == s.tensor))


def rank_blocks(
    model: onnx.ModelProto,
    plan: QuantPlan,
    blocks: Sequence[BlockHarm],
    macs: Mapping[str, int | None],
    samples: int,
) -> list[Candidate]:
    """Blocks of tensors measured by `measure_blocks` as candidates (each block kept float as
    one), ranked as `rank_candidates` ranks tensors."""

    def harm(block: BlockHarm) -> TensorSensitivity:
        sqnr = None if math.isinf(block.harm) else noise_ratio_db(block.harm)
        return TensorSensitivity(
            tensor=block.tensors[0], role=block.roles[0],
            output_sqnr_db=None if block.on_logits else sqnr, noise_ratio=block.harm,
            top1_agreement=None, local_sqnr_db=None, samples=samples,
            logit_noise_ratio=block.harm if block.on_logits else None)

    return _priced(model, plan, macs,
                   ((harm(b), b.tensors, True) for b in blocks if b.harm > 0.0))


def _priced(
    model: onnx.ModelProto, plan: QuantPlan, macs: Mapping[str, int | None],
    entries: Iterable[tuple[TensorSensitivity, Sequence[str], bool]],
) -> list[Candidate]:
    """Candidates (harm, the tensors kept float together, the first the one the harm names;
    whether they are a measured block), each priced by the share of compute keeping its tensors
    float costs, best to keep float first."""
    meter = CoverageMeter(model, macs)
    full, writers = meter.measure(plan).fraction, integer_output_writers(model.graph)
    found = []
    for harm, tensors, block in entries:
        keep = dict.fromkeys(tensors, "-")
        without = meter.measure(restrict_plan(plan, keep, writers)).fraction
        found.append(Candidate(harm, max(0.0, full - without), tuple(tensors[1:]), block=block))
    found.sort(key=lambda c: (-c.score, c.sensitivity.tensor))
    return found


# Harms this close count as one error (they agree to 5 or more digits when they are one).
_SAME_ERROR_TOLERANCE = 1e-3


def same_error_groups(
    model: onnx.ModelProto, sensitivities: Sequence[TensorSensitivity]
) -> dict[str, list[str]]:
    """Activations that carry one quantization error: tensor -> its group, most harmful first.

    A tensor computed from another by one node with no other variable input (a scale or shift
    by a constant, a reshape, a transpose) and quantized on the matching grid re-quantizes
    values that are already on it: quantizing either alone has the same effect on the outputs,
    and keeping either float alone changes nothing while the other is quantized. Such pairs
    (linked by one node, harms equal to `_SAME_ERROR_TOLERANCE`) are joined, transitively.
    Only tensors in groups of two or more appear.
    """
    harm = {s.tensor: s.harm for s in sensitivities if s.role == "activation"}
    order = {s.tensor: i for i, s in enumerate(sensitivities)}
    constants = {t.name for t in model.graph.initializer}
    parent = {t: t for t in harm}

    def root(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for node in model.graph.node:
        variable = [t for t in node.input if t and t not in constants]
        if len(variable) != 1 or variable[0] not in harm:
            continue
        source = variable[0]
        for out in node.output:
            if out in harm and math.isclose(harm[out], harm[source],
                                            rel_tol=_SAME_ERROR_TOLERANCE):
                parent[root(out)] = root(source)
    members: dict[str, list[str]] = {}
    for t in harm:
        members.setdefault(root(t), []).append(t)
    groups: dict[str, list[str]] = {}
    for group in members.values():
        if len(group) > 1:
            group.sort(key=lambda t: (-harm[t], order[t]))
            for t in group:
                groups[t] = group
    return groups


def search_fallback(
    *,
    model: onnx.ModelProto,
    plan: QuantPlan,
    candidates: Sequence[Candidate],
    macs: Mapping[str, int | None],
    target: AccuracyTarget,
    floor: float,
    write: Callable[[QuantPlan], onnx.ModelProto],
    evaluate: Callable[[onnx.ModelProto], Comparison],
    planned: tuple[onnx.ModelProto, Comparison] | None = None,
    confirm: Confirmation | None = None,
) -> FallbackResult:
    """The fewest ranked candidates to keep float for `target`, never below `floor` coverage.

    Args:
        model: the prepared float model.
        plan: the full plan.
        candidates: ranked by `rank_candidates`.
        macs: MACs per compute node (`qcal.accuracy.macs.compute_macs`).
        target: what the QDQ model must reach.
        floor: lowest acceptable quantized share of compute (0..1).
        write: writes the QDQ model of a plan (InsertQDQ with the run's parameters).
        evaluate: compares a QDQ model with the float model on the evaluation data.
        planned: the model as planned and its comparison with the float model, when the
            caller already wrote and evaluated it (neither is done again).
        confirm: a second check of a model that met the target (on the calibration samples):
            what it missed, or None. When the set found misses it, more candidates are kept
            float, up to the coverage floor and CONFIRMATIONS more checks, until one passes
            both (where the check is conclusive: `Missed`); none passing, the set found is
            handed over, with what it missed.
    """
    # Every checked set's figures; the model only of those that may be handed over (the model
    # as planned, or one that meets the target): a large model is not held a dozen times.
    models: dict[tuple[int, ...], tuple[QuantPlan, onnx.ModelProto | None, FallbackStep]] = {}

    writers, meter = integer_output_writers(model.graph), CoverageMeter(model, macs)

    def plan_without(kept: Iterable[int]) -> QuantPlan:
        return restrict_plan(plan, _keep(candidates[i] for i in kept), writers)

    def check_set(kept: tuple[int, ...]) -> FallbackStep:
        if kept not in models:
            restricted = plan_without(kept)
            if planned is not None and not kept:
                quantized, comparison = planned
            else:
                quantized = write(restricted)
                comparison = evaluate(quantized)
            coverage = meter.measure(restricted)
            step = FallbackStep(len(kept), comparison, coverage, target.is_met(comparison))
            models[kept] = (restricted, quantized if step.met or not kept else None, step)
            logger.info("fallback: %d kept float, coverage %.3f, met %s", len(kept),
                        coverage.fraction, step.met)
        return models[kept][2]

    def check(k: int) -> FallbackStep:
        return check_set(tuple(range(k)))

    limit = largest_above_floor(meter, lambda k: plan_without(range(k)), len(candidates),
                                 floor)
    chosen = smallest_passing(check, limit)
    # the prefixes the search checked (before any is pruned)
    checked = {len(kept): step for kept, (_, _, step) in models.items()}
    reached = chosen is not None
    # Short of the target whatever was kept float, the model goes out as planned: a verdict
    # fails either way, and islands of float compute between integer ones would only make it
    # slower (a MobileNetV3 kept 30 % float ran 2.8x its float model, for 2 % more agreement).
    closest = min(checked, key=lambda k: (target.shortfall(checked[k].comparison), k))
    kept = tuple(range(chosen or 0))
    if chosen is not None and chosen > 1:
        kept = prune(kept, check_set, budget=len(models))
    missed, first = None, len(kept)
    if reached and confirm is not None:
        def confirmed_set(candidate: tuple[int, ...]) -> Missed | None:
            _, model_k, step_k = models[candidate]
            assert model_k is not None  # kept for every set that met the target
            return confirm(model_k, step_k.comparison)

        missed = confirmed_set(kept)
        if missed is not None and missed.conclusive:
            further = confirmed_beyond(check, confirmed_set, kept, chosen or 0, limit)
            if further is not None:
                kept, missed = further, None
    restricted, written, step = models[kept]
    assert written is not None  # the model as planned, or one that met the target
    chosen = len(kept)
    as_planned = (f"the model is handed over as planned (the closest checked kept {closest} "
                  "tensor(s) float, short too)" if closest else
                  "the model is handed over as planned (the closest of those checked)")
    wanted = target.describe(step.comparison)
    if reached:
        share = (f"; {100 * step.coverage.fraction:.1f} % of compute quantized"
                 if step.coverage.compute_nodes else "")
        message = f"{wanted} reached with {chosen} tensor(s) kept float{share}"
        if missed is None and chosen != first:
            message += (f", and on the calibration samples too, which the first set the "
                        f"held-out samples accepted ({first} float) missed")
        elif missed is not None:
            why = ("as did the sets with more float it checked" if missed.conclusive else
                   "too few decisions there to tell the sets with more float apart")
            message = (f"{wanted} reached on the held-out samples with {chosen} tensor(s) kept "
                       f"float{share}, but missed on the calibration samples ({why})")
    elif limit < len(candidates):
        message = (f"{wanted} NOT reached: it would need more than "
                   f"{100 * (1 - floor):.0f} % of compute in float (coverage floor "
                   f"{100 * floor:.0f} %); {as_planned}")
    else:
        message = (f"{wanted} NOT reached even with all {len(candidates)} "
                   f"sensitive tensor(s) in float; {as_planned}")
    return FallbackResult(
        plan=restricted, model=written, comparison=step.comparison, coverage=step.coverage,
        reached=reached, kept=tuple(candidates[i] for i in kept),
        steps=tuple(entry[2] for entry in models.values()), message=message, missed=missed,
    )


def _keep(candidates: Iterable[Candidate]) -> dict[str, str]:
    return {t: c.reason(t) for c in candidates for t in c.tensors}


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")
