"""``generate_until`` under the global plan: greedy or sampled generations, cut at stop sequences.

Like scoring, generation first learns the global request list, deduplicates greedy requests, groups them by
generation arguments, sorts by prompt length and packs batches by a rule that ignores the world size; whole
batches go to ranks by cost. A batch's layout is therefore the same on any number of processes, so greedy
generations are identical for every world size.

**Shared prefix.** When a batch's prompts share at least ``min_shared_tokens`` leading tokens (few-shot prompts with
fixed examples: lm-eval's ``first_n`` sampler), the shared prefix is computed once (batch 1), its KV cache is repeated
to the batch's rows, and every row continues from it. Rows are laid out ``[prefix][pad...][own suffix]`` with zeros in
the attention mask on the pads; ``generate`` derives position ids from the mask's cumulative sum, so each suffix
continues its prefix's positions exactly as a left-padded row would. The decision reads only the batch's tokens.

**Sampling.** A sampled request draws from its own ``torch.Generator`` seeded from lm-eval's torch seed (``--seed``,
third value; read as ``torch.initial_seed()``) and the request's content: prompt, generation arguments, lm-eval's
``(task, doc_id, idx)`` and its repeat index. Never its rank, batch or position: a sample is the same on any world
size and batch size (up to a draw that lands within float rounding of a boundary, since padding moves logits by
~1e-7), changes with ``--seed``, and the global RNG is left as it was.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from accelerate.logging import get_logger
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, \
    postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList

from distperp_harness.distributed.collective import Collective
from distperp_harness.model.memory import peak_memory_bytes
from distperp_harness.run.kvcache import CacheNotShareable, cache_argument, prefix_cache
from distperp_harness.planning.plan import Batch, assign_batches
from distperp_harness.planning.rows import MIN_SHARED_PREFIX, common_prefix_length
from distperp_harness.run.thinking import answer_of, stop_hit, tokens_after_think

log = get_logger(__name__)

MIN_SHARED_TOKENS = MIN_SHARED_PREFIX
"""Shortest common prefix a batch starts from a shared KV cache (the rule scoring's batches follow too): the saved
prefill is ``(rows - 1) * prefix`` tokens against one extra forward call."""

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""Generation arguments applied by the distribution warpers (transformers' sampling-only logits processors)."""


@dataclass(frozen=True)
class GenerationSetup:
    """What generation needs from the loaded run (the lm face builds it; nothing here reads the LM object).

    ``rows_for(length)`` is the number of rows a batch may hold when each row grows to ``length`` tokens
    (:func:`distperp_harness.run.runtime.generation_rows`: the batching rule, capped by KV-cache bytes).
    ``seed``: lm-eval's torch seed (``None``: ``torch.initial_seed()`` at the call); rank 0's is used by all.
    ``min_shared_tokens``: see :data:`MIN_SHARED_TOKENS` (a huge value turns sharing off). ``think_end``: the
    ``think_end_token`` (:mod:`distperp_harness.run.thinking`: the answer after the trace; stops only after it).
    """

    model: torch.nn.Module
    tokenizer: Any
    collective: Collective
    device: torch.device
    max_length: int
    max_gen_toks: int
    add_bos_token: bool | None
    rows_for: Callable[[int], int]
    seed: int | None = None
    min_shared_tokens: int = MIN_SHARED_TOKENS
    think_end: str | int | None = None


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
        kwargs_key = json.dumps(gen_kwargs, sort_keys=True, default=str)
        sampled = bool(normalize_gen_kwargs(gen_kwargs).get("do_sample"))
        ident: list = [context, kwargs_key]
        if sampled:
            origin = _sha([context, kwargs_key, identity])
            ident += [identity, seen[origin]]
            seen[origin] += 1
        out.append((_sha(ident), kwargs_key, sampled))
    return out


def _encode(setup: GenerationSetup, context: str) -> list[int]:
    """Prompt tokens with the special-token rule of lm-eval ``hf``'s ``tok_batch_encode``."""
    tokenizer = setup.tokenizer
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        return tokenizer.encode(context, add_special_tokens=False)
    if setup.add_bos_token is not None:
        return tokenizer.encode(context, add_special_tokens=setup.add_bos_token)
    return tokenizer.encode(context)


def generate(setup: GenerationSetup, args: Sequence[tuple[str, dict]], identities: Sequence[Any] | None = None,
             calls: list | None = None) -> list[str]:
    """Generated continuations for this rank's ``(context, gen_kwargs)`` requests, in order; every rank calls
    this together.

    ``identities``: one JSON-able identity per request (the lm face passes lm-eval's ``(task, doc_id, idx)``); it
    seeds sampled requests, so two documents with equal prompts sample independently. ``calls``: when given, one
    record of this call is appended (jobs, batches, shared prefixes, prompt tokens computed, seed).
    """
    start_time = time.perf_counter()
    collective = setup.collective
    local_keys = _job_keys(args, identities)
    seed = setup.seed if setup.seed is not None else torch.initial_seed()
    everyone = collective.all_gather_object(
        (seed, [(key, kwargs_key, sampled, ctx, kw)
                for (key, kwargs_key, sampled), (ctx, kw) in zip(local_keys, args)]),
        "gather prompts")
    seed = everyone[0][0]  # rank 0's, so every rank seeds alike
    jobs: dict[str, Job] = {}
    for _, part in everyone:
        for key, kwargs_key, sampled, ctx, kw in part:
            if key not in jobs:
                job_seed = int(_sha([seed, key])[:15], 16) if sampled else None
                jobs[key] = Job(key, tuple(_encode(setup, ctx)), kwargs_key, kw, job_seed)
    ordered = sorted(jobs.values(), key=lambda j: (j.kwargs_key, -len(j.tokens), j.tokens, j.key))
    batches = _batches(ordered, setup.rows_for, setup.max_gen_toks)
    plan = assign_batches(batches, collective.world_size)
    mine, stats = {}, []
    for b in plan.batches_of(collective.rank):
        batch = batches[b]
        texts, batch_stats = _generate_batch(setup, ordered[batch.start: batch.stop])
        mine.update(texts)
        stats.append(batch_stats)
    texts: dict[str, str] = {}
    all_stats, peaks = [], []
    for part, part_stats, peak in collective.all_gather_object((mine, stats, peak_memory_bytes(setup.device)),
                                                               "gather generations"):
        texts.update(part)
        all_stats += part_stats
        peaks.append(peak)
    record = _record(all_stats, peaks, requests=sum(len(part) for _, part in everyone), jobs=ordered, seed=seed,
                     min_shared_tokens=setup.min_shared_tokens, world_size=collective.world_size,
                     seconds=time.perf_counter() - start_time)
    log.info(f"generate_until: {record['requests']} requests, {record['jobs']} generations "
             f"({record['sampled_jobs']} sampled{f', seed {seed}' if record['sampled_jobs'] else ''}) in "
             f"{record['generation_batches']} batches; "
             f"{record['shared_batches']} started from a shared prefix (>= {setup.min_shared_tokens} tokens); "
             f"prompt tokens computed {record['computed_prompt_tokens']} of {record['prompt_tokens']} "
             f"({record['computed_prompt_tokens_per_job']:.0f} per generation) in {record['seconds']:.1f} s",
             main_process_only=True)
    if calls is not None:
        calls.append(record)
    return [texts[key] for key, _, _ in local_keys]


def _record(stats: list[dict], peaks: list[int], *, requests: int, jobs: Sequence[Job], seed: int,
            min_shared_tokens: int, world_size: int, seconds: float) -> dict:
    """The call's record for ``config.distperp.calls`` (``seconds``, not ``total_seconds``: compare.py divides the
    scoring calls' scored tokens by their total_seconds; ``generation_batches``, not ``batches``: resume counts
    those). Computed prompt tokens count every position run through the model, pads included."""
    shared = sorted(s["shared_tokens"] for s in stats if s["shared_tokens"])
    computed = sum(s["computed_prompt_tokens"] for s in stats)
    return {"kind": "generate_until", "requests": requests, "jobs": len(jobs),
            "sampled_jobs": sum(j.seed is not None for j in jobs), "seed": seed, "generation_batches": len(stats),
            "shared_batches": len(shared), "min_shared_tokens": min_shared_tokens,
            "shared_tokens_min_max": [shared[0], shared[-1]] if shared else None,
            "prompt_tokens": sum(s["prompt_tokens"] for s in stats), "computed_prompt_tokens": computed,
            "computed_prompt_tokens_per_job": computed / max(1, len(jobs)), "world_size": world_size,
            "seconds": seconds, "peak_memory_bytes_per_rank": peaks}


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


def shared_prefix_length(prompts: Sequence[Sequence[int]], min_tokens: int) -> int:
    """Tokens a batch computes once: the prompts' longest common prefix, leaving every prompt at least one token
    of its own (the last prompt token predicts the first generated one); 0 when that is under ``min_tokens`` or
    the batch has one row. A pure function of the batch's tokens."""
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    n = min([limit] + [common_prefix_length(prompts[0], p) for p in prompts[1:]])
    return n if n >= max(1, min_tokens) else 0


def _prefix_cache(model: torch.nn.Module, prefix: torch.Tensor, rows: int):
    """The KV cache of ``prefix`` (shape ``[1, P]``), repeated to ``rows`` rows; ``None`` (logged once) when the
    model's cache cannot be repeated or restarted from (recurrent layers): the batch is then computed whole, which
    the ``[prefix][pad...][suffix]`` layout allows as it stands."""
    try:
        return prefix_cache(model, prefix, rows)
    except CacheNotShareable as exc:
        if not _UNSHAREABLE:
            _UNSHAREABLE.append(str(exc))
            log.info(f"generation: the model's {exc} cannot start rows from a shared prefix; batches are computed "
                     "whole", main_process_only=True)
        return None


_UNSHAREABLE: list[str] = []


@torch.no_grad()
def _generate_batch(setup: GenerationSetup, jobs: Sequence[Job]) -> tuple[dict[str, str], dict]:
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
    shared = shared_prefix_length(prompts, setup.min_shared_tokens)
    suffixes = [p[shared:] for p in prompts]
    suffix_width = max(len(s) for s in suffixes)
    width = shared + suffix_width
    pad = tokenizer.pad_token_id
    # [prefix][pad...][own suffix]; with no shared prefix this is plain left padding.
    ids = torch.tensor([prompts[0][:shared] + [pad] * (suffix_width - len(s)) + s for s in suffixes],
                       dtype=torch.long, device=setup.device)
    mask = torch.tensor([[1] * shared + [0] * (suffix_width - len(s)) + [1] * len(s) for s in suffixes],
                        dtype=torch.long, device=setup.device)
    if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
        kwargs.pop("temperature", None)
    extra: dict[str, Any] = {}
    if kwargs.get("do_sample"):
        extra["logits_processor"] = _seeded_sampler(setup.model, kwargs, [j.seed for j in jobs])
        kwargs["do_sample"] = False  # the sampler leaves one finite logit per row: the drawn token
    max_length = kwargs.pop("max_length", width + max_gen_toks)
    forked = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):  # nothing below may move the caller's RNG
        cache = _prefix_cache(setup.model, ids[:1, :shared], len(jobs)) if shared else None
        if cache is not None:
            extra[cache_argument(setup.model)] = cache
        out = setup.model.generate(
            input_ids=ids, attention_mask=mask, max_length=max_length, use_cache=True,
            stopping_criteria=(stop_sequences_criteria(tokenizer, until, width, len(jobs))
                               if setup.think_end is None else
                               StoppingCriteriaList([_ThinkingStops(tokenizer, until, width, setup.think_end)])),
            pad_token_id=pad, **kwargs, **extra)
    if setup.think_end is None:
        texts = {job.key: postprocess_generated_text(
            tokenizer.decode(row[width:].tolist(), skip_special_tokens=True), until, None)
            for job, row in zip(jobs, out)}
    else:
        texts = {job.key: _answer(tokenizer, row[width:].tolist(), setup.think_end, until)
                 for job, row in zip(jobs, out)}
    shared = shared if cache is not None else 0
    stats = {"rows": len(jobs), "shared_tokens": shared, "prompt_tokens": sum(len(p) for p in prompts),
             "computed_prompt_tokens": shared + len(jobs) * suffix_width if shared else len(jobs) * width}
    return texts, stats


