"""``generate_until`` under the global plan: lanes of continuously batched slots, claimed, resumable.

Every rank tokenizes its own prompts (:mod:`.requests`) and learns the global job list from every rank's records (greedy
requests with equal arguments are one job). Jobs are ordered canonically and cut into lanes by a rule that ignores the
world size (:mod:`.lanes`); whole lanes go to ranks by cost (prompt plus ``max_gen_toks`` tokens per job) and are
claimed like scoring batches (:mod:`distperp_harness.run.execution.claims`: a slow rank generates fewer). A lane is
decoded (:mod:`.lane_texts`) by the engine :func:`~.engines.choose_engine` picks: continuous batching (:mod:`.loop`:
each row stops on its own and its slot is refilled at once), or ``model.generate`` batches (:mod:`.batchgen`) for
arguments slots do not serve. The lane's schedule depends only on its jobs, so texts are identical for every world size
and whichever rank computes a lane. Finished lanes are saved to ``resume_dir`` and reused by a rerun on any world size.
Ranks plan from records, never prompt tokens (:mod:`.jobs`: 48 bytes per job and a hash per 16-token prefix block); a
prompt's tokens travel only to the ranks that may compute one of its lanes (owner and helper), and each text goes back
only to the ranks whose requests asked for it (an all-to-all).

**Long prompts on context-parallel groups.** With ``cp_size`` > 1 (``setup.wide``), every prompt of at least
``cp_min_tokens`` tokens goes to a lane holding only such prompts, owned by a group (:class:`~.jobs.WideCrew`; its
tokens reach every member of the owning and helping groups); the group walks its leader's claims, every member
computes the lane together (:mod:`.group_lane`: prefills split, cache split, the rows decoded together) and the
leader reports its texts. The groups' lanes come
first, then the other lanes on every rank as without groups.

**Shared prefix.** A lane's prompts that share at least ``min_shared_tokens`` leading tokens (few-shot prompts with
fixed examples: lm-eval's ``first_n`` sampler; a chat system prompt) start from that prefix's KV cache, computed
once per rank (:class:`~.prefill.PrefixCache`).

**Sampling.** A sampled request draws from its own ``torch.Generator`` seeded from lm-eval's torch seed (``--seed``,
third value; read as ``torch.initial_seed()``) and the request's content: prompt, generation arguments, lm-eval's
``(task, doc_id, idx)`` and its repeat index. Never its rank or lane: a sample is the same on any world size
(up to a draw that lands within float rounding of a boundary, when the batch size changes), changes with
``--seed``, and the global RNG is left as it was.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Sequence

import numpy as np
import torch
from accelerate.logging import get_logger

from distperp_harness.distributed.protocol import Collective
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.run.execution.calls import GenerationCall, RankShare
from distperp_harness.run.generation.engine.prefill import PrefixCache
from distperp_harness.run.generation.engine.stats import LaneRecord, LaneStats
from distperp_harness.run.generation.group_lane import GROUP_ENGINE, run_group_lane
from distperp_harness.run.generation.jobs import Crew, WideCrew, key_hex, kwargs_key_of, plan_generation
from distperp_harness.run.generation.lane_texts import lane_key, run_lane
from distperp_harness.run.generation.lanes import LanePlan
from distperp_harness.run.generation.prompts import Job, Prepared, job_keys, local_jobs, prepare, seed_of
from distperp_harness.run.generation.setup import GenerationSetup

log = get_logger(__name__)


def generate(
    setup: GenerationSetup,
    args: Sequence[tuple[str, dict]],
    identities: Sequence[Any] | None = None,
    calls: list | None = None,
) -> list[str]:
    """Generated continuations for this rank's ``(context, gen_kwargs)`` requests, in order; every rank calls
    this together.

    ``identities``: one JSON-able identity per request (the lm face passes lm-eval's ``(task, doc_id, idx)``); it
    seeds sampled requests, so two documents with equal prompts sample independently. ``calls``: when given, one
    record of this call is appended (jobs, lanes, slots, shared prefixes, tokens computed, seed, per-rank work).
    """
    start_time = time.perf_counter()
    executor = setup.executor
    collective = executor.collective
    received_before = getattr(collective, "bytes_received", 0)
    local_keys = job_keys(args, identities)
    mine = local_jobs(setup, local_keys, args)
    seed = setup.seed if setup.seed is not None else torch.initial_seed()
    wide = setup.wide
    planned = plan_generation(
        collective,
        mine,
        seed,
        setup.rows_for,
        setup.min_shared_tokens,
        Crew(executor.workers, executor.step),
        fixed_prefixes=setup.rows_alone,
        wide=None if wide is None else WideCrew(wide.min_tokens, Crew(wide.executor.workers, wide.executor.step)),
    )
    table, lanes, seed = planned.table, planned.lanes, planned.seed
    if setup.static is not None:  # compile the decode step for the plan's buckets, every rank together
        setup.static.prepare(collective, lanes)
    jobs, me = table.jobs, collective.rank

    def lane_jobs(lane: LanePlan) -> list[tuple[Job, Prepared]]:
        part = []
        for j in range(lane.start, lane.stop):
            record, group = jobs[j], int(jobs["group"][j])
            key, kw = key_hex(record["key"]), planned.kwargs_of[group]
            job = Job(
                key,
                planned.available.sequence(int(table.prompt_id[j])),
                kwargs_key_of(kw),
                kw,
                seed_of(seed, key) if record["sampled"] else None,
            )
            part.append((job, prepare(setup, job)))
        return part

    prefix = f"distperp/lanes/{collective.sequence}"
    crews = [(p, wide.executor if p.wide and wide is not None else executor) for p in planned.parts]
    total = sum(lanes[i].jobs for p, ex in crews if ex.reports for i in p.lanes_of(ex.worker))
    bar = setup.progress(total) if setup.progress else None
    texts, holders, stats, prefixes, taken = {}, {}, [], PrefixCache(), 0
    for part, crew in crews:  # the groups' lanes first: every rank meets its group there before anything else
        name = prefix + ("/wide" if part.wide else "")
        claims = crew.claims(part.lanes_of, name)
        with crew.decoding(name) as around:
            for i in crew.walk(claims, name):
                lane = lanes[i]
                jobs_of_lane = lane_jobs(lane)
                key = lane_key(jobs_of_lane, lane) if crew.store is not None else None
                if part.wide and wide is not None:
                    what = f"generating on a context-parallel group (lane {i}, a prompt of {lane.longest} tokens)"
                    hold = functools.partial(fail_for_tests, me, "group_step")
                    compute = functools.partial(run_group_lane, setup, jobs_of_lane, (i, lane), wide.group, bar, hold)
                else:
                    what = f"generating (lane {i}, {lane.jobs} prompts)"
                    compute = functools.partial(run_lane, setup, jobs_of_lane, (i, lane), prefixes, bar, around)
                saved, lane_record = crew.lane(key, lane.jobs, what, compute)
                if not crew.reports:
                    continue  # a tensor-parallel or context-parallel member: its leader reports the same texts
                if lane_record is not None:
                    stats.append(lane_record)
                elif bar is not None:
                    bar(lane.jobs, 0)
                texts.update({job.key: text for (job, _), text in zip(jobs_of_lane, saved)})
                holders.update(table.holders_of(range(lane.start, lane.stop)))
        taken += claims.taken_from_ward
    share = RankShare(me, len(stats), taken, round(time.perf_counter() - start_time, 4))
    all_texts = _texts_to_holders(collective, texts, holders)
    gathered = collective.all_gather_object((stats, share), "gather lane statistics")
    record = _record(
        [s for g in gathered for s in g[0]],
        lanes,
        jobs=len(table),
        sampled=int(jobs["sampled"].astype(bool).sum()),
        seed=seed,
        setup=setup,
        per_rank=[g[1] for g in gathered],
        seconds=time.perf_counter() - start_time,
    )
    record.facts = executor.facts(received_before)
    log.info(
        f"generate_until: {record.jobs} generations ({record.sampled_jobs} sampled"
        f"{f', seed {seed}' if record.sampled_jobs else ''}) in {record.lanes} lanes of up to "
        f"{record.slots_max} slots; {record.shared_lanes} started from a shared prefix; prompt tokens "
        f"computed {record.prefill_positions} of {record.prompt_tokens}; {record.generated} new tokens, "
        f"{record.decode_positions_per_generated:.3f} decode positions per new token; "
        f"{record.seconds:.1f} s",
        main_process_only=True,
    )
    if executor.store is not None:
        log.info(executor.store.reuse_line("generate_until", record.lanes, "lanes"), main_process_only=True)
    if calls is not None:
        calls.append(record)
    return [all_texts[key] for key, _, _ in local_keys]


def _texts_to_holders(collective: Collective, texts: dict[str, str], holders: dict[str, list[int]]) -> dict[str, str]:
    """Every text this rank computed goes to the ranks whose requests asked for it, and only to them (two
    all-to-alls: sizes, then UTF-8 JSON); returns the texts of this rank's own requests (every rank calls this)."""
    world = collective.world_size
    outgoing: list[dict[str, str]] = [{} for _ in range(world)]
    for key, text in texts.items():
        for rank in holders.get(key, ()):
            outgoing[rank][key] = text
    parts = [np.frombuffer(json.dumps(out).encode(), dtype=np.uint8) for out in outgoing]
    sizes = collective.exchange(
        [np.array([p.size], dtype=np.int64) for p in parts], [1] * world, "exchange the sizes of generated texts"
    )
    received = collective.exchange(parts, [int(n[0]) for n in sizes], "send generated texts to their ranks")
    mine: dict[str, str] = {}
    for part in received:
        mine.update(json.loads(part.tobytes().decode()))
    return mine


def _record(  # noqa: PLR0913 - keyword-only fields of the call's record
    records: list[LaneRecord],
    lanes: Sequence[LanePlan],
    *,
    jobs: int,
    sampled: int,
    seed: int,
    setup: GenerationSetup,
    per_rank: list[RankShare],
    seconds: float,
) -> GenerationCall:
    """The call's :class:`~distperp_harness.run.execution.calls.GenerationCall` from every computed lane's record."""
    total = LaneStats()
    for record in records:
        total.add(record.stats)
    shared = sorted(lane.shared for lane in lanes if lane.shared)
    return GenerationCall(
        jobs=jobs,
        sampled_jobs=sampled,
        seed=seed,
        lanes=len(lanes),
        lanes_computed=len(records),
        slots_max=max((lane.slots for lane in lanes), default=0),
        engines=sorted({r.engine for r in records}),
        shared_lanes=len(shared),
        min_shared_tokens=setup.min_shared_tokens,
        shared_tokens_min_max=[shared[0], shared[-1]] if shared else None,
        prefixes_computed=sum(r.stats.prefix_computed for r in records),
        prompt_tokens=total.prompt_tokens,
        prefill_positions=total.prefill_positions,
        prefill_forwards=total.prefill_forwards,
        decode_forwards=total.decode_forwards,
        decode_positions=total.decode_positions,
        generated=total.generated,
        peak_cache_positions=total.peak_cache_positions,
        padded_positions=total.padded_positions,
        host_reads=total.host_reads,
        decode_step=setup.static.kind if setup.static is not None else "dynamic",
        claiming=setup.executor.claiming_mode,
        per_rank=per_rank,
        world_size=setup.executor.world_size,
        seconds=seconds,
        context_parallel_jobs=sum(r.stats.prompts for r in records if r.engine == GROUP_ENGINE),
    )
