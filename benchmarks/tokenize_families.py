"""Tokenizing few-shot prompts per tokenizer family: ``encode_many`` (text shared by groups of strings tokenized once
as pieces, cut where the tokenizer's own pipeline proves every string's ids unchanged, the tails grouped again level
after level) against one batched call of the whole strings (``tokenizer(strings)["input_ids"]``), on tokenizers in
the layouts of GPT-2/SmolLM2, Llama 3, Qwen2, Gemma and Metaspace families trained here on WikiText-2, and on real
tokenizers given with ``--model``; then Gemma's added-token case.

    python -m benchmarks.tokenize_families                       # 16k vocabularies + SmolLM2's tokenizer if cached
    python -m benchmarks.tokenize_families --questions 12 --vocab 400 --repeats 1 --model none   # dry size

Workloads (``--workloads``), the strings lm-eval's ``loglikelihood`` asks to encode (each context, each context +
answer):

* ``fixed``: MMLU-Pro-shaped 5-shot, ``--questions`` questions after one ~2,500-character few-shot block (lm-eval's
  ``first_n`` sampler), ten options each;
* ``random``: lm-eval's MMLU template 5-shot with lm-eval's default sampler (``ContextSampler``, seed 1234): each
  question's prompt holds its subject's five dev examples in a random order, ``--questions`` questions, four
  answers each (~2,200 characters a prompt);
* ``pool``: the same, the five drawn from a pool of 300 examples per question (few recur: the cost of looking).

Per tokenizer and workload, in one process, ``--repeats`` alternating repetitions of both sides after one warm-up
(which reads the tokenizer's pipeline once): wall-clock medians, their ratio, the ratio of CPU-time medians, what
``encode_many`` did (levels of grouping, groups cut, distinct pieces, characters encoded against the strings',
checks included) and the ids checked equal.

Gemma's added-token case (on unless ``--no-markup``): the Gemma layout with an added vocabulary shaped like
Gemma 3's (6,326 contents starting with ``<``): finding the cut of a 10k-character prefix with 1,250 ``<`` against
encoding it whole, and a 12-string group sharing it through ``encode_many`` against one encode per string and one
batched call. Exit 1 when any id differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import SMOLLM2, WIKITEXT_TEST

WORKLOADS = ("fixed", "random", "pool")


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


def workload(name: str, words: list[str], questions: int) -> list[str]:
    from distperp_harness.commands.tiny_tokenizers import mmlu_random_prompts

    if name == "fixed":
        return prompts(words, questions)
    return mmlu_random_prompts(words, 1, questions, pool=5 if name == "random" else 300)


def medians(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each side's median wall seconds over ``repeats`` alternating repetitions, and (``"<side> cpu"``) its median
    CPU seconds of this process (with ``TOKENIZERS_PARALLELISM=false`` all of the work; less sensitive to other
    processes on a shared machine)."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, run in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times[side].append(time.perf_counter() - t0)
            cpu[side].append(time.process_time() - c0)
    return {side: statistics.median(t) for side, t in times.items()} | {
        f"{side} cpu": statistics.median(c) for side, c in cpu.items()
    }


def measure(work: str, name: str, tokenizer: Any, strings: list[str], repeats: int) -> bool:
    """One table row: both sides' medians, their ratio, what ``encode_many`` did; False when any id differs."""
    from distperp_harness.planning.encoding import PieceEncoder, encode_many, local_pipeline

    t0 = time.perf_counter()
    encoder = PieceEncoder(tokenizer, {})
    fast = encoder.encode(strings)  # warm-up: reads the pipeline once
    first = time.perf_counter() - t0
    plain = [list(ids) for ids in tokenizer(strings)["input_ids"]]
    seconds = medians(
        {"plain": lambda: tokenizer(strings)["input_ids"], "encode_many": lambda: encode_many(tokenizer, strings)},
        repeats,
    )
    whole, cut = seconds["plain"], seconds["encode_many"]
    cpu = seconds["plain cpu"] / seconds["encode_many cpu"]
    why = local_pipeline(tokenizer)
    path = f"whole: {why}" if why else f"{encoder.levels} / {encoder.groups} / {len(encoder.pieces)}"
    share = encoder.encoded / sum(map(len, strings))
    same = fast == plain
    print(f"| {work} | {name} | {path} | {share:.0%} | {whole * 1e3:,.1f} | {cut * 1e3:,.1f} | **{whole / cut:.2f}x** "
          f"| {cpu:.2f}x | {first * 1e3:,.0f} | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip
    return same


def markup_case(text: str, vocab: int, repeats: int) -> bool:
    """Gemma's added-token case (module docstring); False when any id differs."""
    from distperp_harness.commands.tiny_tokenizers import Family, family_tokenizer, markup_text, with_markup_tokens
    from distperp_harness.planning.encoding import encode_many
    from distperp_harness.planning.tokenizer_cuts import find_cut, pipeline_of

    words = text.split()
    tokenizer = with_markup_tokens(family_tokenizer(Family.GEMMA, [text], vocab))
    t0 = time.perf_counter()
    pipeline_of(tokenizer)
    read = time.perf_counter() - t0
    prefix = markup_text(words, 10_000, 1_250)
    group = [prefix + tail for tail in ["a", "td>", "unused7>", "<b>x", " < y", "</td>", "<unused12>", "br>", "<u"]]
    group += [prefix + " " + " ".join(words[i : i + 9]) for i in range(3)]
    seconds = medians(
        {
            "cut": lambda: find_cut(tokenizer, prefix, {}),
            "whole": lambda: tokenizer(prefix)["input_ids"],
            "group": lambda: encode_many(tokenizer, group),
            "one by one": lambda: [tokenizer.encode(s) for s in group],
            "batched": lambda: tokenizer(group)["input_ids"],
        },
        repeats,
    )
    same = encode_many(tokenizer, group) == [tokenizer.encode(s) for s in group]
    contents = sum(t.content.startswith("<") for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values())
    print(f"\nGemma layout ({len(tokenizer):,} tokens, {contents:,} added contents starting with '<'; pipeline read "
          f"with its automaton: {read * 1e3:,.0f} ms), a 10,000-character prefix with {prefix.count('<'):,} '<':\n\n"
          "| work | ms | against |\n|---|---:|---|\n"
          f"| find the cut of the prefix | {seconds['cut'] * 1e3:,.1f} | {seconds['cut'] / seconds['whole']:.2f}x "
          f"encoding it whole ({seconds['whole'] * 1e3:,.1f} ms) |\n"
          f"| `encode_many` of 12 strings sharing it | {seconds['group'] * 1e3:,.1f} | "
          f"{seconds['group'] / seconds['one by one']:.2f}x one encode each ({seconds['one by one'] * 1e3:,.1f} ms), "
          f"{seconds['group'] / seconds['batched']:.2f}x one batched call ({seconds['batched'] * 1e3:,.1f} ms) |\n"
          f"\nids equal: {'yes' if same else 'NO'}", flush=True)  # fmt: skip
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=16000, help="vocabulary of the trained family tokenizers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", default="gpt2,llama3,qwen2,gemma,metaspace")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--model", action="append", default=None, help="a tokenizer folder ('none': no real one)")
    parser.add_argument("--no-markup", dest="markup", action="store_false", help="skip Gemma's added-token case")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from distperp_harness.commands.tiny_tokenizers import Family, family_tokenizer

    text = _text()
    words = text.split()
    works = {name: workload(name, words, args.questions) for name in args.workloads.split(",") if name}
    print(f"{os.cpu_count()} CPUs, TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}; "
          f"medians of {args.repeats} alternating repetitions")  # fmt: skip
    for name, strings in works.items():
        print(f"{name}: {args.questions} questions, {len(strings):,} distinct strings, "
              f"{sum(map(len, strings)) / 1e6:.2f} M characters")  # fmt: skip
    print("\n| workload | tokenizer | levels / groups / pieces | characters encoded | one batched call ms "
          "| encode_many ms | speed-up | CPU-time speed-up | first call ms | ids equal |\n"
          "|---|---|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    tokenizers = [(f"{f.value} ({args.vocab:,})", lambda f=f: family_tokenizer(f, [text], args.vocab))
                  for f in (Family(name) for name in args.families.split(",") if name)]  # fmt: skip
    models = args.model if args.model is not None else [str(SMOLLM2)] * SMOLLM2.exists()
    tokenizers += [(Path(m).name, lambda m=m: AutoTokenizer.from_pretrained(m)) for m in models if m != "none"]
    ok = True
    for name, load in tokenizers:
        tokenizer = load()
        for work, strings in works.items():
            ok &= measure(work, name, tokenizer, strings, args.repeats)
    if args.markup:
        ok &= markup_case(text, args.vocab, args.repeats)
    print("\ntoken ids: " + ("equal to whole encodes everywhere" if ok else "DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
