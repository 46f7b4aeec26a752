"""Scoring tokens/s per batch size: where does a larger batch stop paying off? (the CPU cap of ``batch_size=auto``)

    python benchmarks/batch_sweep.py --model ../shared/models/wt2-llama-5m --max-length 1024 --rows 2,4,8,16,32,64

Scores full-length windows (random token ids: speed does not depend on them) with distperp's ``score_batch`` at each
row count, interleaved over ``--repeats`` rounds (each round runs every size once, in rotated order, so slow phases
of a shared machine hit all of them), ``--tokens`` tokens per size and round. Prints the best round's tokens/s per
size, relative to the fastest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from distperp_harness.planning.requests import Unit
from distperp_harness.run.scoring.engine.forward import score_batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--rows", default="2,4,8,16,32,64")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens scored per size and round")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    sizes = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    windows = [
        Unit(tuple(torch.randint(4, vocab, (args.max_length + 1,), generator=gen).tolist()), args.max_length)
        for _ in range(max(sizes))
    ]
    best = {s: float("inf") for s in sizes}
    for round_ in range(args.repeats):
        for s in sizes[round_ % len(sizes) :] + sizes[: round_ % len(sizes)]:
            batches = max(1, args.tokens // (s * args.max_length))
            start = time.perf_counter()
            for _ in range(batches):
                score_batch(model, windows[:s], device=torch.device("cpu"), pad_token_id=0)
            best[s] = min(best[s], (time.perf_counter() - start) / (batches * s * args.max_length))
    fastest = min(best.values())
    print(f"| rows x {args.max_length} | tokens per batch | tokens/s | vs fastest |\n|---:|---:|---:|---:|")
    for s in sizes:
        print(f"| {s} | {s * args.max_length} | {1 / best[s]:.0f} | {fastest / best[s]:.3f} |")


if __name__ == "__main__":
    main()
