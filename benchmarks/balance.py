"""Load balance of the global plan vs lm-eval's round-robin split of documents, and a 1,024-rank simulation.

    python -m benchmarks.balance            # about 10 s on 2 CPU cores

Data: WikiText-2 test (``../shared/data/wikitext-2/test.txt``, 62 articles split on `` = Title = `` lines), tokenized
with ``../shared/models/wt2-llama-5m``'s tokenizer, cut into lm-eval's disjoint rolling windows of ``--max-length``
tokens (every window after a document's first reads ``max_length`` tokens of input and scores only its new ones).

Per rank count and batch size it prints max/mean over ranks of

* **tokens**: scored tokens per rank — the figure of the issue. lm-eval gives document ``i`` to rank
  ``i % world_size``; ours assigns distperp's world-size-independent batches
  (:func:`distperp_harness.planning.plan.make_batches` + :func:`~distperp_harness.planning.plan.assign_batches`);
* **compute**: the plan's cost per rank, ``padded * (1 + a * length) + h * scored`` with the model's attention
  and head coefficients (:mod:`distperp_harness.run.runtime`) — what sets the wall time. For lm-eval, each document
  costs its windows with the head on every position (what ``hf`` computes);
* **bound**: the best max/mean any assignment of these whole batches can reach in compute
  (:func:`~distperp_harness.planning.plan.whole_batch_bound`).

Targets: ours <= 1.05 at batch size 1 for 2-64 ranks, and within 5 % of the bound for larger batches.
Then a pure simulation: 1,024 ranks, ``--sim-tokens`` tokens of documents with log-normal lengths fitted to the
WikiText-2 test articles, planned at batch sizes 1 and 8, with its wall time.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from benchmarks.common import SHARED_MODEL, WIKITEXT_TEST, load_articles
from distperp_harness.planning.plan import assign_batches, balance_report, make_batches, round_robin_max_over_mean


@dataclass(frozen=True)
class Windows:
    """Scoring units of a corpus in canonical order: input lengths (non-increasing) and scored tokens."""

    lengths: list[int]
    n_score: list[int]


@dataclass(frozen=True)
class Row:
    """One line of a balance table (max/mean figures; ``bound`` in compute)."""

    ranks: int
    lm_eval_tokens: float
    lm_eval_compute: float
    tokens: float
    compute: float
    bound: float


def corpus_windows(doc_tokens: Sequence[Sequence[int]], prefix: int, max_length: int) -> Windows:
    """distperp's units for rolling windows over ``doc_tokens`` (deduplicated, canonical order: the real table)."""
    from distperp_harness.planning.requests import UnitTable, window_units

    table = UnitTable(u for tokens in doc_tokens for u in window_units(tokens, prefix, max_length))
    return Windows(table.lengths, [u.n_score for u in table.units])


def doc_window_shapes(n_tokens: int, max_length: int) -> list[tuple[int, int]]:
    """``(input length, scored tokens)`` of each rolling window of a document of ``n_tokens`` tokens."""
    shapes = []
    for start in range(0, n_tokens, max_length):
        end = min(start + max_length, n_tokens)
        shapes.append((min(end, max_length), end - start))
    return shapes


def hf_document_cost(n_tokens: int, max_length: int, a: float, h: float) -> float:
    """Compute of one document under lm-eval ``hf``: its windows, the head on every input position."""
    return sum(length * (1.0 + a * length) + h * length for length, _ in doc_window_shapes(n_tokens, max_length))


def balance_rows(
    windows: Windows,
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    batch_size: int,
    a: float,
    h: float,
    max_length: int,
) -> list[Row]:
    """Balance of lm-eval's split and of ours for each rank count, at ``batch_size`` rows per batch."""
    batches = make_batches(windows.lengths, batch_size=batch_size, n_score=windows.n_score)
    hf_costs = [hf_document_cost(n, max_length, a, h) for n in doc_lengths]
    rows = []
    for world in ranks:
        report = balance_report(assign_batches(batches, world, a, h), a, h)
        rows.append(
            Row(
                world,
                round_robin_max_over_mean(doc_lengths, world),
                round_robin_max_over_mean(hf_costs, world),
                report.scored_max_over_mean,
                report.max_over_mean,
                report.best_max_over_mean,
            )
        )
    return rows


