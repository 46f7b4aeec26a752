"""One scoring call across ranks (threads with a real all-to-all): the same results, batch by batch, for every world
size, whichever rank computes a batch; a slow rank's batches are taken over."""

import time

import numpy as np
import pytest

from distperp_harness.planning.requests import continuation_unit, window_units
from distperp_harness.run.execution.calls import RunStats
from distperp_harness.run.execution.executor import Executor, Forwards
from distperp_harness.run.rules import Batching, ScoringRule, Sharing
from distperp_harness.run.scoring.engine.forward import N_COLUMNS, BatchScores
from distperp_harness.run.scoring.pipeline import score_requests
from distperp_harness.run.scoring.routes import WideRows
from tests.helpers import ThreadStore as _Store
from tests.helpers import run_ranks as _run


def _requests(seed=0):
    rng = np.random.default_rng(seed)
    block = [int(t) for t in rng.integers(5, 900, 60)]
    out = []
    for _q in range(16):
        context = block + [int(t) for t in rng.integers(5, 900, int(rng.integers(3, 20)))]
        out += [[continuation_unit(context, [1000 + a] * (1 + a % 2), 256)] for a in range(4)]
    text = [int(t) for t in rng.integers(5, 900, 300)]
    out.append(window_units(text, 1, 64, 32))  # a request of several units
    out.append([])  # an empty continuation
    return out


def _score_fn(slow_rank=None, rank=None, delay=0.0, batch_terms=True, nudge=None):
    """Scores that depend on the unit and (``batch_terms``) on the batch it is computed in; ``nudge``: the key of
    one unit whose score moves by one ulp."""

    def score(rows, shared):
        if rank == slow_rank:
            time.sleep(delay)
        stats, kl = [], []
        for row in rows:  # a number that depends on the unit and on the batch it is computed in
            for u in row.units:
                v = np.zeros(N_COLUMNS)
                v[0] = -sum(u.tokens) / 1e3
                if batch_terms:
                    v[0] -= 1e-6 * len(rows) + 1e-9 * shared + 1e-12 * row.length
                if u.key() == nudge:
                    v[0] = np.nextafter(v[0], 0.0)
                v[1], v[2] = 1.0, u.n_score
                stats.append(v)
                kl.append(np.full(u.n_score, 0.25) + 1e-3 * len(rows))
        return BatchScores(np.stack(stats), kl)

    return score


def _call(
    world,
    requests,
    mode,
    claiming=True,
    slow=None,
    delay=0.0,
    with_reference=True,
    shard_size=1,
    forwards=None,
    batch_size=3,
    tp_size=1,
    seen=None,
    batch_terms=True,
    nudge=None,
    cp_min=None,
):
    """``cp_min``: batches with a row of at least this many tokens go to groups of two ranks (``cp_size=2``), whose
    forwards mark their results (+0.5) and record what they computed in ``seen`` under ``("cp", key, shared)``."""
    store = _Store()
    shares = [[k for k in range(len(requests)) if k % world == r] for r in range(world)]

    def body(c):
        stats = RunStats()
        score = _score_fn(slow, c.rank, delay, batch_terms, nudge)

        def counted(rows, shared):
            if forwards is not None:
                forwards[c.rank] += 2 if shared else 1
            if seen is not None:
                seen[c.rank].append(tuple(u.key() for row in rows for u in row.units))
            return score(rows, shared)

        def idle():
            forwards[c.rank] += 1

        def grouped(rows, shared):
            seen[c.rank].append(("cp", tuple(u.key() for row in rows for u in row.units), shared))
            scores = score(rows, shared)
            scores.stats[:, 0] += 0.5
            return scores

        def executor(forward, group):
            return Executor(
                c,
                Forwards(score=forward, idle_score=idle),
                claiming=claiming,
                shard_size=shard_size,
                tp_size=group,
                local_world_size=world,
            )

        wide = None
        if cp_min is not None:
            stats.cp_size = 2
            wide = WideRows(executor(grouped, 2), cp_min)
        rule = ScoringRule(Batching(batch_size), Sharing(mode, 200), attention_coef=1e-4, with_reference=with_reference)
        out = score_requests(
            [requests[k] for k in shares[c.rank]], executor(counted, tp_size), rule, stats=stats, wide=wide
        )
        return out, stats

    import distperp_harness.run.execution.executor as executor_module

    original, executor_module.default_store = executor_module.default_store, lambda: store
    try:
        results = _run(world, body)
    finally:
        executor_module.default_store = original
    merged = [None] * len(requests)
    for r, (out, _) in enumerate(results):
        for k, res in zip(shares[r], out):
            merged[k] = res
    return merged, [stats for _, stats in results]


