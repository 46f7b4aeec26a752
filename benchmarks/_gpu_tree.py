"""``gpu_check``'s tree-row case: MMLU-Pro-shaped 5-shot questions through ``DistPerpLM.loglikelihood`` with each
attention implementation (``--tree-impls``), timed, its chosen answers against sdpa's (``gpu_check``'s docstring)."""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks._gpu_common import gib, model_args
from distperp_harness.commands.tiny import sample_text


def tree_questions(tokenizer, cuda: bool, n: int) -> list[tuple[str, list[str]]]:
    """``n`` MMLU-Pro-shaped questions ``(context, ten continuations)`` (``bench_mc``'s ``mmlupro5`` layout; in the
    dry mode one shot, no header and two-token stems, so a prompt nearly fits the dry model's 128 positions)."""
    shots, stem, option_tokens = (5, 40, 5) if cuda else (1, 2, 1)
    ids = tokenizer.encode(sample_text(), add_special_tokens=False)
    width = stem + 10 * option_tokens
    letters = "ABCDEFGHIJ"

    def piece(start: int, length: int) -> str:
        start %= len(ids) - length
        return tokenizer.decode(ids[start : start + length]).strip()

    def prompt(k: int) -> str:
        options = "\n".join(
            f"{letters[j]}. {piece(k * width + stem + j * option_tokens, option_tokens)}" for j in range(10)
        )
        return f"Question: {piece(k * width, stem)}\nOptions:\n{options}\nAnswer:"

    header = "The following are multiple choice questions (with answers) about history.\n" if cuda else ""
    block = header + "".join(f"{prompt(k)} {letters[k % 10]}\n\n" for k in range(shots))
    return [(block + prompt(shots + q), [f" {x}" for x in letters]) for q in range(n)]


def tree_case(args: argparse.Namespace, model: Path, impl: str) -> dict:
    """The MMLU-Pro-shaped case with ``attn_implementation=impl`` (module doc); ``skipped`` says why it did not run."""
    from distperp_harness.lm import DistPerpLM

    cuda = args.device == "cuda"
    row = dict(impl=impl, skipped=None)
    kwargs = dict(model_args(args, model, "none"), attn_implementation=impl)
    if not cuda:
        kwargs["max_length"] = 128
    try:
        lm = DistPerpLM(**kwargs)
    except (ValueError, ImportError) as e:  # transformers: no flex attention for this model or device
        return dict(row, skipped=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if lm.sharing_fallback:
        row["skipped"] = f"no tree rows: {lm.sharing_fallback}"
        del lm
        return row
    questions = tree_questions(lm.tokenizer, cuda, args.tree_questions)
    requests = [SimpleNamespace(args=(c, x)) for c, xs in questions for x in xs]
    lm.loglikelihood(requests, disable_tqdm=True)  # untimed: compiles flex's kernels for every batch shape
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = lm.loglikelihood(requests, disable_tqdm=True)
    call = lm.stats.calls[-1].to_dict()
    lls = [float(ll) for ll, _ in out]
    request_tokens = sum(len(lm.tok_encode(c + x)) for c, x in (r.args for r in requests))
    prompt = [len(lm.tok_encode(c)) for c, _ in questions]
    shared = len(os.path.commonprefix([lm.tok_encode(c) for c, _ in questions[:2]]))
    row.update(
        questions=len(questions),
        prompt_tokens=sum(prompt) / len(prompt),
        shared_tokens=shared,
        rows=call["rows"],
        per_question=call["computed_tokens"] / len(questions),
        seconds=call["scoring_seconds"],
        tokens_per_s=request_tokens / call["scoring_seconds"],
        peak=torch.cuda.max_memory_allocated() if cuda else None,
        lls=lls,
        answers=[max(range(10), key=lambda j: lls[q + j]) for q in range(0, len(lls), 10)],
    )
    del lm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def tree_table(rows: list[dict]) -> str:
    lines = [
        "| tree rows, MMLU-Pro 5-shot shape | questions | prompt tokens (shared) | rows | computed tokens per "
        "question | scoring s | request tokens/s | vs sdpa | scoring peak GiB | answers vs sdpa |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = next((r for r in rows if r["impl"] == "sdpa" and not r["skipped"]), None)
    for r in rows:
        if r["skipped"]:
            lines.append(f"| {r['impl']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        lines.append(
            f"| {r['impl']} | {r['questions']} | {r['prompt_tokens']:.0f} ({r['shared_tokens']}) | "
            f"{r['rows']} | {r['per_question']:.0f} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{speed} | {gib(r['peak'])} | {tree_agreement(r, base)} |"
        )
    return "\n".join(lines)


def tree_agreement(row: dict, base: dict | None) -> str:
    if base is None or row is base:
        return "-"
    same = row["answers"] == base["answers"]
    diff = max(abs(a - b) for a, b in zip(row["lls"], base["lls"]))
    return f"{'equal' if same else 'DIFFERENT'} (max abs ll diff {diff:.2g})"