def table(rows: Sequence[Row], batch_size: int) -> str:
    """Markdown table of ``rows`` with the target check for ``batch_size``."""
    target = "ours ≤ 1.05" if batch_size == 1 else "ours ≤ 1.05 × bound"
    lines = [
        f"batch size {batch_size}:",
        "",
        f"| ranks | lm-eval tokens | ours tokens | lm-eval compute | ours compute | bound (compute) | {target} |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        ok = r.compute <= 1.05 + 1e-12 if batch_size == 1 else r.compute <= 1.05 * r.bound + 1e-12
        lines.append(
            f"| {r.ranks} | {r.lm_eval_tokens:.3f} | {r.tokens:.3f} | {r.lm_eval_compute:.3f} | "
            f"{r.compute:.3f} | {r.bound:.3f} | {'yes' if ok else 'no'} |"
        )
    return "\n".join(lines)


def synthetic_windows(total_tokens: int, mu: float, sigma: float, max_length: int, seed: int) -> Windows:
    """Windows of log-normal documents (``exp(N(mu, sigma))`` tokens, at least 1) until ``total_tokens``, in
    canonical order (longer input first; ties in a seeded random order, as token content orders them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    docs: list[np.ndarray] = []
    total = 0
    while total < total_tokens:
        draw = np.maximum(1, np.exp(rng.normal(mu, sigma, size=100_000))).astype(np.int64)
        cum = np.cumsum(draw) + total
        keep = draw[: int(np.searchsorted(cum, total_tokens)) + 1]
        docs.append(keep)
        total += int(keep.sum())
    n = np.concatenate(docs)
    k = -(-n // max_length)  # windows per document
    doc_of = np.repeat(np.arange(len(n)), k)
    index = np.arange(len(doc_of)) - np.repeat(np.cumsum(k) - k, k)  # window index within its document
    ends = np.minimum((index + 1) * max_length, n[doc_of])
    lengths = np.minimum(ends, max_length)
    scored = ends - index * max_length
    order = np.lexsort((rng.permutation(len(lengths)), -lengths))
    return Windows(lengths[order].tolist(), scored[order].tolist())


def simulate(windows: Windows, world: int, batch_size: int, a: float, h: float) -> tuple[dict, float]:
    """Plan ``windows`` for ``world`` ranks; the balance report and the planning wall time in seconds."""
    t0 = time.perf_counter()
    batches = make_batches(windows.lengths, batch_size=batch_size, n_score=windows.n_score)
    report = balance_report(assign_batches(batches, world, a, h), a, h)
    return report, time.perf_counter() - t0


def model_coefficients(path: Path) -> tuple[float, float]:
    """``(attention_coef, head_coef)`` of the model at ``path`` (as the pipeline computes them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from distperp_harness.run.runtime import attention_coefficient, head_coefficient

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return attention_coefficient(model), head_coefficient(model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHARED_MODEL), help="tokenizer and cost coefficients (a model folder)")
    p.add_argument("--text", default=str(WIKITEXT_TEST), help="WikiText test.txt")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--ranks", default="2,4,8,16,32,64")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--sim-ranks", type=int, default=1024)
    p.add_argument("--sim-tokens", type=int, default=100_000_000)
    p.add_argument("--sim-batch-sizes", default="1,8")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    articles = load_articles(Path(args.text))
    doc_tokens = [tokenizer.encode(a, add_special_tokens=False) for a in articles]
    doc_lengths = [len(t) for t in doc_tokens]
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    windows = corpus_windows(doc_tokens, prefix, args.max_length)
    a, h = model_coefficients(Path(args.model))
    full = sum(1 for x in windows.lengths if x == args.max_length)
    print(
        f"WikiText-2 test: {len(articles)} articles, {sum(doc_lengths):,} tokens ({Path(args.model).name} "
        f"tokenizer), {len(windows.lengths)} windows at max_length {args.max_length} ({full} with full-length "
        f"input); cost coefficients a = {a:.3g} (attention), h = {h:.3g} (head)\n"
    )
    for batch_size in _ints(args.batch_sizes):
        print(
            table(balance_rows(windows, doc_lengths, _ints(args.ranks), batch_size, a, h, args.max_length), batch_size)
        )
        print()
    logs = [math.log(n) for n in doc_lengths if n > 0]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / (len(logs) - 1))
    t1 = time.perf_counter()
    sim = synthetic_windows(args.sim_tokens, mu, sigma, args.max_length, args.seed)
    made = time.perf_counter() - t1
    print(
        f"Simulation: {args.sim_ranks:,} ranks, {sum(sim.n_score):,} tokens in {len(sim.lengths):,} windows of "
        f"log-normal documents (mu {mu:.2f}, sigma {sigma:.2f}: median {math.exp(mu):,.0f} tokens, fitted to the "
        f"articles above; generated in {made:.1f} s)\n"
    )
    print("| batch size | batches | ours tokens | ours compute | bound (compute) | planning wall time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch_size in _ints(args.sim_batch_sizes):
        report, seconds = simulate(sim, args.sim_ranks, batch_size, a, h)
        print(
            f"| {batch_size} | {report.batches:,} | {report.scored_max_over_mean:.3f} | "
            f"{report.max_over_mean:.3f} | {report.best_max_over_mean:.3f} | {seconds:.2f} s |"
        )
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
