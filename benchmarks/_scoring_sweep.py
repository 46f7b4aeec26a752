"""``python -m benchmarks.bench_scoring --sweep ROWS``: scoring tokens/s per batch size, to see where a larger batch
stops paying off (the CPU cap of ``batch_size=auto``).

Scores full-length windows (random token ids: speed does not depend on them) with distperp's ``score_batch`` at each
row count of ``--sweep``, interleaved over ``--repeats`` rounds (default 3; each round runs every size once, in
rotated order, so slow phases of a shared machine hit all of them), ``--tokens`` tokens per size and round (default
65,536). Prints, per model, the best round's tokens/s per size and relative to the fastest size.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SWEEP_TOKENS = 65_536
"""Tokens scored per size and round when ``--tokens`` is not given."""


def sweep_rows(path: Path, args: argparse.Namespace) -> str:
    """The sweep of the model at ``path`` over the row counts ``args.sweep`` (comma-separated): a markdown table.

    Raises:
        ValueError: a row count that is not a positive integer, naming it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from distperp_harness.planning.requests import Unit
    from distperp_harness.run.scoring.engine.forward import score_batch

    try:
        sizes = [int(r) for r in args.sweep.split(",") if r.strip()]
    except ValueError as exc:
        raise ValueError(f"--sweep {args.sweep!r}: give positive row counts, e.g. 2,4,8,16") from exc
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sweep {args.sweep!r}: give positive row counts, e.g. 2,4,8,16")
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    vocab, length = model.config.vocab_size, args.max_length
    tokens = args.tokens or SWEEP_TOKENS
    gen = torch.Generator().manual_seed(0)
    windows = [
        Unit(tuple(torch.randint(4, vocab, (length + 1,), generator=gen).tolist()), length) for _ in range(max(sizes))
    ]
    best = {s: float("inf") for s in sizes}
    for round_ in range(args.repeats):
        for s in sizes[round_ % len(sizes) :] + sizes[: round_ % len(sizes)]:
            batches = max(1, tokens // (s * length))
            start = time.perf_counter()
            for _ in range(batches):
                score_batch(model, windows[:s], device=device, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[s] = min(best[s], (time.perf_counter() - start) / (batches * s * length))
    fastest = min(best.values())
    lines = [
        f"sweep of {path.name}: {args.dtype} on {args.device}, best of {args.repeats} rounds, {tokens} tokens per "
        "size and round",
        "",
        f"| rows x {length} | tokens per batch | tokens/s | vs fastest |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {s} | {s * length} | {1 / best[s]:.0f} | {fastest / best[s]:.3f} |" for s in sizes]
    return "\n".join(lines)
