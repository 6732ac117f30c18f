"""Each sample's quantization error met with every other sample's float scores: the share of a
classifier's decisions it would change, counted against a brute-force loop over the pairs, and
the calibration-samples gate it fails where every sample agrees but its errors are large."""

from __future__ import annotations

import numpy as np

from qcal.accuracy.crossed import DecisionRows, crossed_agreement
from qcal.accuracy.decision_counts import DecisionRule
from qcal.accuracy.evaluate import Comparison
from qcal.accuracy.output_sums import OutputAccumulator
from qcal.config import CalibrationConfig


def _brute_force(scores: np.ndarray, errors: np.ndarray) -> float:
    """The share of pairs i != j whose decision argmax(s_i + e_j) stays argmax(s_i)."""
    n = scores.shape[0]
    alike = sum(int(np.argmax(scores[i] + errors[j]) == np.argmax(scores[i]))
                for i in range(n) for j in range(n) if i != j)
    return alike / (n * (n - 1))


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_the_share_is_the_pairs_counted_one_by_one() -> None:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((40, 7)) * 3
    errors = rng.standard_normal((40, 7)) * rng.exponential(0.5, (40, 1))  # a heavy tail
    rows = DecisionRows()
    for start in range(0, 40, 16):  # batches of any size
        rows.add(scores[start:start + 16], scores[start:start + 16] + errors[start:start + 16],
                 probabilities=False)
    crossed = crossed_agreement([rows])
    assert crossed is not None
    expected = _brute_force(scores, errors)
    assert 0.5 < expected < 0.99
    # the rows are kept in float32: a pair within its rounding may go either way
    assert abs(crossed[0] - expected) <= 2 / (40 * 39)


def test_probabilities_are_met_by_their_logits() -> None:
    """A softmax's probabilities, float and quantized, pair as the logits they come from: the
    log's per-row constant does not move an argmax."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((30, 5)) * 2
    quantized = logits + rng.standard_normal((30, 5)) * 0.6
    rows = DecisionRows()
    rows.add(_softmax(logits).astype(np.float32), _softmax(quantized).astype(np.float32),
             probabilities=True)
    held = DecisionRows()
    more = rng.standard_normal((10, 5)) * 2
    more_quantized = more + rng.standard_normal((10, 5)) * 0.6
    held.add(_softmax(more).astype(np.float32), _softmax(more_quantized).astype(np.float32),
             probabilities=True)
    crossed = crossed_agreement([rows, held])  # two sets of samples, pooled
    assert crossed is not None
    together, moved = np.vstack([logits, more]), np.vstack([quantized, more_quantized])
    assert abs(crossed[0] - _brute_force(together, moved - together)) <= 2 / (40 * 39)
    # the probabilities themselves would pair as if nothing could change
    probabilities = _softmax(together)
    assert _brute_force(probabilities, _softmax(moved) - probabilities) > crossed[0]


def test_without_one_sample_is_the_best_of_the_shares_left_out() -> None:
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((30, 6)) * 3
    errors = rng.standard_normal((30, 6)) * rng.exponential(0.7, (30, 1))
    rows = DecisionRows()
    rows.add(scores, scores + errors, probabilities=False)
    crossed = crossed_agreement([rows])
    assert crossed is not None
    left_out = [_brute_force(np.delete(scores, k, 0), np.delete(errors, k, 0)) for k in range(30)]
    assert abs(crossed[1] - max(left_out)) <= 2 / (29 * 28)
    assert crossed[1] >= crossed[0]


def test_more_than_its_cap_of_values_keeps_no_estimate(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import qcal.accuracy.crossed

    monkeypatch.setattr(qcal.accuracy.crossed, "MAX_VALUES", 100)
    rows = DecisionRows()
    x = np.eye(10, dtype=np.float32)
    rows.add(x, x, probabilities=False)
    assert crossed_agreement([rows]) is not None
    rows.add(x[:1], x[:1], probabilities=False)
    assert crossed_agreement([rows]) is None


def _comparison(scores: np.ndarray, errors: np.ndarray) -> Comparison:
    accumulator = OutputAccumulator(rule=DecisionRule(linear=True))
    for k in range(scores.shape[0]):
        accumulator.add(scores[k:k + 1].astype(np.float32),
                        (scores[k:k + 1] + errors[k:k + 1]).astype(np.float32), None, samples=1)
    return Comparison(scores.shape[0], (accumulator.metrics("logits"),))


def test_errors_that_would_change_other_samples_fail_the_calibration_samples() -> None:
    """64 samples, every decision alike: margins of 1-8 between the first two classes, and one
    sample in 8 whose error lifts the second class by 5 (its own margin larger). Counted, 64 of
    64 agree; met with the others' scores, about 1 pair in 16 changes, which the floor's 1 %
    misses whichever sample is left out. The same samples with errors a tenth as large:
    nothing missed; nor where one sample alone, a near-tie of the float model's two classes,
    changes under most errors."""
    rng = np.random.default_rng(4)
    margins = rng.uniform(1.0, 8.0, 64)
    margins[::8] = rng.uniform(6.0, 8.0, 8)
    scores = np.zeros((64, 4))
    scores[:, 0], scores[:, 1] = margins, 0.0
    errors = rng.standard_normal((64, 4)) * 0.05
    errors[::8, 1] += 5.0
    held_out, calibration = _comparison(scores[:16], errors[:16]), _comparison(scores[16:],
                                                                              errors[16:])
    for comparison in (held_out, calibration):
        assert comparison.outputs[0].top1_agreement == 1.0
    target = CalibrationConfig().accuracy_target()
    missed = target.clearly_missed(calibration, held_out)
    expected = _brute_force(scores, errors)
    assert expected < 0.97
    shown = f"{np.floor(expected * 10000) / 100:.2f} % of the decisions of logits alike"
    assert missed is not None and shown in missed, missed
    best = max(_brute_force(np.delete(scores, k, 0), np.delete(errors, k, 0)) for k in range(64))
    assert f"(at most {np.floor(best * 10000) / 100:.2f} % without any one sample)" in missed
    assert target.clearly_missed(_comparison(scores[16:], errors[16:] / 10),
                                 _comparison(scores[:16], errors[:16] / 10)) is None
    tie = scores.copy()
    tie[:, 0] = rng.uniform(5.0, 8.0, 64)  # every margin wide
    tie[20, 0] = 1e-3                       # but one
    small = rng.standard_normal((64, 4)) * 0.05
    alone = target.clearly_missed(_comparison(tie[16:], small[16:]),
                                  _comparison(tie[:16], small[:16]))
    assert alone is None
    assert _brute_force(tie, small) < 0.99  # the one sample moves the share below the floor
