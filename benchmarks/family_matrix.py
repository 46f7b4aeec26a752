"""Every causal LM type transformers registers, through ``--model distperp``, against a float64 forward (issue 62).

    python -m benchmarks.family_matrix                         # every registered type: docs/families.md's table
    python -m benchmarks.family_matrix --types gpt2,phi3       # some (PUBLISHED names, or model types)
    python -m benchmarks.family_matrix --published             # the families at their published settings

For each type: a small random model (the type's default configuration through ``miniature_config``, in float32, its
length thresholds shortened so that the rows cross them; a :data:`PUBLISHED` family keeps its published settings), a
tokenizer trained on the packaged sample, and ``--model distperp`` in process at ``batch_size=auto`` (tree rows up to
the row budget, padded batches of mixed lengths, cached prefixes) over few-shot questions whose contexts fall on both
sides of every threshold, and rolling documents longer than ``max_length``. Every unit is compared with the same
weights in float64, computed alone, and with the model's own float32 unshared row:

* ``fast and exact``: packed rows, cached prefixes and padded batches allowed, every unit within rounding;
* ``fallback (reason)``: exact, with the path the probe refused and why;
* ``refused (reason)``: distperp refuses the model in one line;
* ``skipped (reason)``: no text model to build (it needs images or audio, or remote code);
* ``unchecked (reason)``: distperp ran, but transformers' own float64 forward of the type fails: no reference;
* ``WRONG`` (a unit further from float64 than its own unshared row by more than rounding) and ``CRASH``: failures.

Exits 1 on any WRONG or CRASH.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.common import use_offline_env
from distperp_harness.commands.families import PUBLISHED, published_config

MAX_LENGTH = 160
"""The matrix's ``max_length`` for a default configuration (fewer where the model has fewer positions)."""
SHORT = {"sliding_window": 24, "window_size": 24, "attention_chunk_size": 32, "floor_scale": 40}
"""Length thresholds of default configurations, shortened so that :data:`MAX_LENGTH`-token rows cross them."""
SHORT_ROPE = {"original_max_position_embeddings": 48}
"""Rotary thresholds (in the configuration and its rotary settings), shortened alike."""
RUN_LENGTH = {"gpt_neo": 320, "phi3": 4160, "llama-dynamic-64": 160}
"""``max_length`` of the PUBLISHED families whose thresholds lie past :data:`MAX_LENGTH` (rows cross them), or past
their ``max_position_embeddings`` (dynamic rope extends it): never cut to the model's positions."""
VOCAB = 512
"""Vocabulary of a registered type's model and tokenizer (a miniature's 128 ids hold no byte-level tokenizer)."""
ROUNDING = 2e-5
"""Slack per scored token (nats) beyond ten times a unit's own float32 rounding."""


@dataclass(frozen=True)
class Verdict:
    """One type's row: ``kind`` (``fast and exact``, ``fallback``, ``refused``, ``skipped``, ``WRONG``, ``CRASH``),
    why (or the path decisions), the largest distance from float64, seconds."""

    name: str
    kind: str
    why: str = ""
    distance: float = 0.0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind in ("WRONG", "CRASH")


