"""jobs.py: generation is planned from records; the plan does not depend on how jobs are spread over ranks, prompts
sharing a block sit together, and a prompt's tokens reach only the ranks that may compute its lanes."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from distperp_harness.planning.records import BLOCK, FlatUnits, HashCollision, local_records
from distperp_harness.run.execution.groups import Workers
from distperp_harness.run.generation.jobs import (
    JOB,
    Crew,
    JobTable,
    LocalJobs,
    WideCrew,
    assign_lanes,
    decode_jobs,
    encode_jobs,
    key_hex,
    key_words,
    ladder_shared,
    plan_generation,
    prefix_groups,
)
from distperp_harness.run.generation.lanes import lane_prefix
from tests.helpers import run_ranks as _run


def _key(name) -> str:
    return hashlib.sha256(repr(name).encode()).hexdigest()[:32]


def _local(jobs) -> LocalJobs:
    """``jobs``: ``(name, prompt, group, max_new, sampled)`` as one rank holds them."""
    prompts = list(dict.fromkeys(tuple(p) for _, p, _, _, _ in jobs))
    flat = FlatUnits.of_sequences(prompts, [0] * len(prompts))
    keys = dict(zip(prompts, flat.keys()))
    records = np.zeros(len(jobs), dtype=JOB)
    for i, (name, prompt, group, max_new, sampled) in enumerate(jobs):
        records[i] = (key_words(_key(name)), keys[tuple(prompt)], group, max_new, int(sampled))
    return LocalJobs(records, flat, {g: {"until": ["\n"], "max_gen_toks": m} for _, _, g, m, _ in jobs})


def _table(parts) -> JobTable:
    return JobTable.merge([decode_jobs(encode_jobs(local_records(p.prompts), p.records)) for p in parts])


def _fewshot(rng, n=24):
    """Prompts of two few-shot blocks (50 and 70 tokens) and prompts of their own, as ``(name, prompt, group,
    max_new, sampled)``; two argument groups."""
    blocks = [[rng.randrange(5, 500) for _ in range(50)], [rng.randrange(5, 500) for _ in range(70)]]
    jobs = []
    for i in range(n):
        own = [rng.randrange(5, 500) for _ in range(rng.randrange(3, 30))]
        prompt = (blocks[i % 3] if i % 3 < 2 else []) + own
        jobs.append((("doc", i), prompt, 7 if i < n - 4 else 9, 32, i % 5 == 0))
    return jobs, blocks


def test_the_table_is_the_same_however_jobs_are_spread_over_ranks():
    rng = random.Random(0)
    jobs, _ = _fewshot(rng)
    one = _table([_local(jobs)])
    for world in (2, 3, 5):
        parts = [[] for _ in range(world)]
        for i, job in enumerate(rng.sample(jobs, len(jobs))):
            parts[i % world].append(job)
        parts[-1].append(parts[0][0])  # a padding copy, as lm-eval adds
        many = _table([_local(p) for p in parts])
        assert many.jobs.tobytes() == one.jobs.tobytes()
        assert np.array_equal(many.lengths, one.lengths)
        holds = many.holders_of(range(len(many)))
        for r, part in enumerate(parts):
            assert all(r in holds[_key(name)] for name, *_ in part)
        assert sum(len(h) for h in holds.values()) == sum(len({n for n, *_ in p}) for p in parts)


def test_prompts_sharing_a_block_sit_together_and_arguments_never_mix():
    rng = random.Random(1)
    jobs, blocks = _fewshot(rng, n=30)
    table = _table([_local(jobs[::2]), _local(jobs[1::2])])
    by_key = {_key(name): (prompt, group) for name, prompt, group, _, _ in jobs}
    order = [by_key[key_hex(k)] for k in table.jobs["key"]]
    assert [g for _, g in order] == sorted(g for _, g in order)  # arguments first
    for block in blocks:
        places = [i for i, (p, g) in enumerate(order) if g == 7 and p[: len(block)] == block]
        assert places == list(range(places[0], places[0] + len(places)))  # contiguous


@pytest.mark.parametrize("seed", range(4))
def test_the_planned_prefix_is_the_exact_one_to_a_block(seed):
    rng = random.Random(seed)
    block = [rng.randrange(5, 500) for _ in range(rng.randrange(20, 90))]
    prompts = [
        block[: rng.randrange(len(block) // 2, len(block) + 1)]
        + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 20))]
        for _ in range(9)
    ]
    table = _table([_local([(i, p, 1, 16, False) for i, p in enumerate(prompts)])])
    ordered = [list(prompts[[_key(i) for i in range(9)].index(key_hex(k))]) for k in table.jobs["key"]]
    for start, stop in ((0, 9), (2, 7), (4, 6)):
        exact, donor = lane_prefix(ordered[start:stop], 1)
        planned = ladder_shared(table, start, stop, 1)
        floor = exact // BLOCK * BLOCK
        assert planned == ((floor, donor) if floor else (0, 0))


def test_the_same_key_for_other_jobs_stops_the_run():
    a = _local([("x", [1, 2, 3], 1, 16, False)])
    b = _local([("x", [1, 2, 3], 1, 32, False)])  # another max_new under the same key
    with pytest.raises(HashCollision):
        _table([a, b])


@pytest.mark.parametrize("step", [0, 1])
def test_prompts_reach_only_the_ranks_of_their_lanes(step):
    rng = random.Random(2)
    jobs, _ = _fewshot(rng, n=36)
    jobs = [(name, prompt * 6, group, m, s) for name, prompt, group, m, s in jobs]  # long prompts, as few-shot are
    world = 3
    parts = [_local(jobs[r::world]) for r in range(world)]
    plans = _run(
        world,
        lambda c: (
            plan_generation(c, parts[c.rank], 100 + c.rank, lambda n: 2, 32, Crew(Workers(world), step)),
            c.received,
        ),
    )
    base = plans[0][0]
    prompt_bytes = sum(4 * len(p) for _, p, *_ in jobs)
    for r, (planned, received) in enumerate(plans):
        assert planned.table.jobs.tobytes() == base.table.jobs.tobytes() and planned.lanes == base.lanes
        assert planned.seed == 100  # rank 0's
        may = {
            i
            for i, owner in enumerate(planned.parts[0].plan.owner)
            if r in (owner, (owner + step) % world if step else -1)
        }
        needed = {
            int(planned.table.prompt_id[j]) for i in may for j in range(planned.lanes[i].start, planned.lanes[i].stop)
        }
        own = set(planned.table.prompts.ids(parts[r].prompts.keys()).tolist())
        assert set(planned.available.received_ids.tolist()) == needed - own
        for uid in needed:  # and they are the holders' tokens
            name = next(
                n
                for n, p, *_ in jobs
                if FlatUnits.of_sequences([p], [0]).keys()[0].tolist()
                == planned.table.prompts.units["key"][uid].tolist()
            )
            assert list(planned.available.sequence(uid)) == next(p for n, p, *_ in jobs if n == name)
        records = sum(len(encode_jobs(local_records(p.prompts), p.records)) for k, p in enumerate(parts) if k != r)
        tokens = sum(4 * (3 + len(planned.available.sequence(uid))) for uid in needed - own)
        assert received <= records + tokens + 8 * world  # records, the tokens it computes, the message sizes
        if not step:  # each rank computes a third: far less than the all-gather of every prompt to every rank
            assert received < prompt_bytes / 2


def test_fixed_prefixes_give_every_job_its_group_prefix_whatever_the_slots():
    """Batch-invariant generation (``fixed_prefixes``): a job's prefix is its prefix group's, the same for any number
    of slots per lane (lanes are cut as without it); a job alone in its group has none."""
    rng = random.Random(2)
    jobs, blocks = _fewshot(rng, n=30)
    table = _table([_local(jobs)])
    prefix = prefix_groups(table, 32)
    plain = assign_lanes(table, lambda length: 3, 32, Crew(Workers(2)))
    for slots in (1, 2, 3, 8):
        assigned = assign_lanes(table, lambda length, s=slots: s, 32, Crew(Workers(2)), fixed_prefixes=True)
        got = [p for lane in assigned.lanes for p in lane.prefixes]
        assert got == prefix.tolist()
        if slots == 3:
            assert [(lane.start, lane.stop) for lane in assigned.lanes] == [(x.start, x.stop) for x in plain.lanes]
    assert all(not lane.prefixes for lane in plain.lanes)
    # the two blocks (50 and 70 tokens: 48 and 64 to whole blocks) are the groups' prefixes; prompts without a
    # block are alone in theirs
    assert set(prefix.tolist()) == {0, (50 // BLOCK) * BLOCK, (70 // BLOCK) * BLOCK}
    which = [(g, 0 if p[:50] == blocks[0] else 1 if p[:70] == blocks[1] else None) for _, p, g, *_ in jobs]
    expected = [w for w in which if w[1] is not None and which.count(w) > 1]  # a block shared within the arguments
    assert sum(1 for p in prefix if p) == len(expected) > 0


def test_long_prompts_go_to_lanes_of_their_own_on_the_groups_and_reach_every_member():
    """``cp_size`` > 1 (``wide``): jobs whose prompt has ``min_tokens`` tokens or more go to lanes that hold no other
    job and share no prefix, owned by context-parallel groups (2 groups of 2 here); their tokens reach both members
    of the owning group and no other rank; the other jobs keep their lanes, owned by ranks, and the plan is the same
    on every rank."""
    rng = random.Random(5)
    jobs = []
    for i in range(20):
        n = 400 + rng.randrange(50) if i % 2 == 0 else rng.randrange(5, 60)
        jobs.append((("doc", i), [rng.randrange(5, 500) for _ in range(n)], 7, 16, False))
    world = 4
    parts = [_local(jobs[r::world]) for r in range(world)]
    wide = WideCrew(300, Crew(Workers(world, 2)))

    def plan(c):
        return plan_generation(c, parts[c.rank], 1, lambda n: 3, 32, Crew(Workers(world)), wide=wide)

    plans = _run(world, plan)
    base = plans[0]
    long_jobs = {j for j in range(len(base.table)) if base.table.lengths[j] >= 300}
    assert len(long_jobs) == 10
    groups_part, ranks_part = base.parts
    assert groups_part.wide and not ranks_part.wide
    assert sorted(groups_part.lanes + ranks_part.lanes) == list(range(len(base.lanes)))
    for i in groups_part.lanes:
        lane = base.lanes[i]
        assert set(range(lane.start, lane.stop)) <= long_jobs and lane.shared == 0
        assert lane.slots == min(3, lane.jobs)
    assert {j for i in groups_part.lanes for j in range(base.lanes[i].start, base.lanes[i].stop)} == long_jobs
    assert any(base.lanes[i].jobs > 1 for i in groups_part.lanes)  # several long prompts share a group's lane
    assert all(not set(range(base.lanes[i].start, base.lanes[i].stop)) & long_jobs for i in ranks_part.lanes)
    for planned in plans[1:]:
        assert planned.lanes == base.lanes
        assert [p.lanes for p in planned.parts] == [p.lanes for p in base.parts]

    def prompts_of(lanes):
        return {int(base.table.prompt_id[j]) for i in lanes for j in range(base.lanes[i].start, base.lanes[i].stop)}

    for r, planned in enumerate(plans):
        needed = prompts_of(groups_part.lanes_of(r // 2))
        own = set(planned.table.prompts.ids(parts[r].prompts.keys()).tolist())
        others = prompts_of(groups_part.lanes) - needed
        received = set(planned.available.received_ids.tolist())
        assert needed - own <= received  # both members of the owning group hold the prompt
        assert not (others - own) & received  # and no other group's long prompt travels here