def _answer(tokenizer, tokens: list[int], think_end: str | int, until: Sequence[str]) -> str:
    """The scored answer of one generation (lm-eval hf's rule for a token id or a string ``think_end``)."""
    if isinstance(think_end, int):
        return answer_of(tokenizer.decode(tokens_after_think(tokens, think_end), skip_special_tokens=True).lstrip(),
                         None, until)
    return answer_of(tokenizer.decode(tokens, skip_special_tokens=True), think_end, until)


class _ThinkingStops(StoppingCriteria):
    """Per row: done when a stop string occurs after the thinking trace (:func:`~distperp_harness.run.thinking.
    stop_hit`); a stop string inside an unfinished trace does not end the row."""

    def __init__(self, tokenizer, until: Sequence[str], width: int, think_end: str | int) -> None:
        self.tokenizer, self.until, self.width, self.think_end = tokenizer, list(until), width, think_end

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = []
        for row in input_ids[:, self.width:].tolist():
            if isinstance(self.think_end, int):
                finished = self.think_end in row
                text = self.tokenizer.decode(tokens_after_think(row, self.think_end), skip_special_tokens=True)
                done.append(finished and stop_hit(text, None, self.until))
            else:
                done.append(stop_hit(self.tokenizer.decode(row, skip_special_tokens=True), self.think_end,
                                     self.until))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _SeededDraw(LogitsProcessor):
    """The last logits processor of a sampled batch: applies the sampling warpers, then draws each row's token
    from its own generator and leaves only that token finite (so greedy selection takes it)."""

    def __init__(self, warpers, seeds: Sequence[int], device: torch.device) -> None:
        self.warpers = warpers
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if len(self.generators) != scores.shape[0]:
            raise ValueError(f"{scores.shape[0]} rows of scores for {len(self.generators)} seeded generators; "
                             "sampled generation takes one sequence per request (num_return_sequences=1)")
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1)
        picks = torch.stack([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        return torch.full_like(scores, float("-inf")).scatter_(1, picks, 0.0)


def _seeded_sampler(model: torch.nn.Module, kwargs: dict, seeds: Sequence[int]):
    """The logits processors of a sampled batch; removes the sampling arguments from ``kwargs``.

    The warpers are transformers' own, in ``generate``'s order (temperature, top-k, top-p, min-p, typical, epsilon,
    eta), from the model's ``generation_config`` updated with the request's arguments, as ``generate`` does.
    ``do_sample=true`` without a temperature samples at the model's ``generation_config`` temperature (1.0 when it
    sets none), as transformers does; lm-eval's ``hf`` passes 0.0 there and fails.
    """
    from transformers import LogitsProcessorList
    from transformers.generation import logits_process as lp

    if int(kwargs.get("num_beams", 1) or 1) > 1:
        raise ValueError(f"do_sample=True with num_beams={kwargs['num_beams']} (beam sampling) is not supported; "
                         "use num_beams=1 or do_sample=False in the task's generation_kwargs")
    config = copy.deepcopy(model.generation_config)
    asked = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
    if "temperature" not in asked:
        log.info(f"do_sample=true without a temperature: sampling at the model's generation_config temperature "
                 f"({config.temperature if config.temperature is not None else 1.0})", main_process_only=True)
    elif not float(asked["temperature"]) > 0:
        raise ValueError(f"do_sample=True with temperature={asked['temperature']}: sampling needs a temperature > 0; "
                         "set do_sample=False for greedy decoding or a positive temperature")
    config.update(**asked)
    warpers = LogitsProcessorList()
    if config.temperature is not None and float(config.temperature) != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(float(config.temperature)))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(lp.TopKLogitsWarper(top_k=int(config.top_k), min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=float(config.top_p), min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(lp.MinPLogitsWarper(min_p=float(config.min_p), min_tokens_to_keep=1))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(lp.TypicalLogitsWarper(mass=float(config.typical_p), min_tokens_to_keep=1))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(lp.EpsilonLogitsWarper(epsilon=float(config.epsilon_cutoff), min_tokens_to_keep=1))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(lp.EtaLogitsWarper(epsilon=float(config.eta_cutoff), min_tokens_to_keep=1,
                                          device=model.device))
    return LogitsProcessorList([_SeededDraw(warpers, seeds, model.device)])
