"""``generate_until`` requests as jobs: a key per request (greedy requests with equal arguments are one job; a
sampled one adds lm-eval's ``(task, doc_id, idx)`` and its repeat index), prompt tokens with lm-eval ``hf``'s
special-token rule, normalized arguments and stop strings (:class:`Prepared`), this rank's job records
(:func:`local_jobs`), and a sampled job's seed from lm-eval's torch seed and its key alone (never its rank or lane).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs

from distperp_harness.errors import InputError
from distperp_harness.planning.encoding import encode_many
from distperp_harness.planning.records import FlatUnits
from distperp_harness.run.generation.jobs import JOB, LocalJobs, group_hash, key_words, kwargs_key_of
from distperp_harness.run.generation.setup import GenerationSetup


@dataclass(frozen=True)
class Job:
    """One distinct generation: prompt tokens and normalized arguments; ``seed`` is ``None`` for greedy jobs."""

    key: str
    tokens: tuple[int, ...]
    kwargs_key: str
    gen_kwargs: dict
    seed: int | None = None


@dataclass(frozen=True)
class Prepared:
    """A job ready to decode: prompt cut to ``max_length - max_new``, stop strings, normalized arguments."""

    prompt: tuple[int, ...]
    max_new: int
    until: tuple[str, ...]
    kwargs: dict


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, default=str).encode()).hexdigest()


def job_keys(args: Sequence[tuple[str, dict]], identities: Sequence[Any] | None) -> list[tuple[str, str, bool]]:
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


def _special(setup: GenerationSetup, context: str) -> dict:
    """The special-token rule of lm-eval ``hf``'s ``tok_batch_encode`` for one prompt."""
    if has_bos_prefix(context, getattr(setup.tokenizer, "bos_token", None)):
        return {"add_special_tokens": False}
    if setup.add_bos_token is not None:
        return {"add_special_tokens": setup.add_bos_token}
    return {}


def encode_prompts(setup: GenerationSetup, contexts: Sequence[str]) -> dict[str, list[int]]:
    """Each distinct context's prompt tokens (``tokenizer.encode`` with :func:`_special`'s rule), in batches (one
    per special-token rule)."""
    groups: dict[tuple, dict[str, None]] = {}
    for context in contexts:
        groups.setdefault(tuple(sorted(_special(setup, context).items())), {})[context] = None
    out: dict[str, list[int]] = {}
    for special, strings in groups.items():
        out.update(zip(strings, encode_many(setup.tokenizer, list(strings), **dict(special))))
    return out


def local_jobs(
    setup: GenerationSetup, keys: Sequence[tuple[str, str, bool]], args: Sequence[tuple[str, dict]]
) -> LocalJobs:
    """Tokenize this rank's own prompts (each distinct job once) and make its records."""
    seen: dict[str, tuple] = {}
    prompts: dict[tuple[int, ...], None] = {}
    kwargs: dict[int, dict] = {}
    encoded = encode_prompts(setup, [context for context, _ in args])
    for (key, kwargs_key, sampled), (context, gen_kwargs) in zip(keys, args):
        if key in seen:
            continue
        prepared = prepare(setup, Job(key, tuple(encoded[context]), kwargs_key, gen_kwargs))
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


def seed_of(seed: int, key: str) -> int:
    """A sampled job's seed: lm-eval's torch seed (rank 0's) and the job's key."""
    return int(_sha([seed, key])[:15], 16)


def prepare(setup: GenerationSetup, job: Job) -> Prepared:
    """``job`` ready to decode: arguments normalized with the run's ``max_gen_toks``, stop strings (with the EOS
    token's text), and the prompt cut to its last ``max_length - max_new`` tokens."""
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
    return Prepared(job.tokens[-max_ctx:], max_new, tuple(until), kwargs)
