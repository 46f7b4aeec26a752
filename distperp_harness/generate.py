"""``generate_until`` under the global plan: greedy or sampled generations, cut at stop sequences.

Like scoring, generation first learns the global request list, deduplicates greedy requests, groups them by
generation arguments, sorts by prompt length and packs batches by a rule that ignores the world size; whole
batches go to ranks by cost. A batch's left padding is therefore the same on any number of processes, so
greedy generations are identical for every world size; sampling is seeded per batch from its content.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, \
    postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria

from distperp_harness.collective import Collective
from distperp_harness.plan import Batch, assign_batches


@dataclass(frozen=True)
class GenerationSetup:
    """What generation needs from the loaded run (the lm face builds it; nothing here reads the LM object).

    ``rows_for(length)`` is the number of rows a batch may hold when each row grows to ``length`` tokens
    (:func:`distperp_harness.runtime.generation_rows`: the batching rule, capped by KV-cache bytes).
    """

    model: torch.nn.Module
    tokenizer: Any
    collective: Collective
    device: torch.device
    max_length: int
    max_gen_toks: int
    add_bos_token: bool | None
    rows_for: Callable[[int], int]


@dataclass(frozen=True)
class Job:
    """One distinct generation: prompt tokens and normalized arguments."""

    key: str
    tokens: tuple[int, ...]
    kwargs_key: str
    gen_kwargs: dict


def _job_key(context: str, gen_kwargs: dict, origin: tuple[int, int]) -> tuple[str, str]:
    kwargs_key = json.dumps(gen_kwargs, sort_keys=True, default=str)
    sampled = bool(normalize_gen_kwargs(gen_kwargs).get("do_sample"))
    # Greedy requests with equal arguments are computed once; sampled ones (e.g. repeats) stay distinct.
    ident = [context, kwargs_key] + ([list(origin)] if sampled else [])
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest(), kwargs_key


def _encode(setup: GenerationSetup, context: str) -> list[int]:
    """Prompt tokens with the special-token rule of lm-eval ``hf``'s ``tok_batch_encode``."""
    tokenizer = setup.tokenizer
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        return tokenizer.encode(context, add_special_tokens=False)
    if setup.add_bos_token is not None:
        return tokenizer.encode(context, add_special_tokens=setup.add_bos_token)
    return tokenizer.encode(context)


def generate(setup: GenerationSetup, args: Sequence[tuple[str, dict]]) -> list[str]:
    """Generated continuations for this rank's ``(context, gen_kwargs)`` requests, in order; every rank calls
    this together."""
    collective = setup.collective
    local_keys = [_job_key(ctx, kw, (collective.rank, i)) for i, (ctx, kw) in enumerate(args)]
    everyone = collective.all_gather_object(
        [(key, kwargs_key, ctx, kw) for (key, kwargs_key), (ctx, kw) in zip(local_keys, args)], "gather prompts")
    jobs: dict[str, Job] = {}
    for part in everyone:
        for key, kwargs_key, ctx, kw in part:
            if key not in jobs:
                jobs[key] = Job(key, tuple(_encode(setup, ctx)), kwargs_key, kw)
    ordered = sorted(jobs.values(), key=lambda j: (j.kwargs_key, -len(j.tokens), j.tokens, j.key))
    batches = _batches(ordered, setup.rows_for, setup.max_gen_toks)
    plan = assign_batches(batches, collective.world_size)
    mine = {}
    for b in plan.batches_of(collective.rank):
        batch = batches[b]
        mine.update(_generate_batch(setup, ordered[batch.start: batch.stop]))
    texts: dict[str, str] = {}
    for part in collective.all_gather_object(mine, "gather generations"):
        texts.update(part)
    return [texts[key] for key, _ in local_keys]


def _batches(ordered: Sequence[Job], rows_for: Callable[[int], int], max_gen_toks: int) -> list[Batch]:
    """Consecutive jobs with equal generation arguments; ``rows_for(longest prompt + max_gen_toks)`` rows each
    (a token budget gives short prompts more rows)."""
    batches, start = [], 0
    while start < len(ordered):
        rows = rows_for(len(ordered[start].tokens) + max_gen_toks)
        stop = start + 1
        while stop < len(ordered) and stop - start < rows and ordered[stop].kwargs_key == ordered[start].kwargs_key:
            stop += 1
        batches.append(Batch(start, stop, len(ordered[start].tokens)))
        start = stop
    return batches


@torch.no_grad()
def _generate_batch(setup: GenerationSetup, jobs: Sequence[Job]) -> dict[str, str]:
    tokenizer = setup.tokenizer
    kwargs: dict[str, Any] = normalize_gen_kwargs(jobs[0].gen_kwargs, setup.max_gen_toks)
    eot = tokenizer.eos_token_id
    eos = tokenizer.decode([eot], skip_special_tokens=False) if eot is not None else None
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = kwargs.pop("max_gen_toks")
    max_ctx = setup.max_length - max_gen_toks
    if max_ctx <= 0:
        raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt with max_length="
                         f"{setup.max_length}; raise max_length or lower max_gen_toks in the task's generation_kwargs")
    prompts = [list(j.tokens[-max_ctx:]) for j in jobs]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=setup.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                        device=setup.device)
    if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
        kwargs.pop("temperature", None)
    if kwargs.get("do_sample"):
        torch.manual_seed(int(hashlib.sha256("".join(j.key for j in jobs).encode()).hexdigest()[:8], 16))
    max_length = kwargs.pop("max_length", width + max_gen_toks)
    out = setup.model.generate(
        input_ids=ids, attention_mask=mask, max_length=max_length, use_cache=True,
        stopping_criteria=stop_sequences_criteria(tokenizer, until, width, len(jobs)),
        pad_token_id=pad, **kwargs)
    return {job.key: postprocess_generated_text(tokenizer.decode(row[width:].tolist(), skip_special_tokens=True),
                                                until, None)
            for job, row in zip(jobs, out)}
