"""Greedy ``generate_until``: lm-eval's ``hf`` model vs ``distperp`` on the same checkpoint, prompts and batch size.

    python benchmarks/bench_generate.py --model ../shared/models/wt2-llama-5m \\
        --text ../shared/data/wikitext-2/valid.txt --prompts 64 --batch-size 8

Prompts: the first ``--prompt-words`` words of the first ``--prompts`` paragraphs of ``--text`` (default: the packaged
sample), each generating up to ``--max-gen-toks`` tokens greedily, stopping at a blank line. Both models are built
in-process from lm-eval's registry and called with the same ``Instance`` objects, alternating per repeat (rotated
order, best repeat shown: interference only slows a run down). Prints wall time, generated tokens/s and how many
generations are identical between the two.
"""

from __future__ import annotations

import argparse
import os
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
    args = parser.parse_args(argv)

    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import distperp_harness._hook  # noqa: F401  (registers --model distperp)
    from distperp_harness.tiny import sample_text

    text = Path(args.text).read_text(encoding="utf-8") if args.text else sample_text()
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}
    requests = [Instance("generate_until", {}, (p, dict(gen_kwargs)), i)
                for i, p in enumerate(prompts_from(text, args.prompts, args.prompt_words))]
    model_args = f"pretrained={args.model},dtype=float32,max_length={args.max_length},device=cpu"
    lms = {name: get_model(name).create_from_arg_string(model_args, {"batch_size": args.batch_size})
           for name in ("hf", "distperp")}
    best = {name: float("inf") for name in lms}
    outputs: dict[str, list[str]] = {}
    names = list(lms)
    for repeat in range(args.repeats):
        for name in names[repeat % 2:] + names[: repeat % 2]:
            start = time.perf_counter()
            outputs[name] = lms[name].generate_until(requests, disable_tqdm=True)
            best[name] = min(best[name], time.perf_counter() - start)
    tokenizer = lms["distperp"].tokenizer
    generated = sum(len(tokenizer.encode(o)) for o in outputs["distperp"])
    same = sum(a == b for a, b in zip(outputs["hf"], outputs["distperp"]))
    print(f"{len(requests)} greedy prompts, batch {args.batch_size}, up to {args.max_gen_toks} new tokens, "
          f"{generated} generated tokens; best of {args.repeats}\n")
    print("| model | seconds | generated tokens/s | vs hf |\n|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {best[name]:.2f} | {generated / best[name]:.0f} | {best['hf'] / best[name]:.2f}x |")
    print(f"\nidentical generations: {same}/{len(requests)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
