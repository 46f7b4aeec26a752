"""The executor's policy, with fake forwards and a fake resume store: saved units are reused (a shard group's
member still makes its share of forwards), computed ones are saved, lanes likewise, and every rank's facts come
back in rank order."""

import numpy as np
import pytest

from distperp_harness.run.execution.calls import GenerationCall, RankShare, RunStats, ScoringCall
from distperp_harness.run.execution.executor import Executor, Forwards
from distperp_harness.run.scoring.engine.forward import N_COLUMNS, BatchScores
from tests.helpers import run_ranks as _run


class _Store:
    def __init__(self):
        self.batches, self.lanes, self.saved = {}, {}, 0

    def load(self, rows):
        return self.batches.get(tuple(rows))

    def save(self, rows, scores):
        self.batches[tuple(rows)], self.saved = scores, self.saved + 1

    def load_lane(self, key, jobs):
        texts = self.lanes.get(key)
        return texts if texts is not None and len(texts) == jobs else None

    def save_lane(self, key, texts):
        self.lanes[key], self.saved = list(texts), self.saved + 1

    def local_counts(self):
        return {"saved": self.saved}

    def add_up(self, per_rank):
        self.total = sum(c["saved"] for c in per_rank)


class _One:
    rank, world_size, sequence, bytes_received = 0, 1, 0, 0

    def all_gather_object(self, obj, name=""):
        return [obj]


def _forwards(log):
    def score(rows, shared):
        log.append(("score", tuple(rows), shared))
        return BatchScores(np.full((len(rows), N_COLUMNS), float(len(rows))), [None] * len(rows))

    return Forwards(
        score=score, idle_score=lambda: log.append(("idle",)), idle_decode=lambda: log.append(("idle_decode",))
    )


@pytest.mark.parametrize("shard_size", [1, 2])
def test_a_saved_batch_is_reused_and_a_shard_member_still_makes_its_forwards(shard_size):
    log, store = [], _Store()
    executor = Executor(_One(), _forwards(log), store=store, shard_size=shard_size)
    first = executor.score(["a", "b"], shared=3)
    assert log == [("score", ("a", "b"), 3)] and store.saved == 1
    again = executor.score(["a", "b"], shared=3)
    assert again is first  # the saved bits, not a recomputation
    assert log[1:] == ([("idle",)] * 2 if shard_size > 1 else [])  # a shared batch is two forward calls


def test_a_lane_is_computed_once_saved_and_read_back():
    calls, store = [], _Store()
    executor = Executor(_One(), _forwards([]), store=store)

    def compute():
        calls.append(1)
        return ["x", "y"], {"generated": 5}

    assert executor.lane(b"k", 2, "lane 0", compute) == (["x", "y"], {"generated": 5})
    assert executor.lane(b"k", 2, "lane 0", compute) == (["x", "y"], None) and calls == [1]
    assert executor.lane(None, 2, "lane 0", compute)[1] == {"generated": 5} and calls == [1, 1]


def test_an_error_in_a_lane_leaves_nothing_saved():
    store = _Store()
    executor = Executor(_One(), _forwards([]), store=store)

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        executor.lane(b"k", 1, "lane 0", broken)
    assert store.lanes == {}


def test_facts_come_back_for_every_rank_in_rank_order_and_resume_counts_add_up():
    stores = [_Store() for _ in range(3)]

    def body(c):
        c.bytes_received = 0
        executor = Executor(c, _forwards([]), store=stores[c.rank])
        for i in range(c.rank + 1):
            executor.score([f"{c.rank}/{i}"])
        return executor.facts(0)

    facts = _run(3, body)
    assert [[f.resume_counts["saved"] for f in rank_facts] for rank_facts in facts] == [[1, 2, 3]] * 3
    assert all(s.total == 6 for s in stores)


def test_call_records_serialize_to_the_results_json_keys():
    share = RankShare(rank=0, units=3, from_ward=1, seconds=0.5, tokens=40)
    scoring = ScoringCall(
        "loglikelihood",
        10,
        4,
        "prefix",
        40,
        60,
        2,
        1,
        3,
        1,
        30,
        [40],
        1.0,
        1.0,
        1.0,
        "static",
        [share],
        0.1,
        0.4,
        0.5,
        0.45,
    )
    entry = scoring.to_dict()
    assert entry["per_rank"] == [{"rank": 0, "batches": 3, "from_ward": 1, "tokens": 40, "seconds": 0.5}]
    assert entry["computed_tokens_per_context"] == 20 and "facts" not in entry
    generation = GenerationCall(
        4,
        0,
        1,
        2,
        2,
        8,
        ["slots"],
        1,
        32,
        [40, 40],
        1,
        100,
        60,
        2,
        10,
        30,
        24,
        90,
        "dynamic",
        [RankShare(0, 2, 0, 1.0)],
        1,
        1.0,
    )
    entry = generation.to_dict()
    assert entry["kind"] == "generate_until" and entry["per_rank"] == [
        {"rank": 0, "lanes": 2, "from_ward": 0, "seconds": 1.0}
    ]
    assert entry["decode_positions_per_generated"] == pytest.approx(30 / 24)
    stats = RunStats([scoring, generation])
    assert [c["kind"] for c in stats.to_dicts()] == ["loglikelihood", "generate_until"]
