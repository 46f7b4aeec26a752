"""Routing: tokens reach every rank that may compute them, results every rank that asked; nothing else travels."""

import threading

import numpy as np
import pytest

from distperp_harness.planning.records import FlatUnits, GlobalTable, HashCollision, decode, encode, local_records
from distperp_harness.run.execution.routing import (
    _front_decoded,
    front_coded,
    move_tokens,
    result_routes,
    return_results,
    token_routes,
)
from tests.helpers import fewshot_units as _fewshot
from tests.helpers import run_ranks as _run


def _setup(world=3, tamper=None):
    units = _fewshot(questions=12)
    parts = [[u for k, u in enumerate(units) if k % world == r or k < 3] for r in range(world)]
    flats = [FlatUnits.of(p) for p in parts]
    table = GlobalTable([decode(encode(*local_records(f))) for f in flats])
    rng = np.random.default_rng(0)
    n_batches = 7
    unit_batch = rng.integers(0, n_batches, len(table))
    owner = rng.integers(0, world, n_batches)
    ranks = np.stack([owner, (owner + 1) % world], 1)
    if tamper is not None:
        flats[tamper].tokens[5] += 1  # a rank whose tokens no longer match its records
    return units, flats, table, unit_batch, ranks


def test_front_coding_round_trips_and_sends_a_shared_block_once():
    units = _fewshot(questions=10)
    flat = FlatUnits.of(units)
    ids = np.arange(len(units)) + 100
    message = front_coded(flat, np.arange(len(units)), ids)
    back = _front_decoded(message)
    assert all(back[100 + k].tolist() == list(u.tokens) for k, u in enumerate(units))
    assert len(message) < sum(len(u.tokens) for u in units) / 4


def test_every_rank_receives_the_units_of_the_batches_it_may_compute():
    units, flats, table, unit_batch, ranks = _setup()
    ids = [table.ids(f.keys()) for f in flats]
    available = _run(3, lambda c: move_tokens(c, table, ranks[unit_batch], flats[c.rank], ids[c.rank]))
    canonical = {int(i): u for f, own in zip(flats, ids) for k, i in enumerate(own) for u in [f.unit(k)]}
    for r in range(3):
        for b in range(len(ranks)):
            if r in ranks[b]:
                for i in np.flatnonzero(unit_batch == b):
                    assert available[r].unit(int(i)) == canonical[int(i)]
        sent = [token_routes(table, ranks[unit_batch], s, 3)[0][r] for s in range(3)]
        expect = token_routes(table, ranks[unit_batch], r, 3)[1]
        assert all(np.array_equal(a, b) for a, b in zip(sent, expect))
        assert not set(np.concatenate(expect).tolist()) & set(ids[r].tolist())  # nothing a rank holds travels


def test_a_sender_with_other_tokens_than_its_records_stops_the_run():
    units, flats, table, unit_batch, ranks = _setup()
    ids = [table.ids(f.keys()) for f in flats]
    sent = token_routes(table, ranks[unit_batch], 0, 3)[0]
    uid = int(np.concatenate(sent)[0])
    k = int(np.flatnonzero(ids[0] == uid)[0])
    flats[0].tokens[flats[0].offsets[k + 1] - 1] += 1  # a unit rank 0 sends, changed after its records were made
    with pytest.raises((HashCollision, threading.BrokenBarrierError)):
        _run(3, lambda c: move_tokens(c, table, ranks[unit_batch], flats[c.rank], ids[c.rank]))


@pytest.mark.parametrize("with_kl", [False, True])
def test_results_reach_every_holder_and_only_holders(with_kl):
    units, flats, table, unit_batch, ranks = _setup()
    ids = [table.ids(f.keys()) for f in flats]
    computer = ranks[:, 0].copy()
    n_score = table.units["n_score"]

    def stats(i):
        return np.asarray([-i - 0.5, 1.0, float(n_score[i])])

    def kl(i):
        return np.arange(n_score[i], dtype=np.float64) + i if with_kl else None

    checks = [dict(zip(own.tolist(), f.check_hashes().tolist())) for f, own in zip(flats, ids)]
    everyone = {}
    for c in checks:
        everyone.update(c)

    def body(c):
        mine = {
            int(i): (stats(i), everyone[int(i)], kl(i)) for i in range(len(table)) if computer[unit_batch[i]] == c.rank
        }
        return return_results(
            c, table, unit_batch, computer, mine, ids[c.rank], flats[c.rank].check_hashes(), 3, with_kl
        )

    out = _run(3, body)
    for r in range(3):
        assert sorted(out[r]) == sorted(ids[r].tolist())
        for i, (s, k) in out[r].items():
            assert s.tolist() == stats(i).tolist()
            assert (k is None) if not with_kl else k.tolist() == kl(i).tolist()
        send, expect = result_routes(table, unit_batch, computer, r, 3)
        assert all(computer[unit_batch[i]] == s for s, e in enumerate(expect) for i in e)