@pytest.mark.parametrize("mode", ["off", "inputs", "prefix"])
def test_the_same_bits_on_one_two_and_three_ranks(mode):
    requests = _requests()
    one, stats1 = _call(1, requests, mode)
    for world in (2, 3):
        many, stats = _call(world, requests, mode)
        for a, b in zip(one, many):
            assert a.loglikelihood == b.loglikelihood and a.n_tokens == b.n_tokens and a.is_greedy == b.is_greedy
            assert a.kl.tolist() == b.kl.tolist()
        assert {s.fingerprint for s in stats} == {stats1[0].fingerprint}
        call = stats[0].calls[-1]
        assert call.claiming == "dynamic" and sum(r.units for r in call.per_rank) == call.batches
    assert one[-1].n_tokens == 0 and one[-1].loglikelihood == 0.0
    expected = -sum(requests[0][0].tokens) / 1e3
    assert abs(one[0].loglikelihood - expected) < 1e-3  # the unit's own number came back to its request


def test_the_fingerprint_is_equal_exactly_when_the_per_unit_results_are():
    """Results that do not depend on their batch (as a model's do not): batch sizes 1 and 5 on 1 and 2 ranks give
    one fingerprint; one unit's score moved by one ulp gives another."""
    requests = _requests(2)
    runs = [_call(world, requests, "prefix", batch_size=b, batch_terms=False) for world, b in ((1, 1), (2, 5), (1, 5))]
    assert len({s.fingerprint for _, stats in runs for s in stats}) == 1
    assert [r.loglikelihood for r in runs[0][0]] == [r.loglikelihood for r in runs[1][0]]
    _, moved = _call(1, requests, "prefix", batch_size=5, batch_terms=False, nudge=requests[3][0].key())
    assert moved[0].fingerprint != runs[0][1][0].fingerprint


def test_a_slow_rank_computes_fewer_batches_and_changes_no_bit():
    requests = _requests(1)
    quiet, stats = _call(2, requests, "prefix", claiming=False)
    slowed, slow_stats = _call(2, requests, "prefix", slow=1, delay=0.05)
    assert [r.loglikelihood for r in quiet] == [r.loglikelihood for r in slowed]
    assert slow_stats[0].fingerprint == stats[0].fingerprint
    per_rank = slow_stats[0].calls[-1].per_rank
    assert per_rank[0].units > per_rank[1].units and per_rank[0].from_ward > 0
    assert stats[0].calls[-1].claiming == "static"


@pytest.mark.parametrize("claiming", [True, False])
def test_shard_groups_keep_their_forward_calls_in_step(claiming):
    """Two shard groups of two ranks: every rank of a group makes the same forward calls (batches, the prefix forward
    of a shared batch, idle forwards), every batch is computed once, and the bits are one process's; with claiming the
    other group takes over a slow group's batches."""
    requests = _requests(2)
    one, stats1 = _call(1, requests, "prefix", batch_size=1)
    forwards = [0] * 4
    many, stats = _call(
        4, requests, "prefix", claiming=claiming, shard_size=2, forwards=forwards, slow=0, delay=0.03, batch_size=1
    )  # a member takes its next batch before the step agrees,
    # so only batches two steps ahead can go to the other group: enough of them per rank
    assert [r.loglikelihood for r in one] == [r.loglikelihood for r in many]
    assert stats[0].fingerprint == stats1[0].fingerprint
    assert forwards[0] == forwards[1] and forwards[2] == forwards[3]
    call = stats[0].calls[-1]
    assert sum(r.units for r in call.per_rank) == call.batches
    assert call.claiming == ("dynamic" if claiming else "static")
    if claiming:
        assert call.per_rank[2].from_ward + call.per_rank[3].from_ward > 0


