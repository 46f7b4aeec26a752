"""Greedy ``generate_until``: lm-eval's ``hf`` model vs ``distperp`` on the same checkpoint, prompts and batch size.

    python benchmarks/bench_generate.py --model ../shared/models/wt2-llama-5m \\
        --text ../shared/data/wikitext-2/valid.txt --prompts 64 --batch-size 8

    python benchmarks/bench_generate.py --case fewshot --model ../shared/models/wt2-llama-5m \\
        --text ../shared/data/wikitext-2/valid.txt --prompts 32 --batch-size 8 --max-length 1024 --max-gen-toks 32

Cases:

* ``paragraphs`` (default): the first ``--prompt-words`` words of the first ``--prompts`` paragraphs of ``--text``
  (default: the packaged sample), each generating up to ``--max-gen-toks`` tokens, stopping at a blank line.
* ``fewshot``: a fixed block of ``--shots`` solved examples (``Text: <--shot-words words>\\nNext: <8 words>``,
  separated by blank lines, as lm-eval's ``first_n`` sampler gives every question) before each question
  (``Text: <--prompt-words words>\\nNext:``), the leaderboard shape of MATH 4-shot or GSM8K: distperp computes the
  shared block once per batch and starts every row from its KV cache.

Both models are built in-process from lm-eval's registry and called with the same ``Instance`` objects, alternating
per repeat (rotated order). Prints the median and best wall time, the median process CPU time (steadier on a
shared machine), generated tokens/s, prompt tokens (total and shared by all prompts), the prompt tokens distperp
computed per generation, and how many generations are identical between the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

for _key, _value in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
                     "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}.items():
    os.environ.setdefault(_key, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def prompts_from(text: str, count: int, words: int) -> list[str]:
    paragraphs = [p.strip() for p in text.split("\n") if len(p.split()) > words and not p.strip().startswith("=")]
    if len(paragraphs) < count:
        raise SystemExit(f"the text has {len(paragraphs)} paragraphs of more than {words} words; need {count}")
    return [" ".join(p.split()[:words]) for p in paragraphs[:count]]


def fewshot_prompts(text: str, count: int, shots: int, shot_words: int, words: int) -> list[str]:
    """``count`` questions after the same ``shots`` solved examples (paragraphs of ``text``, in order)."""
    paragraphs = [p.split() for p in text.split("\n") if len(p.split()) > max(shot_words, words) + 8
                  and not p.strip().startswith("=")]
    if len(paragraphs) < shots + count:
        raise SystemExit(f"the text has {len(paragraphs)} long enough paragraphs; need {shots + count}")
    block = "".join(f"Text: {' '.join(p[:shot_words])}\nNext: {' '.join(p[shot_words:shot_words + 8])}\n\n"
                    for p in paragraphs[:shots])
    return [f"{block}Text: {' '.join(p[:words])}\nNext:" for p in paragraphs[shots: shots + count]]


def common_prefix(sequences: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n and s[n] == sequences[0][n] for s in sequences):
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", default=None, help="default: the packaged sample")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--max-gen-toks", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", choices=("paragraphs", "fewshot"), default="paragraphs")
    parser.add_argument("--shots", type=int, default=6, help="fewshot: solved examples in the shared block")
    parser.add_argument("--shot-words", type=int, default=58, help="fewshot: words of each example's text")
    args = parser.parse_args(argv)
    if args.case == "fewshot" and args.prompt_words == parser.get_default("prompt_words"):
        args.prompt_words = 12

    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import distperp_harness._hook  # noqa: F401  (registers --model distperp)
    from distperp_harness.commands.tiny import sample_text

    text = Path(args.text).read_text(encoding="utf-8") if args.text else sample_text()
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}
    prompts = (fewshot_prompts(text, args.prompts, args.shots, args.shot_words, args.prompt_words)
               if args.case == "fewshot" else prompts_from(text, args.prompts, args.prompt_words))
    requests = [Instance("generate_until", {}, (p, dict(gen_kwargs)), i) for i, p in enumerate(prompts)]
    model_args = f"pretrained={args.model},dtype=float32,max_length={args.max_length},device=cpu"
    lms = {name: get_model(name).create_from_arg_string(model_args, {"batch_size": args.batch_size})
           for name in ("hf", "distperp")}
    seconds: dict[str, list[float]] = {name: [] for name in lms}
    cpu: dict[str, list[float]] = {name: [] for name in lms}  # process CPU time: less hurt by a busy machine
    outputs: dict[str, list[str]] = {}
    names = list(lms)
    for repeat in range(args.repeats):
        for name in names[repeat % 2:] + names[: repeat % 2]:
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs[name] = lms[name].generate_until(requests, disable_tqdm=True)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    median = {name: statistics.median(t) for name, t in seconds.items()}
    cpu_median = {name: statistics.median(t) for name, t in cpu.items()}
    tokenizer = lms["distperp"].tokenizer
    generated = sum(len(tokenizer.encode(o)) for o in outputs["distperp"])
    same = sum(a == b for a, b in zip(outputs["hf"], outputs["distperp"]))
    encoded = [tokenizer.encode(p) for p in prompts]
    call = lms["distperp"].stats.calls[-1]
    print(f"{args.case}: {len(requests)} greedy prompts of {min(map(len, encoded))}-{max(map(len, encoded))} "
          f"tokens ({common_prefix(encoded)} shared by all), batch {args.batch_size}, max_length {args.max_length}, "
          f"up to {args.max_gen_toks} new tokens, {generated} generated tokens; {args.repeats} alternating repeats\n")
    print("| model | median s | best s | generated tokens/s (median) | vs hf (median) | median CPU s | vs hf (CPU) |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {median[name]:.2f} | {min(seconds[name]):.2f} | {generated / median[name]:.0f} | "
              f"{median['hf'] / median[name]:.2f}x | {cpu_median[name]:.2f} | "
              f"{cpu_median['hf'] / cpu_median[name]:.2f}x |")
    print(f"\nidentical generations: {same}/{len(requests)}")
    print(f"distperp prompt tokens computed per generation: {call['computed_prompt_tokens_per_job']:.0f} "
          f"(of {call['prompt_tokens'] / max(1, call['jobs']):.0f}); "
          f"{call['shared_batches']}/{call['generation_batches']} "
          f"batches from a shared prefix")
    for i, (a, b) in enumerate(zip(outputs["hf"], outputs["distperp"])):
        if a != b:
            print(f"  differs at prompt {i}: hf {a[:60]!r} vs distperp {b[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