def _shortened(config: Any) -> Any:
    """``config`` with its length thresholds at :data:`SHORT` (only where it has a longer one)."""
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    for key, value in {**SHORT, **SHORT_ROPE}.items():
        current = getattr(text, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            setattr(text, key, value)
    for params in _rope_dicts(text):
        for key, value in SHORT_ROPE.items():
            if isinstance(params.get(key), int) and params[key] > value:
                params[key] = value
    return config


def _rope_dicts(config: Any) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    return [v for v in params.values() if isinstance(v, dict)] or [params]


def build(name: str) -> tuple[Any, int] | str:
    """``(model, max_length)`` for a PUBLISHED family or a registered type, or why none can be built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.model.miniature import miniature_config

    if name in PUBLISHED:
        config, length = published_config(name), RUN_LENGTH.get(name, MAX_LENGTH)
    else:
        try:
            default = AutoConfig.for_model(name)
        except Exception as exc:  # transformers' own default configuration of the type does not validate
            return f"no default configuration ({type(exc).__name__}: {str(exc).splitlines()[-1].strip()[:160]})"
        small = miniature_config(default)
        if isinstance(small, str):
            return small
        config, length = _shortened(small), MAX_LENGTH
        for level in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
            for key in [k for k in level.to_dict() if "vocab_size" in k]:  # and Gemma's per-layer input table
                if isinstance(getattr(level, key), int) and getattr(level, key) < VOCAB:
                    setattr(level, key, VOCAB)  # room for the trained tokenizer (bytes, specials); special ids stay
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # a type transformers cannot build as a text model: skipped with its reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(2.0)  # sharp: a wrong mask moves a score far past float32 rounding
    if name in RUN_LENGTH:
        return model.float().eval(), length
    positions = [getattr(model.config, k, None) for k in ("n_positions", "max_position_embeddings", "max_seq_len")]
    limit = min([p for p in positions if isinstance(p, int) and p > 8] or [length])
    return model.float().eval(), min(length, limit)


def requests(tokenizer: Any, max_length: int) -> tuple[list[tuple[str, str]], list[str]]:
    """Few-shot questions (a shared block, questions of many lengths, four answers each) whose contexts run from a
    few tokens to about ``max_length``, and documents of one to three windows."""
    from distperp_harness.commands.tiny import sample_text

    words = sample_text().split()
    per_word = max(1.0, len(tokenizer(" ".join(words[:200]))["input_ids"]) / 200)
    fit = max(4, int(max_length / per_word))
    pairs = []
    for q, share in enumerate((0.05, 0.15, 0.3, 0.45, 0.6, 0.8)):
        n = max(2, int(fit * share))
        context = " ".join(words[: n // 2] + ["Q:"] + words[300 + 7 * q : 300 + 7 * q + n - n // 2]) + " A:"
        pairs += [(context, " " + " ".join(words[500 + 3 * a + q : 501 + 3 * a + q + a % 3])) for a in range(4)]
    documents = [" ".join(words[900 + 400 * i : 900 + 400 * i + int(fit * (0.7 + 1.1 * i))]) for i in range(3)]
    return pairs, documents


def unshared(model: Any, units: list, dtype: torch.dtype) -> np.ndarray:
    """Each unit's log-likelihood from its own forward, alone, through a copy of ``model`` in ``dtype`` made afresh
    for it (a dynamic RoPE keeps no frequencies from another unit; experts one by one): full logits, a float64
    log-softmax, ``math.fsum``. Independent of distperp's engine and probe."""
    base = copy.deepcopy(model).to(dtype)
    if getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
        base.set_experts_implementation("eager")
    out = np.empty(len(units))
    with torch.no_grad():
        for i, unit in enumerate(units):
            fresh = copy.deepcopy(base)
            logits = fresh(input_ids=torch.tensor([unit.tokens[:-1]]), use_cache=False).logits[0]
            logp = torch.log_softmax(logits[-unit.n_score :].double(), -1)
            targets = torch.tensor(unit.tokens[-unit.n_score :])
            out[i] = math.fsum(logp.gather(-1, targets[:, None])[:, 0].tolist())
    return out


def check(name: str) -> Verdict:
    """One type through distperp against float64 (module doc)."""
    from distperp_harness.commands.tiny import sample_text, train_tokenizer
    from distperp_harness.errors import InputError
    from distperp_harness.lm import DistPerpLM
    from distperp_harness.planning.requests import continuation_unit, window_units

    t0 = time.perf_counter()
    built = build(name)
    if isinstance(built, str):
        return Verdict(name, "skipped", built)
    model, max_length = built
    vocab = int(model.get_input_embeddings().num_embeddings)
    tokenizer = train_tokenizer([sample_text()], min(vocab, 512), model_max_length=max_length)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]))
    except Exception as exc:  # needs other inputs (pixel values, audio): no text model
        return Verdict(name, "skipped", f"no forward on token ids alone ({type(exc).__name__})")
    try:
        lm = DistPerpLM(pretrained=model, tokenizer=tokenizer, batch_size="auto", device="cpu", max_length=max_length)
    except (InputError, ValueError) as exc:
        return Verdict(name, "refused", str(exc).splitlines()[0][:200], seconds=time.perf_counter() - t0)
    pairs, documents = requests(tokenizer, max_length)
    try:
        from lm_eval.api.instance import Instance

        ll = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], True)
        rolling = lm.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(documents)], True
        )
    except Exception as exc:
        return Verdict(name, "CRASH", f"{type(exc).__name__}: {str(exc)[:200]}", seconds=time.perf_counter() - t0)
    units = [continuation_unit(*lm._encode_pair(c, a), max_length) for c, a in pairs]
    windows = [window_units(lm.tok_encode(d), lm.prefix_token_id, max_length) for d in documents]
    flat = units + [u for w in windows for u in w]
    try:
        own, exact = unshared(model, flat, torch.float32), unshared(model, flat, torch.float64)
    except Exception as exc:  # transformers' own forward of the type fails in float64 (XGLM's mask fill)
        return Verdict(name, "unchecked", f"no float64 reference: {type(exc).__name__}: {str(exc)[:160]}")
    counts = np.array([u.n_score for u in flat], dtype=float)
    ours = np.array([float(s) for s, _ in ll] + [math.nan] * (len(flat) - len(units)))
    bounds = np.cumsum([0] + [len(w) for w in windows])
    for i, score in enumerate(rolling):
        ours[len(units) + bounds[i] : len(units) + bounds[i + 1]] = math.nan  # compared per document below
        own_doc = math.fsum(own[len(units) + bounds[i] : len(units) + bounds[i + 1]])
        exact_doc = math.fsum(exact[len(units) + bounds[i] : len(units) + bounds[i + 1]])
        if (
            abs(float(score) - exact_doc)
            > 10 * abs(own_doc - exact_doc)
            + ROUNDING * counts[len(units) + bounds[i] : len(units) + bounds[i + 1]].sum()
        ):
            return Verdict(name, "WRONG", f"document {i}", abs(float(score) - exact_doc), time.perf_counter() - t0)
    head = slice(0, len(units))
    distance = np.abs(ours[head] - exact[head])
    limit = 10 * np.abs(own[head] - exact[head]) + ROUNDING * counts[head]
    if (distance > limit).any():
        worst = int(np.argmax(distance - limit))
        return Verdict(name, "WRONG", f"question unit {worst}", float(distance[worst]), time.perf_counter() - t0)
    paths = lm.prepared.paths["model"]
    refused = paths["packed_rows_fallback"] or paths["cached_prefix_fallback"]
    alone = paths["lengths"]["exact_above"] == 0
    kind = "fallback" if refused or alone else "fast and exact"
    why = refused or ("; ".join(paths["lengths"]["why"]) if paths["lengths"]["why"] else "")
    return Verdict(name, kind, why, float(distance.max(initial=0.0)), time.perf_counter() - t0)


