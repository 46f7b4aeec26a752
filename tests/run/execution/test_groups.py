"""Workers and a TP group's shared decisions: the ranks of each worker, and members that read their leader's
decisions in order (including whether ``resume_dir`` holds a unit), so a group never splits."""

import threading

import numpy as np
import pytest

from distperp_harness.distributed.store import CollectiveError
from distperp_harness.run.execution.executor import Executor, Forwards
from distperp_harness.run.execution.groups import Follow, Workers
from distperp_harness.run.scoring.engine.forward import N_COLUMNS, BatchScores
from tests.helpers import ThreadStore as _ThreadStore


def test_workers_map_ranks_and_expand_to_every_member():
    w = Workers(6, 2)
    assert w.count == 3 and [w.of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [w.leads(r) for r in range(6)] == [True, False] * 3
    assert w.ranks(np.array([[2, 0], [1, -1]])).tolist() == [[4, 5, 0, 1], [2, 3, -1, -1]]
    assert w.ranks(np.zeros((0, 2), dtype=np.int64)).shape == (0, 4)  # a call with no units at all
    one = Workers(3)
    assert one.count == 3 and one.ranks(np.array([[2, -1]])).tolist() == [[2, -1]] and one.leads(2)


def test_members_read_their_leaders_values_in_order():
    store = _ThreadStore()
    got = {}

    def member(rank):
        follow = Follow(store, "call", rank, 2)
        got[rank] = [follow.share(-7) for _ in range(3)]

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 3)]
    for t in threads:
        t.start()
    for rank, values in ((0, [5, 1, -1]), (2, [9, -1, 4])):
        follow = Follow(store, "call", rank, 2)
        assert [follow.share(v) for v in values] == values
    for t in threads:
        t.join(10)
    assert got == {1: [5, 1, -1], 3: [9, -1, 4]}


def test_a_member_whose_leader_never_decides_is_told_who():
    class Gone:
        def get(self, key):
            raise TimeoutError("wait timeout after 1800000ms")

    with pytest.raises(
        CollectiveError, match="rank 3 waited for the next decision of its tensor-parallel group's leader, rank 2"
    ):
        Follow(Gone(), "call", 3, 2).share(0)


class _Saved:
    """A resume store holding one batch."""

    def __init__(self):
        self.batches, self.saves = {("a",): BatchScores(np.zeros((1, N_COLUMNS)), None)}, []

    def load(self, rows):
        return self.batches.get(tuple(rows))

    def save(self, rows, scores):
        self.saves.append(tuple(rows))


class _Rank:
    def __init__(self, rank):
        self.rank, self.world_size = rank, 2


def test_a_member_skips_the_forward_exactly_when_its_leader_read_the_batch_back(monkeypatch):
    """Only the leader consults ``resume_dir`` and saves; its member computes when the leader does and returns
    nothing when the leader read the batch back."""
    import distperp_harness.run.execution.executor as executor_module

    store = _ThreadStore()
    monkeypatch.setattr(executor_module, "default_store", lambda: store)
    logs, results = {0: [], 1: []}, {}

    def rank(r):
        saved = _Saved()

        def score(rows, shared):
            logs[r].append(tuple(rows))
            return BatchScores(np.ones((len(rows), N_COLUMNS)), None)

        executor = Executor(_Rank(r), Forwards(score=score), store=saved, claiming=False, tp_size=2)
        walk = executor.walk(iter([0, 1]) if r == 0 else iter([]), "call")
        results[r] = [(b, executor.score(["a"] if b == 0 else ["b"])) for b in walk], saved.saves

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert logs == {0: [("b",)], 1: [("b",)]}  # batch 0 read back by the leader: no forward on either
    (leader, leader_saves), (member, member_saves) = results[0], results[1]
    assert [b for b, _ in leader] == [b for b, _ in member] == [0, 1]
    assert leader[0][1] is not None and member[0][1] is None
    assert leader_saves == [("b",)] and member_saves == []
