"""One lane's texts: the engine :func:`~.engines.choose_engine` picks decodes the lane's prepared jobs — continuous
batching (:func:`~.loop.decode_lane`, over the compiled step where it serves) or ``model.generate`` batches
(:mod:`.batchgen`) — under a forked RNG, so the caller's RNG never moves and the same lane gives the same bits on any
rank; and the lane's resume key (:func:`lane_key`): everything that determines its texts besides the run's
configuration."""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from typing import Callable, ContextManager, Sequence

import torch

from distperp_harness.errors import InputError
from distperp_harness.run.generation.engine.batchgen import BatchArgs, generate_batch
from distperp_harness.run.generation.engine.engines import Engine, choose_engine, note_fallback
from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.prefill import PrefixCache
from distperp_harness.run.generation.engine.sampling import warpers_for
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule, eos_ids
from distperp_harness.run.generation.engine.stats import LaneRecord, LaneStats
from distperp_harness.run.generation.engine.thinking import answer, stop_in_answer
from distperp_harness.run.generation.lanes import LanePlan, common_prefix, lane_prefix
from distperp_harness.run.generation.prompts import Job, Prepared
from distperp_harness.run.generation.setup import GenerationSetup


def lane_key(part: Sequence[tuple[Job, Prepared]], lane: LanePlan) -> bytes:
    """What determines a lane's texts besides the run's configuration: its jobs (keys, prompt tokens, seeds) and
    its layout (slots, shared prefix, each job's own prefix)."""
    layout = [lane.slots, lane.shared, lane.donor, lane.max_new, *([list(lane.prefixes)] if lane.prefixes else [])]
    digest = hashlib.sha256(json.dumps(layout).encode())
    for job, prepared in part:
        digest.update(json.dumps([job.key, job.seed, list(prepared.until)]).encode())
        digest.update(bytes(memoryview(array("q", prepared.prompt))))
    return digest.digest()


def run_lane(
    setup: GenerationSetup,
    part: Sequence[tuple[Job, Prepared]],
    indexed: tuple[int, LanePlan],
    prefixes: PrefixCache,
    bar,
    around: Callable[[], ContextManager],
) -> tuple[list[str], LaneRecord]:
    """Texts of the lane ``indexed`` (its index in the plan, the lane), in lane order, and its record, from the
    engine :func:`~.engines.choose_engine` picks (same lane, same bits on any rank either way)."""
    index, lane = indexed
    engine, reason = choose_engine(setup.model, dict(part[0][1].kwargs))
    with callers_rng_kept(setup.device):
        if engine is Engine.GENERATE:
            texts, stats = _generate_batches(setup, part, lane, reason or "", bar)
        else:
            texts, stats = _decode_slots(setup, part, lane, prefixes, bar, around)
    return texts, LaneRecord(index, engine.value, lane.slots, stats)


def callers_rng_kept(device: torch.device) -> ContextManager:
    """A block that leaves the caller's random state (CPU, and ``device``'s if CUDA) as it found it: a lane's
    sampling draws from its jobs' own generators, and nothing else may move lm-eval's."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def stop_rule(setup: GenerationSetup, prepared: Prepared) -> StopRule:
    """When a row of this job's arguments ends: its ``until`` strings (only in the answer, after a thinking trace,
    with ``think_end_token``), the tokenizer's and the model's EOS ids, its ``max_new`` tokens."""
    allowed = (
        None
        if setup.think_end is None
        else functools.partial(stop_in_answer, setup.tokenizer, setup.think_end, prepared.until)
    )
    return StopRule.of(
        setup.tokenizer, prepared.until, eos_ids(setup.tokenizer, setup.model), prepared.max_new, allowed=allowed
    )


def _seeds(part: Sequence[tuple[Job, Prepared]]) -> list[int]:
    """The seeds of a sampled lane's jobs (every job of a lane has the same arguments, so each is sampled)."""
    seeds = [job.seed for job, _ in part if job.seed is not None]
    if len(seeds) != len(part):
        raise ValueError("internal error: a sampled lane holds a job without a seed")
    return seeds


def _decode_slots(
    setup: GenerationSetup,
    part: Sequence[tuple[Job, Prepared]],
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
    rule = stop_rule(setup, first)
    on_done = (lambda _i, tokens: bar(1, len(tokens))) if bar is not None else None
    # rows attending alone continue each its own planned prefix (whatever the lane); else one prefix per lane
    shared, donor = (0, 0) if setup.rows_alone else lane_prefix(prompts, setup.min_shared_tokens)
    seeds = _seeds(part) if sampled else None
    decoder = Decoder(setup.model, setup.tokenizer, setup.device, prefixes, around, setup.static, setup.rows_alone)
    own = lane.prefixes if setup.rows_alone else ()
    tokens, stats = decode_lane(
        decoder,
        Lane(prompts, tuple(prompts[donor][:shared]), lane.slots, seeds, own),
        rule,
        warpers=warpers,
        on_done=on_done,
    )
    return [answer(setup.tokenizer, t, setup.think_end, first.until) for t in tokens], stats


def _generate_batches(
    setup: GenerationSetup, part: Sequence[tuple[Job, Prepared]], lane: LanePlan, reason: str, bar
) -> tuple[list[str], LaneStats]:
    """The lane as ``model.generate`` batches of ``lane.slots`` rows (:mod:`.batchgen`); of one row where rows must
    attend alone (``setup.rows_alone``: ``model.generate``'s batches do not)."""
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
    step = 1 if setup.rows_alone else lane.slots
    for b in range(0, len(prompts), step):
        chunk = slice(b, b + step)
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
