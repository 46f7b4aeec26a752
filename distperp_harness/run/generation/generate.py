"""``generate_until`` under the global plan: lanes of continuously batched slots, claimed, resumable.

Every rank tokenizes its own prompts and learns the global job list from every rank's records (greedy requests with
equal arguments are one job). Jobs are ordered canonically and cut into lanes by a rule that ignores the world size
(:mod:`.lanes`); whole lanes go to ranks by cost (prompt plus ``max_gen_toks`` tokens per job) and are claimed like
scoring batches (:mod:`distperp_harness.run.execution.claims`: a slow rank generates fewer). A lane is decoded by the
engine :func:`~.engines.choose_engine` picks: continuous batching (:mod:`.loop`: each row stops on its own and its slot
is refilled at once), or ``model.generate`` batches (:mod:`.batchgen`) for arguments slots do not serve. The lane's
schedule depends only on its jobs, so texts are identical for every world size and whichever rank computes a lane.
Finished lanes are saved to ``resume_dir`` and reused by a rerun on any world size. Ranks plan from records, never
prompt tokens (:mod:`.jobs`: 48 bytes per job and a hash per 16-token prefix block); a prompt's tokens travel only to
the ranks that may compute one of its lanes (owner and helper), and each text goes back only to the ranks whose requests
asked for it (an all-to-all).

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
import hashlib
import json
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import numpy as np
import torch
from accelerate.logging import get_logger
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs

from distperp_harness.distributed.protocol import Collective
from distperp_harness.errors import InputError
from distperp_harness.planning.records import FlatUnits
from distperp_harness.planning.rows import MIN_SHARED_PREFIX
from distperp_harness.run.execution.calls import GenerationCall, RankShare
from distperp_harness.run.execution.executor import Executor
from distperp_harness.run.generation.batchgen import BatchArgs, generate_batch
from distperp_harness.run.generation.engines import Engine, choose_engine, note_fallback
from distperp_harness.run.generation.jobs import (
    JOB,
    LocalJobs,
    group_hash,
    key_hex,
    key_words,
    kwargs_key_of,
    plan_generation,
)
from distperp_harness.run.generation.lanes import LanePlan, common_prefix, lane_prefix
from distperp_harness.run.generation.loop import Decoder, decode_lane
from distperp_harness.run.generation.prefill import PrefixCache
from distperp_harness.run.generation.sampling import warpers_for
from distperp_harness.run.generation.scheduler import Lane, StopRule, eos_ids
from distperp_harness.run.generation.stats import LaneRecord, LaneStats
from distperp_harness.run.generation.step import CompiledStep
from distperp_harness.run.generation.thinking import answer, stop_in_answer

if TYPE_CHECKING:
    from distperp_harness.run.generation.batchgen import CausalLM

log = get_logger(__name__)

MIN_SHARED_TOKENS = MIN_SHARED_PREFIX
"""Shortest common prefix a lane starts from a shared KV cache (the rule scoring's batches follow too): the saved
prefill is ``(rows - 1) * prefix`` tokens against one extra forward call."""

NO_SHARING = 1 << 62
"""``min_shared_tokens`` that turns prefix sharing off (``share_prefix=false``)."""


@dataclass(frozen=True)
class GenerationSetup:
    """What generation needs from the loaded run (the lm face builds it; nothing here reads the LM object).

    ``rows_for(length)`` is the number of slots a lane may hold when each row grows to ``length`` tokens
    (:func:`distperp_harness.run.runtime.generation_rows`: the batching rule, capped by KV-cache bytes).
    ``max_gen_toks``: the default for requests that set none (each request's own limit sizes its lane).
    ``seed``: lm-eval's torch seed (``None``: ``torch.initial_seed()`` at the call); rank 0's is used by all.
    ``min_shared_tokens``: see :data:`MIN_SHARED_TOKENS` (a huge value turns sharing off).
    ``executor``: runs the lanes this rank takes (:class:`~distperp_harness.run.execution.executor.Executor`: claims,
    ``resume_dir`` (finished lanes saved and reused), the failure channel, and with sharded weights the shard
    group's steps: every member one forward per step, its own or an idle one once it has no lane left).
    ``progress(total_prompts)``: returns ``update(prompts, new_tokens)`` (rank 0's bar), or ``None``.
    ``think_end``: the ``think_end_token`` (a string or a token id; :mod:`.thinking`): the answer is the text after
    the trace, and a stop string ends a row only in the answer part.
    ``static``: with ``compile`` on, the compiled decode step (:class:`~.step.CompiledStep`): ``prepare(collective,
    lanes)`` after planning; lanes its graphs cover decode over it.
    """

    model: CausalLM
    tokenizer: Any
    executor: Executor
    device: torch.device
    max_length: int
    max_gen_toks: int
    add_bos_token: bool | None
    rows_for: Callable[[int], int]
    seed: int | None = None
    min_shared_tokens: int = MIN_SHARED_TOKENS
    progress: Callable[[int], Callable[[int, int], None]] | None = None
    think_end: str | int | None = None
    static: CompiledStep | None = None


@dataclass(frozen=True)
class Job:
    """One distinct generation: prompt tokens and normalized arguments; ``seed`` is ``None`` for greedy jobs."""

    key: str
    tokens: tuple[int, ...]
    kwargs_key: str
    gen_kwargs: dict
    seed: int | None = None


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, default=str).encode()).hexdigest()


def _job_keys(args: Sequence[tuple[str, dict]], identities: Sequence[Any] | None) -> list[tuple[str, str, bool]]:
    """``(key, kwargs_key, sampled)`` per request. Greedy requests with equal arguments share a key (computed once);
    a sampled one's key adds its identity (lm-eval's ``(task, doc_id, idx)``) and its repeat index: how many earlier
    requests of this call had the same identity and arguments (lm-eval repeats an Instance ``repeats`` times)."""
    identities = list(identities) if identities is not None else [None] * len(args)
    if len(identities) != len(args):
        raise ValueError(f"identities has {len(identities)} entries for {len(args)} requests; pass one per request")
    seen: Counter = Counter()
    out = []
    for (context, gen_kwargs), identity in zip(args, identities):
        kwargs_key = kwargs_key_of(gen_kwargs)
        sampled = bool(normalize_gen_kwargs(gen_kwargs).get("do_sample"))
        ident: list = [context, kwargs_key]
        if sampled:
            origin = _sha([context, kwargs_key, identity])
            ident += [identity, seen[origin]]
            seen[origin] += 1
        out.append((_sha(ident)[:32], kwargs_key, sampled))
    return out


def _encode(setup: GenerationSetup, context: str) -> list[int]:
    """Prompt tokens with the special-token rule of lm-eval ``hf``'s ``tok_batch_encode``."""
    tokenizer = setup.tokenizer
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        return tokenizer.encode(context, add_special_tokens=False)
    if setup.add_bos_token is not None:
        return tokenizer.encode(context, add_special_tokens=setup.add_bos_token)
    return tokenizer.encode(context)


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
    local_keys = _job_keys(args, identities)
    mine = _local_jobs(setup, local_keys, args)
    seed = setup.seed if setup.seed is not None else torch.initial_seed()
    planned = plan_generation(
        collective, mine, seed, setup.rows_for, setup.min_shared_tokens, executor.step, executor.workers
    )
    table, lanes, plan, seed = planned.table, planned.lanes, planned.plan, planned.seed
    if setup.static is not None:  # compile the decode step for the plan's buckets, every rank together
        setup.static.prepare(collective, lanes)
    jobs, me = table.jobs, collective.rank

    def lane_jobs(lane: LanePlan) -> list[tuple[Job, _Prepared]]:
        part = []
        for j in range(lane.start, lane.stop):
            record, group = jobs[j], int(jobs["group"][j])
            key, kw = key_hex(record["key"]), planned.kwargs_of[group]
            job = Job(
                key,
                planned.available.sequence(int(table.prompt_id[j])),
                kwargs_key_of(kw),
                kw,
                _seed_of(seed, key) if record["sampled"] else None,
            )
            part.append((job, _prepare(setup, job)))
        return part

    prefix = f"distperp/lanes/{collective.sequence}"
    claims = executor.claims(plan.batches_of, prefix)
    bar = setup.progress(sum(lanes[i].jobs for i in plan.batches_of(executor.worker))) if setup.progress else None
    texts, holders, stats, prefixes = {}, {}, [], PrefixCache()
    with executor.decoding(prefix) as around:
        for i in executor.walk(claims, prefix):
            lane = lanes[i]
            part = lane_jobs(lane)
            key = _lane_key(part, lane) if executor.store is not None else None
            saved, lane_record = executor.lane(
                key,
                lane.jobs,
                f"generating (lane {i}, {lane.jobs} prompts)",
                functools.partial(_run_lane, setup, part, (i, lane), prefixes, bar, around),
            )
            if not executor.reports:
                continue  # a tensor-parallel member: its leader reports the same texts
            if lane_record is not None:
                stats.append(lane_record)
            elif bar is not None:
                bar(lane.jobs, 0)
            texts.update({job.key: text for (job, _), text in zip(part, saved)})
            holders.update(table.holders_of(range(lane.start, lane.stop)))
    share = RankShare(me, len(stats), claims.taken_from_ward, round(time.perf_counter() - start_time, 4))
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
    if calls is not None:
        calls.append(record)
    return [all_texts[key] for key, _, _ in local_keys]


def _local_jobs(
    setup: GenerationSetup, keys: Sequence[tuple[str, str, bool]], args: Sequence[tuple[str, dict]]
) -> LocalJobs:
    """Tokenize this rank's own prompts (each distinct job once) and make its records."""
    seen: dict[str, tuple] = {}
    prompts: dict[tuple[int, ...], None] = {}
    kwargs: dict[int, dict] = {}
    for (key, kwargs_key, sampled), (context, gen_kwargs) in zip(keys, args):
        if key in seen:
            continue
        prepared = _prepare(setup, Job(key, tuple(_encode(setup, context)), kwargs_key, gen_kwargs))
        if not prepared.prompt:
            raise InputError(
                f"generate_until got a request whose prompt has no tokens (context {context!r}); "
                "the model needs at least one token to continue. Fix: give the task a non-empty "
                "prompt, or set add_bos_token=true so that every prompt starts with the BOS token"
            )
        group = group_hash(kwargs_key)
        kwargs.setdefault(group, gen_kwargs)
        prompts.setdefault(prepared.prompt)
        seen[key] = (prepared.prompt, group, prepared.max_new, sampled)
    flat = FlatUnits.of_sequences(list(prompts), [0] * len(prompts))
    prompt_keys = dict(zip(prompts, flat.keys()))
    records = np.zeros(len(seen), dtype=JOB)
    for i, (key, (prompt, group, max_new, sampled)) in enumerate(seen.items()):
        records[i] = (key_words(key), prompt_keys[prompt], group, max_new, int(sampled))
    return LocalJobs(records, flat, kwargs)


def _seed_of(seed: int, key: str) -> int:
    """A sampled job's seed: lm-eval's torch seed (rank 0's) and the job's key."""
    return int(_sha([seed, key])[:15], 16)


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


@dataclass(frozen=True)
class _Prepared:
    """A job ready to decode: prompt cut to ``max_length - max_new``, stop strings, normalized arguments."""

    prompt: tuple[int, ...]
    max_new: int
    until: tuple[str, ...]
    kwargs: dict


def _prepare(setup: GenerationSetup, job: Job) -> _Prepared:
    kwargs: dict[str, Any] = normalize_gen_kwargs(job.gen_kwargs, setup.max_gen_toks)
    eot = setup.tokenizer.eos_token_id
    eos = setup.tokenizer.decode([eot], skip_special_tokens=False) if eot is not None else None
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_new = int(kwargs.pop("max_gen_toks"))
    max_ctx = setup.max_length - max_new
    if max_ctx <= 0:
        raise InputError(
            f"max_gen_toks={max_new} leaves no room for a prompt with max_length={setup.max_length}; "
            "raise max_length or lower max_gen_toks in the task's generation_kwargs"
        )
    return _Prepared(job.tokens[-max_ctx:], max_new, tuple(until), kwargs)


def _lane_key(part: Sequence[tuple[Job, _Prepared]], lane: LanePlan) -> bytes:
    """What determines a lane's texts besides the run's configuration: its jobs (keys, prompt tokens, seeds) and
    its layout (slots, shared prefix)."""
    digest = hashlib.sha256(json.dumps([lane.slots, lane.shared, lane.donor, lane.max_new]).encode())
    for job, prepared in part:
        digest.update(json.dumps([job.key, job.seed, list(prepared.until)]).encode())
        digest.update(bytes(memoryview(array("q", prepared.prompt))))
    return digest.digest()


def _run_lane(
    setup: GenerationSetup,
    part: Sequence[tuple[Job, _Prepared]],
    indexed: tuple[int, LanePlan],
    prefixes: PrefixCache,
    bar,
    around: Callable[[], ContextManager],
) -> tuple[list[str], LaneRecord]:
    """Texts of the lane ``indexed`` (its index in the plan, the lane), in lane order, and its record, from the
    engine :func:`~.engines.choose_engine` picks (same lane, same bits on any rank either way)."""
    index, lane = indexed
    engine, reason = choose_engine(setup.model, dict(part[0][1].kwargs))
    forked = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):  # nothing below may move the caller's RNG
        if engine is Engine.GENERATE:
            texts, stats = _generate_batches(setup, part, lane, reason or "", bar)
        else:
            texts, stats = _decode_slots(setup, part, lane, prefixes, bar, around)
    return texts, LaneRecord(index, engine.value, lane.slots, stats)


def _seeds(part: Sequence[tuple[Job, _Prepared]]) -> list[int]:
    """The seeds of a sampled lane's jobs (every job of a lane has the same arguments, so each is sampled)."""
    seeds = [job.seed for job, _ in part if job.seed is not None]
    if len(seeds) != len(part):
        raise ValueError("internal error: a sampled lane holds a job without a seed")
    return seeds


def _decode_slots(
    setup: GenerationSetup,
    part: Sequence[tuple[Job, _Prepared]],
    lane: LanePlan,
    prefixes: PrefixCache,
    bar,
    around: Callable[[], ContextManager],
) -> tuple[list[str], LaneStats]:
    """Continuous batching of the lane (:func:`~.loop.decode_lane`), over the compiled step where it serves."""
    first = part[0][1]
    sampled = bool(first.kwargs.get("do_sample"))
    prompts = [p.prompt for _, p in part]
    warpers = warpers_for(setup.model, dict(first.kwargs)) if sampled else None
    allowed = (
        None
        if setup.think_end is None
        else functools.partial(stop_in_answer, setup.tokenizer, setup.think_end, first.until)
    )
    rule = StopRule.of(
        setup.tokenizer, first.until, eos_ids(setup.tokenizer, setup.model), first.max_new, allowed=allowed
    )
    on_done = (lambda _i, tokens: bar(1, len(tokens))) if bar is not None else None
    shared, donor = lane_prefix(prompts, setup.min_shared_tokens)  # exact, from the tokens
    seeds = _seeds(part) if sampled else None
    decoder = Decoder(setup.model, setup.tokenizer, setup.device, prefixes, around, setup.static)
    tokens, stats = decode_lane(
        decoder,
        Lane(prompts, tuple(prompts[donor][:shared]), lane.slots, seeds),
        rule,
        warpers=warpers,
        on_done=on_done,
    )
    return [answer(setup.tokenizer, t, setup.think_end, first.until) for t in tokens], stats


def _generate_batches(
    setup: GenerationSetup, part: Sequence[tuple[Job, _Prepared]], lane: LanePlan, reason: str, bar
) -> tuple[list[str], LaneStats]:
    """The lane as ``model.generate`` batches of ``lane.slots`` rows (:mod:`.batchgen`)."""
    if setup.executor.shard_size > 1:
        raise InputError(
            f"generate_until with shard_size={setup.executor.shard_size}: {reason}, so this lane "
            "would run as model.generate batches, whose forwards a shard group cannot keep in step. "
            "Fix: drop those generation arguments, or run this task with shard_size=1."
        )
    note_fallback(reason)
    first = part[0][1]
    prompts = [p.prompt for _, p in part]
    seeds = _seeds(part) if first.kwargs.get("do_sample") else None
    texts, total = [], LaneStats()
    args = BatchArgs(dict(first.kwargs), list(first.until), first.max_new, setup.think_end)
    for b in range(0, len(prompts), lane.slots):
        chunk = slice(b, b + lane.slots)
        out, batch_stats = generate_batch(
            setup.model,
            setup.tokenizer,
            setup.device,
            prompts[chunk],
            common_prefix(prompts[chunk], setup.min_shared_tokens),
            args,
            seeds[chunk] if seeds else None,
        )
        texts += out
        total.add(batch_stats)
        if bar is not None:
            bar(len(out), batch_stats.generated)
    return texts, total


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
        claiming=setup.executor.claiming_mode,
        per_rank=per_rank,
        world_size=setup.executor.world_size,
        seconds=seconds,
    )