def registered_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def table(verdicts: list[Verdict]) -> str:
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.kind] = counts.get(v.kind, 0) + 1
    lines = [
        ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())),
        "",
        "| type | verdict | why | largest distance from float64 | s |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        why = v.why.replace("|", "/")[:160]
        lines.append(f"| {v.name} | {v.kind} | {why} | {v.distance:.2g} | {v.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=None, help="comma-separated PUBLISHED names or model types")
    parser.add_argument("--published", action="store_true", help="the PUBLISHED families only")
    parser.add_argument("--json", action="store_true", help="the last line: every verdict as JSON (for tests)")
    args = parser.parse_args(argv)
    use_offline_env()
    torch.set_num_threads(1)
    names = args.types.split(",") if args.types else sorted(PUBLISHED) if args.published else registered_types()
    verdicts = []
    for name in names:
        try:
            verdict = check(name)
        except Exception as exc:  # the matrix reports every type, whatever one of them does
            verdict = Verdict(name, "CRASH", f"{type(exc).__name__}: {str(exc)[:200]}")
        print(f"{verdict.name}: {verdict.kind} {verdict.why[:120]} ({verdict.seconds:.1f} s)", flush=True)
        verdicts.append(verdict)
    print(table(verdicts))
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in verdicts]))
    return 1 if any(v.failed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
