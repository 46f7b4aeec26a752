"""The plan's scored-token balance, head cost term and whole-batch bound."""

import math
import random

import pytest

from distperp_harness.planning.plan import (
    Batch,
    assign_batches,
    balance_report,
    batch_cost,
    make_batches,
    whole_batch_bound,
)


def _rolling_windows(doc_lengths, max_length=1024):
    """(input length, scored) of lm-eval's rolling windows: every window after the first reads max_length tokens."""
    shapes = []
    for n in doc_lengths:
        for start in range(0, n, max_length):
            end = min(start + max_length, n)
            shapes.append((min(end, max_length), end - start))
    shapes.sort(key=lambda s: -s[0])
    return [s[0] for s in shapes], [s[1] for s in shapes]


def test_n_score_fills_scored_without_moving_boundaries():
    lengths, n_score = [100, 100, 90, 50, 10], [100, 3, 90, 7, 10]
    plain = make_batches(lengths, token_budget=200, max_batch_size=3)
    scored = make_batches(lengths, token_budget=200, max_batch_size=3, n_score=n_score)
    assert [(b.start, b.stop, b.padded_length) for b in plain] == [(b.start, b.stop, b.padded_length) for b in scored]
    assert [b.scored for b in scored] == [103, 97, 10] and all(b.scored == 0 for b in plain)
    with pytest.raises(ValueError, match="n_score has 2 entries for 5 units"):
        make_batches(lengths, batch_size=2, n_score=[1, 2])


def test_batch_cost_terms():
    batch = Batch(0, 4, 100, scored=250)
    assert batch_cost(batch) == 400
    assert batch_cost(batch, attention_coef=0.01) == pytest.approx(400 * 2)
    assert batch_cost(batch, attention_coef=0.01, head_coef=0.5) == pytest.approx(800 + 125)


@pytest.mark.parametrize("n, world", [(349, 64), (10, 3), (7, 7), (5, 8), (1000, 1)])
def test_bound_of_equal_batches_is_the_pigeonhole_count(n, world):
    assert whole_batch_bound([2.0] * n, world) == pytest.approx(2.0 * math.ceil(n / world))


def test_bound_never_exceeds_what_lpt_reaches():
    rng = random.Random(0)
    for world in (2, 5, 16, 64):
        costs = [rng.uniform(1, 100) for _ in range(rng.randrange(1, 300))]
        # each batch one row of length c: its cost is c padded tokens
        batches = [Batch(i, i + 1, max(1, int(c))) for i, c in enumerate(costs)]
        report = balance_report(assign_batches(batches, world))
        assert report.best_max_over_mean <= report.max_over_mean + 1e-12


def test_equal_inputs_spread_their_scored_tokens():
    rng = random.Random(5)
    docs = [int(rng.lognormvariate(8.1, 1.0)) + 1 for _ in range(62)]
    lengths, n_score = _rolling_windows(docs)
    batches = make_batches(lengths, batch_size=1, n_score=n_score)
    report = balance_report(assign_batches(batches, 16))
    assert report.scored_max_over_mean <= 1.05  # scored tokens balanced too, not only the padded inputs
    assert report.max_over_mean <= 1.05 * report.best_max_over_mean


def test_head_term_balances_compute_and_stays_deterministic():
    rng = random.Random(6)
    docs = [int(rng.lognormvariate(8.1, 1.0)) + 1 for _ in range(200)]
    lengths, n_score = _rolling_windows(docs)
    batches = make_batches(lengths, batch_size=1, n_score=n_score)
    a, h = 3e-4, 0.6
    plan = assign_batches(batches, 32, a, h)
    assert plan.owner == assign_batches(batches, 32, a, h).owner
    report = balance_report(plan, a, h)
    assert report.max_over_mean <= 1.05
    assert sum(report.scored_tokens_per_rank) == sum(n_score)
