"""The fallback's search over prefixes of its ranking (`qcal.accuracy.fallback`): the largest
prefix the coverage floor allows, the smallest that meets the target, the candidates a prefix
holds that the target does not need, and the smallest past it that also passes a second
check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from qcal.accuracy.coverage import CoverageMeter
from qcal.graph.model import QuantPlan

__all__ = ["CONFIRMATIONS", "confirmed_beyond", "largest_above_floor", "prune", "smallest_passing"]

# Confirmations the search runs past a first set that missed its own (each a quantized run
# over the calibration samples; a run where none passes exits as it did without them).
CONFIRMATIONS = 4


class Checked(Protocol):
    """A checked set of candidates: whether its model meets the target."""

    @property
    def met(self) -> bool: ...


def prune(kept: tuple[int, ...], check_set: Callable[[tuple[int, ...]], Checked],
           budget: int) -> tuple[int, ...]:
    """`kept` less the candidates the target holds without, tried last-ranked first, within
    `budget` more checks. The ranking measures each tensor's error where it is made, not what
    it does to the outputs: a prefix that meets the target may hold candidates that did not
    matter (silero-vad: four encoder layers ranked between its audio input and the spectrum
    magnitude that had to stay float)."""
    for index in reversed(kept):
        if budget <= 0:
            break
        trial = tuple(i for i in kept if i != index)
        budget -= 1
        if check_set(trial).met:
            kept = trial
    return kept


def largest_above_floor(
    meter: CoverageMeter, plan_for: Callable[[int], QuantPlan], count: int, floor: float,
) -> int:
    """Largest k whose plan keeps coverage >= floor (coverage only falls as k grows)."""
    low, high = 0, count
    while low < high:
        mid = (low + high + 1) // 2
        if meter.measure(plan_for(mid)).fraction >= floor - 1e-12:
            low = mid
        else:
            high = mid - 1
    return low


def smallest_passing(check: Callable[[int], Checked], limit: int) -> int | None:
    """Exponential then binary search for the smallest k <= limit that meets the target, after
    one check of `limit` itself: when the most float the coverage floor allows does not meet
    the target, no smaller k does, and the search would only spend checks to say so."""
    if check(0).met:
        return 0
    if limit == 0 or not check(limit).met:
        return None
    failing, k = 0, 1
    while k < limit and not check(k).met:
        failing, k = k, 2 * k
    k = min(k, limit)
    if k == 0 or not check(k).met:
        return None
    passing = k
    while passing - failing > 1:
        mid = (failing + passing) // 2
        if check(mid).met:
            passing = mid
        else:
            failing = mid
    return passing


def confirmed_beyond(
    check: Callable[[int], Checked],
    confirmed: Callable[[tuple[int, ...]], object | None],
    kept: tuple[int, ...], start: int, limit: int,
) -> tuple[int, ...] | None:
    """The smallest prefix of the ranking from `start` (the prefix `kept` was pruned from) that
    meets the target and passes the confirmation, within CONFIRMATIONS confirmations: the
    prefix `start` itself when pruning took candidates from it, then `start` + 1, 2, 4, ... and
    `limit`, halving back towards the last that missed once one passes. None: none found."""
    budget = CONFIRMATIONS

    def passes(k: int) -> bool:
        nonlocal budget
        if not check(k).met:
            return False
        budget -= 1
        return confirmed(tuple(range(k))) is None

    tries = [start] if kept != tuple(range(start)) else []
    step = 1
    while start + step < limit:
        tries.append(start + step)
        step *= 2
    if limit > start:
        tries.append(limit)
    missed = start
    for k in tries:
        if budget <= 0:
            return None
        if passes(k):
            while k - missed > 1 and budget > 0:
                mid = (missed + k) // 2
                if passes(mid):
                    k = mid
                else:
                    missed = mid
            return tuple(range(k))
        missed = k
    return None