@pytest.mark.parametrize("claiming", [True, False])
def test_a_tensor_parallel_group_is_one_worker_whose_members_make_their_leaders_forwards(claiming):
    """Two TP groups of two ranks: each member computes exactly its leader's batches in its leader's order (the
    forwards of a TP group are collective), only leaders report, every batch is computed by one group, and the bits
    are one process's; with claiming the other group takes over a slow group's batches."""
    requests = _requests(3)
    one, stats1 = _call(1, requests, "prefix", batch_size=1)
    seen = [[] for _ in range(4)]
    many, stats = _call(
        4, requests, "prefix", claiming=claiming, tp_size=2, seen=seen, slow=0, delay=0.03, batch_size=1
    )
    assert [r.loglikelihood for r in one] == [r.loglikelihood for r in many]
    assert [r.kl.tolist() for r in one] == [r.kl.tolist() for r in many]
    assert stats[0].fingerprint == stats1[0].fingerprint
    assert seen[0] == seen[1] and seen[2] == seen[3] and not set(seen[0]) & set(seen[2])
    call = stats[0].calls[-1]
    assert call.per_rank[1].units == call.per_rank[3].units == 0  # members report nothing
    assert call.per_rank[0].units + call.per_rank[2].units == call.batches == len(seen[0]) + len(seen[2])
    assert call.computed_tokens == stats1[0].calls[-1].computed_tokens  # counted once per group
    if claiming:
        assert call.per_rank[2].from_ward > 0


@pytest.mark.parametrize("claiming", [True, False])
def test_long_rows_go_to_context_parallel_groups_and_short_rows_stay_data_parallel(claiming):
    """cp_size=2 with a row-length threshold: a batch with a row of at least ``cp_min`` tokens is computed by a group
    (both members make its forward, with no shared prefix; the leader reports), every other batch by one rank with
    cp_size=1's bits; 2 ranks (one group) and 4 ranks (two groups) give the same bits; the fingerprint is marked
    cp2: only when a group computed a row, and a threshold above every row gives cp_size=1's fingerprint."""
    requests = _requests(4)
    one, stats1 = _call(1, requests, "prefix", batch_size=2)
    runs = {}
    for world in (2, 4):
        seen = [[] for _ in range(world)]
        runs[world] = (*_call(world, requests, "prefix", claiming=claiming, batch_size=2, seen=seen, cp_min=80), seen)
    results, stats, seen = runs[4]
    wide = {k for rank in seen for entry in rank if entry[0] == "cp" for k in entry[1]}
    plain = {k for rank in seen for entry in rank if entry[0] != "cp" for k in entry}
    assert wide and plain and not wide & plain
    assert all(entry[2] == 0 for rank in seen for entry in rank if entry[0] == "cp")  # no cached prefix in a group
    for g in (0, 2):  # a group's members make the same forwards
        assert [e for e in seen[g] if e[0] == "cp"] == [e for e in seen[g + 1] if e[0] == "cp"]
    for request, a, b in zip(requests, one, results):
        keys = {u.key() for u in request}
        if keys and keys <= plain:
            assert a.loglikelihood == b.loglikelihood  # computed as with cp_size=1
        elif keys:
            assert keys <= wide and b.loglikelihood > a.loglikelihood  # the group's mark
    assert [r.loglikelihood for r in runs[2][0]] == [r.loglikelihood for r in results]
    assert {s.fingerprint for s in runs[2][1]} == {stats[0].fingerprint} and stats[0].fingerprint.startswith("cp2:")
    call = stats[0].calls[-1]
    assert 0 < call.context_parallel_rows < call.rows
    assert sum(r.units for r in call.per_rank) == call.batches  # each batch computed once, reported once
    _, above = _call(4, requests, "prefix", claiming=claiming, batch_size=2, seen=[[] for _ in range(4)], cp_min=10**6)
    assert above[0].fingerprint == stats1[0].fingerprint and above[0].calls[-1].context_parallel_rows == 0
