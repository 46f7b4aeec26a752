"""Start-up per rank at 8 to 1,024 ranks: the project's own records exchange, planning and routing, simulated.

    python -m benchmarks.scale                       # full size, W = 8, 64, 1024 (a few minutes on 2 cores)
    python -m benchmarks.scale --fraction 0.02 --ranks 8,64   # the small configuration make test runs
    python -m benchmarks.scale --generate            # generate_until shapes (IFEval, GSM8K CoT, MATH, BBH CoT)

``--generate`` runs the same measurement for ``generate_until`` requests (:mod:`benchmarks._scale_generate`; it was
``scale_generate.py``): rank 0's records and prompt tokens received against the all-gather of prompts they replaced.
Without it:

Builds synthetic requests of full size (token counts and sharing structure, random token ids):

* **MMLU 5-shot**: 57 subjects, 14,042 questions, one few-shot block per subject, 4 one-token answers; ~760 tokens
  per prompt (42.7M tokens in all);
* **MMLU-Pro 5-shot**: 14 categories, 12,032 questions, 10 one-token answers; ~1,420 tokens per prompt;
* **HellaSwag** (0-shot): 10,042 contexts of ~60 tokens, 4 endings of ~45 tokens (multi-token answers);

splits the documents of every subtask as lm-eval does (``docs[rank::W]``), and for each W runs, for the rank with the
largest share (rank 0 under lm-eval's split), exactly what :func:`distperp_harness.run.scoring.pipeline.score_requests`
runs before scoring: its records (:func:`~distperp_harness.planning.records.local_records`), the exchange (every
rank's real encoded payload, handed over by a collective that simulates the W ranks), the merge
(:class:`~distperp_harness.planning.records.GlobalTable`), the plan (rows, batches, owners, helpers) and the routes of
tokens and results (:func:`~distperp_harness.run.execution.routing.token_routes`,
:func:`~distperp_harness.run.execution.routing.result_routes`). Printed: input tokens and the tokens the plan computes
(padded, shared prefixes once; millions), and for that rank: bytes received (records / tokens, as its senders front-code
them / results), peak traced memory and CPU seconds of those steps, and the number of batches against W (fewer batches
than ranks: idle ranks).

Targets, MMLU 5-shot: W = 64: <= 0.5 s CPU, <= 200 MB, <= 20 MB received; W = 1,024: <= 30 MB received.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import numpy as np

from benchmarks import _scale_generate
from benchmarks.common import cpu_and_peak
from distperp_harness.planning.plan import assign_batches
from distperp_harness.planning.records import FlatUnits, GlobalTable, decode, encode, local_records
from distperp_harness.planning.rowplan import batch_shared, plan_from_records
from distperp_harness.run.execution.claims import helper_of, helper_step
from distperp_harness.run.execution.routing import front_coded, result_routes, token_routes
from distperp_harness.run.rules import Batching
from distperp_harness.run.scoring.engine.forward import N_COLUMNS

MAX_LENGTH = 4096
ATTENTION_COEF = 32 * 4096 / 8.0e9  # an 8B Llama: layers * hidden / parameters
TARGETS = {("mmlu5", 64): (0.5, 200e6, 20e6), ("mmlu5", 1024): (None, None, 30e6)}


@dataclass(frozen=True)
class Shape:
    """``subtasks`` of ``docs`` documents in all; each prompt is a per-subtask shared block of ``shared`` tokens and
    ``own`` tokens of its own; ``answers`` answers of ``answer`` tokens each (``n_score = answer``)."""

    name: str
    subtasks: int
    docs: int
    shared: int
    own: int
    answers: int
    answer: int


SHAPES = {
    "mmlu5": Shape("MMLU 5-shot", 57, 14042, 560, 200, 4, 1),
    "mmlupro5": Shape("MMLU-Pro 5-shot", 14, 12032, 1200, 220, 10, 1),
    "hellaswag": Shape("HellaSwag", 1, 10042, 0, 60, 4, 45),
}


def subtask_docs(shape: Shape) -> list[int]:
    """Documents per subtask (uneven, as MMLU's subjects are), summing to ``shape.docs``."""
    rng = np.random.default_rng(1)
    weights = rng.lognormal(0.0, 0.6, shape.subtasks)
    counts = np.maximum(1, np.floor(weights / weights.sum() * shape.docs)).astype(int)
    counts[0] += shape.docs - counts.sum()
    return counts.tolist()


def rank_units(shape: Shape, counts: list[int], rank: int, world: int) -> FlatUnits:
    """The distinct units lm-eval's split gives ``rank``: documents ``rank::world`` of every subtask."""
    pieces, n_score = [], []
    for task, count in enumerate(counts):
        block = np.random.default_rng([task, 7]).integers(10, 120000, shape.shared, dtype=np.int32)
        for doc in range(rank, count, world):
            rng = np.random.default_rng([task, doc])
            own = rng.integers(10, 120000, shape.own + (rng.integers(-20, 21) if shape.own > 40 else 0), dtype=np.int32)
            for _a in range(shape.answers):
                answer = rng.integers(
                    10,
                    120000,
                    max(1, shape.answer + (rng.integers(-15, 16) if shape.answer > 20 else 0)),
                    dtype=np.int32,
                )
                pieces.append(np.concatenate([[1], block, own, answer]).astype(np.int32))
                n_score.append(len(answer))
    lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
    return FlatUnits(
        np.concatenate(pieces) if pieces else np.zeros(0, np.int32),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.asarray(n_score, np.int32),
    )


def simulate(shape: Shape, world: int, batch_size: int, local_world: int = 8) -> dict:
    """One evaluation at ``world`` ranks: what the rank with the largest share receives, holds and computes."""
    counts = subtask_docs(shape)
    payloads = []
    for r in range(world):
        if r == 0:
            continue
        payloads.append(encode(*local_records(rank_units(shape, counts, r, world))))
    own_units = rank_units(shape, counts, 0, world)

    def start_up():
        """What rank 0 runs before scoring (pipeline.score_requests' steps)."""
        records = local_records(own_units)
        mine = encode(*records)
        table = GlobalTable([decode(p) for p in [mine, *payloads]])  # the simulated all-gather hands these over
        planned = plan_from_records(table, "prefix", MAX_LENGTH, ATTENTION_COEF)
        batches = Batching(batch_size).batches(planned.lengths.tolist(), planned.scored.tolist(), planned.group_starts)
        batches = [dataclasses.replace(b, shared=batch_shared(planned, b.start, b.stop)) for b in batches]
        plan = assign_batches(batches, world, ATTENTION_COEF)
        owner = np.asarray(plan.owner, dtype=np.int64)
        step = helper_step(world, local_world)
        ranks = np.stack([owner, [helper_of(o, world, step) for o in owner]], 1) if world > 1 else owner[:, None]
        unit_batch = np.empty(len(table), dtype=np.int64)
        for b, batch in enumerate(batches):
            for r in range(batch.start, batch.stop):
                unit_batch[planned.members[r]] = b
        table.ids(records[0]["key"])
        _, expect_tokens = token_routes(table, ranks[unit_batch], 0, world)
        _, expect_results = result_routes(table, unit_batch, owner, 0, world)
        return table, batches, expect_tokens, expect_results

    cpu, peak, (table, batches, expect_tokens, expect_results) = cpu_and_peak(start_up)
    lengths = table.units["length"].astype(np.int64)
    token_in = 0  # the messages rank 0 receives, as its senders encode them
    for source, ids in enumerate(expect_tokens):
        if len(ids):
            theirs = rank_units(shape, counts, source, world)
            position = np.full(len(table), -1, dtype=np.int64)
            position[table.ids(theirs.keys())] = np.arange(len(theirs))
            token_in += 4 * len(front_coded(theirs, position[ids], ids))
    result_in = (N_COLUMNS + 1) * 8 * sum(len(ids) for ids in expect_results)
    records_in = sum(len(p) for p in payloads)
    input_tokens = int(lengths.sum())
    return {
        "shape": shape.name,
        "world": world,
        "units": len(table),
        "tokens": input_tokens,
        "batches": len(batches),
        "computed_mtok": sum(b.padded_tokens for b in batches) / 1e6,
        "largest_batch_mtok": max(b.padded_tokens for b in batches) / 1e6,
        "records_mb": records_in / 1e6,
        "tokens_mb": token_in / 1e6,
        "results_mb": result_in / 1e6,
        "received_mb": (records_in + token_in + result_in) / 1e6,
        "peak_mb": peak / 1e6,
        "cpu_s": cpu,
        "own_units": len(own_units),
        "unit_tokens_mb": 4 * sum(int(lengths[ids].sum()) for ids in expect_tokens) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,64,1024")
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"default: all of {', '.join(SHAPES)}; with --generate all of {', '.join(_scale_generate.SHAPES)}",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch (scoring shapes)")
    parser.add_argument("--fraction", type=float, default=1.0, help="scale the document counts (for a quick run)")
    parser.add_argument("--generate", action="store_true", help="the generate_until shapes instead of scoring's")
    args = parser.parse_args(argv)
    if args.generate:
        args.shapes = args.shapes or ",".join(_scale_generate.SHAPES)
        _scale_generate.print_table(args)
        return 0
    args.shapes = args.shapes or ",".join(SHAPES)
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes {','.join(unknown)}: use {', '.join(SHAPES)} (or --generate for generation shapes)")
    failed = []
    print(
        f"{'evaluation':16} {'W':>5} {'units':>8} {'Mtok':>7} {'planned':>8} {'batches':>8} "
        f"{'recv MB (records/tokens/results)':>34} {'peak MB':>8} {'CPU s':>6}"
    )
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        if args.fraction != 1.0:
            shape = dataclasses.replace(shape, docs=max(shape.subtasks, int(shape.docs * args.fraction)))
        for world in (int(w) for w in args.ranks.split(",")):
            row = simulate(shape, world, args.batch_size)
            idle = " (ranks idle: fewer batches than ranks)" if row["batches"] < world else ""
            print(
                f"{row['shape']:16} {world:>5} {row['units']:>8} {row['tokens'] / 1e6:>7.1f} "
                f"{row['computed_mtok']:>8.2f} {row['batches']:>8} "
                f"{row['received_mb']:>8.1f} ({row['records_mb']:.1f} / {row['tokens_mb']:.1f} / "
                f"{row['results_mb']:.2f}){'':>6} {row['peak_mb']:>8.0f} {row['cpu_s']:>6.2f}{idle}",
                flush=True,
            )
            target = TARGETS.get((name, world)) if args.fraction == 1.0 else None
            if target:
                for value, limit, what in (
                    (row["cpu_s"], target[0], "CPU s"),
                    (row["peak_mb"] * 1e6, target[1], "memory"),
                    (row["received_mb"] * 1e6, target[2], "received"),
                ):
                    if limit is not None and value > limit:
                        failed.append(f"{row['shape']} W={world}: {what} {value:.3g} > {limit:.3g}")
    for line in failed:
        print("TARGET MISSED:", line)
    if not failed and args.fraction == 1.0:
        print("all targets met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
