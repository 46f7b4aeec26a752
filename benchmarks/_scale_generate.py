"""``python -m benchmarks.scale --generate``: generation start-up per rank at 8 to 1,024 ranks (records exchange,
lane planning and prompt routing, simulated).

    python -m benchmarks.scale --generate                          # full size, W = 8, 64, 1024
    python -m benchmarks.scale --generate --fraction 0.05 --ranks 8,64   # quick

Builds synthetic ``generate_until`` requests of full size (token counts and sharing structure, random token ids):

* **IFEval** (0-shot, chat template): 541 prompts of ~150 tokens after a 24-token system prompt; 1,280 new tokens;
* **GSM8K CoT** (lm-eval's 8 fixed exemplars): 1,319 prompts, an ~880-token block and ~70 tokens of their own;
* **MATH** (4 fixed exemplars, 7 subjects): 5,000 prompts, a ~650-token block and ~90 of their own; 1,024 new;
* **BBH CoT** (3 fixed exemplars per subtask, 27 subtasks): 6,511 prompts, blocks of ~800 tokens, ~100 of their own.

splits every subtask's documents as lm-eval does (``docs[rank::W]``) and runs, for rank 0 (the largest share), what
:func:`distperp_harness.run.generation.jobs.plan_generation` runs: its records, the merge of every rank's real encoded
payload (handed over by the simulation), the lane plan, the owners and helpers, and the routes of prompt tokens. Printed
for rank 0: bytes received (records / prompt tokens, front-coded as its senders send them), and what the all-gather of
every prompt's tokens it replaced moved to each rank; peak traced memory and CPU seconds of those steps. Generated texts
travel back only to the ranks whose requests asked for them (not simulated here).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace

import numpy as np

from benchmarks.common import cpu_and_peak
from distperp_harness.planning.records import FlatUnits, local_records
from distperp_harness.run.execution.claims import helper_step
from distperp_harness.run.execution.groups import Workers
from distperp_harness.run.execution.routing import front_coded, token_routes
from distperp_harness.run.generation.jobs import (
    JOB,
    Crew,
    JobTable,
    assign_lanes,
    decode_jobs,
    encode_jobs,
    lane_destinations,
)

TOKEN_BUDGET = 262_144  # KV tokens the slots of a lane may hold (an 8B model on an 80 GB GPU, roughly)


@dataclass(frozen=True)
class Shape:
    """``subtasks`` of ``docs`` prompts; each is a per-subtask block of ``shared`` tokens and ``own`` of its own."""

    name: str
    subtasks: int
    docs: int
    shared: int
    own: int
    max_new: int


SHAPES = {
    "ifeval": Shape("IFEval", 1, 541, 24, 150, 1280),
    "gsm8k_cot": Shape("GSM8K CoT", 1, 1319, 880, 70, 256),
    "math": Shape("MATH 4-shot", 7, 5000, 650, 90, 1024),
    "bbh_cot": Shape("BBH CoT 3-shot", 27, 6511, 800, 100, 256),
}


def rows_for(length: int) -> int:
    return max(1, min(64, TOKEN_BUDGET // max(1, length)))


def rank_jobs(shape: Shape, rank: int, world: int):
    """``(records, prompts)`` of the jobs lm-eval's split gives ``rank`` (greedy; one argument group per subtask)."""
    counts = np.full(shape.subtasks, shape.docs // shape.subtasks)
    counts[0] += shape.docs - counts.sum()
    prompts, meta = [], []
    for task, count in enumerate(counts.tolist()):
        block = np.random.default_rng([task, 7]).integers(10, 120000, shape.shared, dtype=np.int32)
        for doc in range(rank, count, world):
            rng = np.random.default_rng([task, doc])
            own = rng.integers(10, 120000, max(5, shape.own + int(rng.integers(-30, 31))), dtype=np.int32)
            prompts.append(np.concatenate([[1], block, own]).astype(np.int32))
            meta.append((task, doc))
    lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
    flat = FlatUnits(
        np.concatenate(prompts) if prompts else np.zeros(0, np.int32),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.zeros(len(prompts), np.int32),
    )
    records = np.zeros(len(prompts), dtype=JOB)
    if len(prompts):
        records["key"] = flat.keys() ^ np.uint64(0x5DEECE66D)  # a job key besides the prompt's
        records["prompt"] = flat.keys()
        records["group"] = [1000 + task for task, _ in meta]
        records["max_new"] = shape.max_new
    return records, flat


def simulate(shape: Shape, world: int, local_world: int = 8) -> dict:
    """What rank 0 receives, holds and computes to plan generation at ``world`` ranks."""
    payloads, all_tokens = [], 0
    for r in range(1, world):
        records, flat = rank_jobs(shape, r, world)
        payloads.append(encode_jobs(local_records(flat), records))
        all_tokens += len(flat.tokens)
    own_records, own = rank_jobs(shape, 0, world)
    step = helper_step(world, local_world)

    def start_up():
        records = local_records(own)
        table = JobTable.merge([decode_jobs(p) for p in [encode_jobs(records, own_records), *payloads]])
        assigned = assign_lanes(table, rows_for, 32, Crew(Workers(world), step))
        destinations = lane_destinations(table, assigned.lane_of_job, assigned.ranks)
        _, expect = token_routes(table.prompts, destinations, 0, world)
        lanes, plan = assigned.lanes, assigned.parts[0].plan
        return table, lanes, plan, expect

    cpu, peak, (table, lanes, plan, expect) = cpu_and_peak(start_up)
    tokens_in = 0
    for source, ids in enumerate(expect):
        if len(ids):
            theirs = rank_jobs(shape, source, world)[1]
            position = np.full(len(table.prompts), -1, dtype=np.int64)
            position[table.prompts.ids(theirs.keys())] = np.arange(len(theirs))
            tokens_in += 4 * len(front_coded(theirs, position[ids], ids))
    records_in = sum(len(p) for p in payloads)
    return {
        "shape": shape.name,
        "world": world,
        "jobs": len(table),
        "lanes": len(lanes),
        "prompt_mtok": (all_tokens + len(own.tokens)) / 1e6,
        "records_mb": records_in / 1e6,
        "tokens_mb": tokens_in / 1e6,
        "received_mb": (records_in + tokens_in) / 1e6,
        "all_gather_mb": 4 * all_tokens / 1e6,
        "peak_mb": peak / 1e6,
        "cpu_s": cpu,
        "own_lanes": sum(1 for o in plan.owner if o == 0),
    }


def print_table(args: argparse.Namespace) -> None:
    """The generation table for ``args.shapes`` (of :data:`SHAPES`) at ``args.ranks``, ``args.fraction`` of the prompts.

    Raises:
        SystemExit: a shape name not in :data:`SHAPES`, naming the ones there are.
    """
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes {','.join(unknown)}: with --generate, use {', '.join(SHAPES)}")
    print(
        "| evaluation | W | jobs | prompt Mtok | lanes (rank 0's) | received by rank 0, MB (records / tokens) | "
        "all-gather of prompts, MB | peak MB | CPU s |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for name in names:
        shape = SHAPES[name]
        if args.fraction != 1.0:
            shape = dataclasses_replace(shape, docs=max(shape.subtasks * 2, int(shape.docs * args.fraction)))
        for world in (int(w) for w in args.ranks.split(",")):
            row = simulate(shape, world)
            print(
                f"| {row['shape']} | {world} | {row['jobs']} | {row['prompt_mtok']:.2f} | {row['lanes']} "
                f"({row['own_lanes']}) | {row['received_mb']:.2f} ({row['records_mb']:.2f} / "
                f"{row['tokens_mb']:.2f}) | {row['all_gather_mb']:.2f} | {row['peak_mb']:.0f} | "
                f"{row['cpu_s']:.2f} |",
                flush=True,
            )
