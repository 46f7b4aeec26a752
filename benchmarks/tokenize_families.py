"""Tokenizing few-shot prompts per tokenizer family: ``encode_many`` (each shared few-shot block tokenized once, cut
where the tokenizer's own pipeline proves every string's ids unchanged) against plain batched encoding of the whole
strings (``tokenizer(strings)["input_ids"]``), on tokenizers in the layouts of GPT-2/SmolLM2, Llama 3, Qwen2, Gemma
and Metaspace families trained here on WikiText-2, and on real tokenizers given with ``--model``.

    python -m benchmarks.tokenize_families                       # 16k vocabularies + SmolLM2's tokenizer if cached
    python -m benchmarks.tokenize_families --questions 12 --vocab 400 --repeats 1 --model none   # dry size

Work: MMLU-Pro-shaped 5-shot prompts, ``--questions`` questions after one ~2,500-character few-shot block, ten
options each; the strings are those lm-eval's ``loglikelihood`` asks to encode (each context, each context +
answer). Per tokenizer, in one process, ``--repeats`` alternating repetitions of both sides after one warm-up
(which reads the tokenizer's pipeline once): medians, their ratio, the cut chosen (kind, characters of the shared
prefix before it) and the ids checked equal. Exit 1 when any id differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import WIKITEXT_TEST

SMOLLM2 = Path.home() / ".cache" / "distperp" / "smollm2-135m-instruct"


def _text() -> str:
    if WIKITEXT_TEST.exists():
        return WIKITEXT_TEST.read_text(encoding="utf-8")
    from distperp_harness.commands.tiny import sample_text

    return sample_text() * 8


def prompts(words: list[str], questions: int, shots: int = 5, options: int = 10) -> list[str]:
    """The distinct strings lm-eval encodes for MMLU-Pro-shaped ``shots``-shot questions (one block for all)."""
    from distperp_harness.tokens import loglikelihood_strings

    block = "The following are multiple choice questions (with answers) about history.\n\n" + "".join(
        f"Question: {' '.join(words[300 * k : 300 * k + 74])}?\nAnswer: Let's think step by step. "
        f"{' '.join(words[300 * k + 74 : 300 * k + 86])}. The answer is (B).\n\n"
        for k in range(shots)
    )
    pairs = []
    for q in range(questions):
        start = 5000 + 120 * q
        context = f"{block}Question: {' '.join(words[start : start + 50])}?\nAnswer:"
        pairs += [(context, " " + " ".join(words[start + 50 + 3 * o : start + 53 + 3 * o])) for o in range(options)]
    return list(dict.fromkeys(s for s, _ in loglikelihood_strings(pairs)))


def measure(name: str, tokenizer: Any, strings: list[str], repeats: int) -> bool:
    """One table row: both sides' medians, their ratio, the cut; False when any id differs."""
    from distperp_harness.planning.encoding import encode_many, local_pipeline, shared_prefix_groups
    from distperp_harness.planning.tokenizer_cuts import find_cut

    t0 = time.perf_counter()
    fast = encode_many(tokenizer, strings)  # warm-up: reads the pipeline once
    first = time.perf_counter() - t0
    plain = [list(ids) for ids in tokenizer(strings)["input_ids"]]
    sides = {"plain": lambda: tokenizer(strings)["input_ids"], "encode_many": lambda: encode_many(tokenizer, strings)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, run in sides.items():
            t0 = time.perf_counter()
            run()
            times[side].append(time.perf_counter() - t0)
    whole, cut = (statistics.median(times[side]) for side in ("plain", "encode_many"))
    groups = shared_prefix_groups(strings)
    cuts = [find_cut(tokenizer, strings[members[0]][:shared], {}) for members, shared in groups]
    path = "; ".join(
        f"{c.kind.value} at {c.position:,}/{shared:,}" if c.kind and c.position else f"whole: {c.reason}"
        for c, (_, shared) in zip(cuts, groups)
    )
    path = path or f"whole: {local_pipeline(tokenizer) or 'no group shares a prefix'}"
    same = fast == plain
    print(f"| {name} | {path} | {whole * 1e3:,.1f} | {cut * 1e3:,.1f} | {whole / cut:.2f}x | {first * 1e3:,.0f} | "
          f"{'yes' if same else 'NO'} |", flush=True)  # fmt: skip
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=16000, help="vocabulary of the trained family tokenizers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", default="gpt2,llama3,qwen2,gemma,metaspace")
    parser.add_argument("--model", action="append", default=None, help="a tokenizer folder ('none': no real one)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from distperp_harness.commands.tiny_tokenizers import Family, family_tokenizer

    text = _text()
    strings = prompts(text.split(), args.questions)
    print(
        f"{args.questions} questions x 10 options, 5-shot block, {len(strings):,} distinct strings "
        f"({sum(map(len, strings)) / 1e6:.1f} M characters); {os.cpu_count()} CPUs, TOKENIZERS_PARALLELISM="
        f"{os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}; medians of {args.repeats} alternating repetitions\n"
    )
    print("| tokenizer | path (cut kind at character / shared prefix) | whole strings ms | encode_many ms | speed-up "
          "| first call ms | ids equal |\n|---|---|---:|---:|---:|---:|---|")  # fmt: skip
    ok = True
    for family in (Family(name) for name in args.families.split(",") if name):
        tokenizer = family_tokenizer(family, [text], args.vocab)
        ok &= measure(f"{family.value} ({len(tokenizer):,} tokens)", tokenizer, strings, args.repeats)
    models = args.model if args.model is not None else [str(SMOLLM2)] * SMOLLM2.exists()
    for path in (m for m in models if m != "none"):
        ok &= measure(Path(path).name, AutoTokenizer.from_pretrained(path), strings, args.repeats)
    print("\ntoken ids: " + ("equal to whole encodes everywhere" if ok else "DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
