"""The plan: batches never depend on the world size; whole batches balanced across ranks; fast at scale."""

import random
import time

import pytest

from distperp_harness.planning.plan import (
    assign_batches,
    balance_report,
    make_batches,
    rank_loads,
    round_robin_max_over_mean,
)


def _lengths(n, seed=0, longest=1024):
    rng = random.Random(seed)
    return sorted((rng.randrange(1, longest + 1) for _ in range(n)), reverse=True)


def test_batches_are_world_size_independent_and_cover_everything():
    lengths = _lengths(500)
    batches = make_batches(lengths, batch_size=8)
    assert [b.rows for b in batches[:-1]] == [8] * (len(batches) - 1)
    covered = [i for b in batches for i in range(b.start, b.stop)]
    assert covered == list(range(500))
    plans = [assign_batches(batches, w) for w in (1, 2, 3, 64)]
    assert all(p.batches == plans[0].batches for p in plans)
    for p in plans:  # each batch owned by exactly one rank
        assert sorted(i for r in range(p.world_size) for i in p.batches_of(r)) == list(range(len(batches)))


def test_token_budget_rows():
    batches = make_batches([100, 100, 100, 50, 50, 10], token_budget=200, max_batch_size=3)
    assert [(b.start, b.stop, b.padded_length) for b in batches] == [(0, 2, 100), (2, 4, 100), (4, 6, 50)]
    with pytest.raises(ValueError, match="non-increasing"):
        make_batches([1, 2], batch_size=1)


def test_lpt_is_deterministic_and_balanced():
    batches = make_batches(_lengths(2000, seed=1), batch_size=1)
    a, b = assign_batches(batches, 16), assign_batches(batches, 16)
    assert a.owner == b.owner
    report = balance_report(a)
    assert report.max_over_mean <= 1.05
    loads = rank_loads(a)
    assert abs(sum(loads) - sum(x.padded_tokens for x in batches)) < 1e-6


def test_balance_beats_round_robin_on_skewed_documents():
    rng = random.Random(3)
    docs = [int(rng.paretovariate(1.1) * 2000) for _ in range(62)]  # a few very long articles
    windows = sorted((min(1024, d - s) for d in docs for s in range(0, d, 1024)), reverse=True)
    plan = assign_batches(make_batches(windows, batch_size=1), 16)
    assert balance_report(plan).max_over_mean < round_robin_max_over_mean(docs, 16)


def test_large_batches_within_five_percent_of_the_whole_batch_bound():
    plan = assign_batches(make_batches(_lengths(5000, seed=2), batch_size=8), 8)
    report = balance_report(plan)
    assert report.max_over_mean <= 1.05 * report.best_max_over_mean


def test_simulation_1024_ranks_100m_tokens_runs_in_seconds():
    rng = random.Random(4)
    lengths = []
    total = 0
    while total < 100_000_000:  # realistic documents: log-normal lengths, cut into 1024-token windows
        doc = max(16, int(rng.lognormvariate(7.5, 1.2)))
        total += doc
        lengths.extend(min(1024, doc - s) for s in range(0, doc, 1024))
    lengths.sort(reverse=True)
    t0 = time.perf_counter()
    plan = assign_batches(make_batches(lengths, batch_size=1), 1024, attention_coef=1e-4)
    report = balance_report(plan, 1e-4)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    assert report.max_over_mean <= 1.05
