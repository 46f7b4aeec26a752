"""Generation jobs as records: what ranks exchange to plan ``generate_until`` together — fixed-size records and prefix
hashes, never prompt tokens.

Each rank turns the distinct jobs of its own requests into:

* one :data:`JOB` record per job (48 bytes): its 128-bit identity ``key`` (a hash of the prompt text, the generation
  arguments and, for a sampled request, its identity and repeat index), the 128-bit key of its prompt, a 64-bit hash
  of its generation arguments (``group``: a lane never mixes two), its ``max_new`` tokens and whether it samples;
* the records of its distinct prompts (cut to fit ``max_length - max_new``) as scoring has them for units
  (:mod:`distperp_harness.planning.records`: identity, lengths, and a hash per 16-token prefix block).

:class:`JobTable` merges every rank's records into the one canonical job list: ordered by arguments, then by the
prompt's prefix blocks (prompts that share a few-shot block or a chat system prompt sit together: sequences ordered by
their block hashes keep every common run of leading blocks contiguous, as a trie does), then by prompt and key — a
function of the set of jobs only, so the lanes cut from it are the same for 1 process or 1,024. A prompt's tokens then
travel only to the ranks that may compute one of its lanes
(:func:`~distperp_harness.run.execution.routing.move_tokens`).

Per rank this is O(own prompt tokens) plus the records: 48 bytes per job and 8 per 16-token block of each distinct
prompt, where the all-gather of prompts it replaces moved 4 bytes per prompt token to every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from distperp_harness.planning.plan import Plan, assign_batches
from distperp_harness.planning.records import (
    BLOCK,
    FlatUnits,
    GlobalTable,
    HashCollision,
    decode,
    encode,
    local_records,
)
from distperp_harness.run.execution.claims import helper_of
from distperp_harness.run.execution.groups import Workers
from distperp_harness.run.execution.routing import Available, move_tokens
from distperp_harness.run.generation.lanes import LanePlan, plan_lanes

JOB = np.dtype(
    [("key", "<u8", (2,)), ("prompt", "<u8", (2,)), ("group", "<u8"), ("max_new", "<i4"), ("sampled", "<i4")]
)


def key_hex(key: np.ndarray) -> str:
    """A 128-bit key (``uint64 [2]``) as the 32 hex digits it was made from."""
    return np.asarray(key, dtype="<u8").tobytes().hex()


def key_words(hex_key: str) -> np.ndarray:
    """Inverse of :func:`key_hex`."""
    return np.frombuffer(bytes.fromhex(hex_key), dtype="<u8")


def group_hash(kwargs_key: str) -> int:
    """The 64-bit hash of a job's generation arguments (their canonical JSON)."""
    return int.from_bytes(hashlib.blake2b(kwargs_key.encode(), digest_size=8).digest(), "little")


def encode_jobs(prompt_records: tuple[np.ndarray, np.ndarray, np.ndarray], jobs: np.ndarray) -> np.ndarray:
    """A rank's prompt records and job records as one ``uint8`` payload."""
    prompts = encode(*prompt_records)
    head = np.asarray([len(prompts)], dtype="<i8").view(np.uint8)
    return np.concatenate([head, prompts, np.ascontiguousarray(jobs, dtype=JOB).view(np.uint8)])


def decode_jobs(payload: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Inverse of :func:`encode_jobs`."""
    payload = np.ascontiguousarray(payload, dtype=np.uint8)
    n = int(payload[:8].view("<i8")[0])
    return decode(payload[8 : 8 + n]), payload[8 + n :].view(JOB)


@dataclass(frozen=True)
class JobTable:
    """Every rank's job records merged, in canonical order (module docstring).

    Attributes:
        prompts: the :class:`~distperp_harness.planning.records.GlobalTable` of distinct prompts.
        jobs: ``JOB [N]`` in canonical order (a job's index is its place in the lanes).
        prompt_id: per job, its prompt's id in ``prompts``; ``lengths``: its prompt's tokens.
        holder_ptr, holders: CSR lists of the ranks whose requests hold each job (ascending): where its text goes.
    """

    prompts: GlobalTable
    jobs: np.ndarray
    prompt_id: np.ndarray
    lengths: np.ndarray
    holder_ptr: np.ndarray
    holders: np.ndarray

    @classmethod
    def merge(cls, parts: Sequence[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]]) -> "JobTable":
        """The table from every rank's :func:`decode_jobs` payload, in rank order."""
        prompts = GlobalTable([p for p, _ in parts])
        jobs = np.concatenate([j for _, j in parts]) if parts else np.empty(0, JOB)
        rank = (
            np.concatenate([np.full(len(j), r, dtype=np.int32) for r, (_, j) in enumerate(parts)])
            if parts
            else np.empty(0, np.int32)
        )
        order = np.lexsort((rank, jobs["key"][:, 1], jobs["key"][:, 0]))
        jobs, rank = jobs[order], rank[order]
        new = np.ones(len(jobs), dtype=bool)
        new[1:] = (jobs["key"][1:] != jobs["key"][:-1]).any(axis=1)
        same = np.flatnonzero(~new)
        if len(same) and jobs[same].tobytes() != jobs[same - 1].tobytes():
            raise HashCollision(
                "two ranks hold different generation jobs under one 128-bit key; the run stops here "
                "rather than mix their texts"
            )
        firsts = np.flatnonzero(new)
        distinct = jobs[firsts]
        holder_lists = np.split(rank, firsts[1:]) if len(jobs) else []
        prompt_id = prompts.ids(np.ascontiguousarray(distinct["prompt"])) if len(distinct) else np.zeros(0, np.int64)
        lengths = prompts.units["length"][prompt_id].astype(np.int64)
        canonical = sorted(range(len(distinct)), key=lambda j: _order_key(prompts, distinct[j], int(prompt_id[j])))
        holder_lists = [np.unique(holder_lists[j]) for j in canonical]
        counts = np.asarray([len(h) for h in holder_lists], dtype=np.int64)
        return cls(
            prompts,
            distinct[canonical],
            prompt_id[canonical],
            lengths[canonical],
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            np.concatenate(holder_lists).astype(np.int32) if holder_lists else np.zeros(0, np.int32),
        )

    def __len__(self) -> int:
        return len(self.jobs)

    def ladder(self, j: int) -> np.ndarray:
        """The prefix-block hashes of job ``j``'s prompt (``BLOCK``, ``2 BLOCK``, ... tokens of all but its last)."""
        i = int(self.prompts.unit_input[self.prompt_id[j]])
        return self.prompts.ladder[self.prompts.ladder_ptr[i] : self.prompts.ladder_ptr[i + 1]]

    def holders_of(self, jobs: Sequence[int]) -> dict[str, list[int]]:
        """Job key (hex) -> the ranks whose requests hold it, for ``jobs`` (canonical indices)."""
        return {
            key_hex(self.jobs["key"][j]): self.holders[self.holder_ptr[j] : self.holder_ptr[j + 1]].tolist()
            for j in jobs
        }


def _order_key(prompts: GlobalTable, job: np.ndarray, prompt: int) -> tuple:
    """Arguments, the prompt's block hashes, the prompt's own hash and length, then the job key."""
    i = int(prompts.unit_input[prompt])
    ladder = prompts.ladder[prompts.ladder_ptr[i] : prompts.ladder_ptr[i + 1]].tolist()
    unit = prompts.units[prompt]
    return (int(job["group"]), ladder, int(unit["input"]), int(unit["length"]), int(job["key"][0]), int(job["key"][1]))


def ladder_shared(table: JobTable, start: int, stop: int, min_tokens: int) -> tuple[int, int]:
    """``(length, donor)``: the planner's estimate of the prefix the lane of jobs ``start .. stop-1`` computes once,
    to whole ``BLOCK``\\ s (the lane itself finds it exactly from the tokens:
    :func:`~distperp_harness.run.generation.lanes.lane_prefix`, which this mirrors). ``(0, 0)`` under ``min_tokens``."""
    n = stop - start
    if n < 2:
        return 0, 0
    donor = n // 2
    base = table.ladder(start + donor)
    reach = sorted((_shared_tokens(base, table.ladder(j)) for j in range(start, stop)), reverse=True)
    length = reach[max(2, (n + 1) // 2) - 1]
    return (length, donor) if length >= max(1, min_tokens) else (0, 0)


def _shared_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens two prompts share, to whole ``BLOCK``\\ s, from their prefix-block hashes (ladders)."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return (int(differ[0]) if len(differ) else m) * BLOCK


def prefix_groups(table: JobTable, min_tokens: int) -> np.ndarray:
    r"""Each job's prefix (tokens, ``int [jobs]``): its prefix group's, fixed by the job set alone (never by lanes,
    slots or the batching). A group is a maximal run of consecutive jobs (canonical order, equal arguments) whose
    prompts share at least ``min_tokens`` leading tokens with the job before, to whole ``BLOCK``\ s of all but the
    last token; its prefix is what every one of them starts with (the smallest of those shares: the order is the
    prefix blocks', so a run's common prefix is its smallest neighbouring one). Alone in its group, a job's prefix is
    0."""
    n = len(table)
    shares = np.zeros(n, np.int64)  # shares[j]: tokens job j shares with job j - 1 (0: another group)
    groups = table.jobs["group"]
    for j in range(1, n):
        if groups[j] != groups[j - 1]:
            continue
        shares[j] = _shared_tokens(table.ladder(j - 1), table.ladder(j))
    starts = [j for j in range(n) if j == 0 or shares[j] < max(1, min_tokens)]
    prefix = np.zeros(n, np.int64)
    for first, end in zip(starts, [*starts[1:], n]):
        if end - first > 1:
            prefix[first:end] = int(shares[first + 1 : end].min())
    return prefix


def lane_destinations(table: JobTable, lane_of_job: np.ndarray, lane_ranks: np.ndarray) -> np.ndarray:
    """``int [prompts, k]``: the ranks that may compute a lane holding each prompt (``-1``: none), for
    :func:`~distperp_harness.run.execution.routing.move_tokens`. ``lane_ranks``: ``int [lanes, k]`` the ranks that
    may compute each lane (``-1``: none)."""
    n = len(table.prompts)
    pairs = (
        np.stack([np.repeat(table.prompt_id, lane_ranks.shape[1]), lane_ranks[lane_of_job].reshape(-1)], 1)
        if len(table)
        else np.zeros((0, 2), np.int64)
    )
    pairs = np.unique(pairs[pairs[:, 1] >= 0], axis=0)
    counts = np.bincount(pairs[:, 0], minlength=n) if len(pairs) else np.zeros(n, np.int64)
    out = np.full((n, max(1, int(counts.max(initial=0)))), -1, dtype=np.int64)
    column = np.arange(len(pairs)) - np.repeat(np.cumsum(counts) - counts, counts)
    out[pairs[:, 0], column] = pairs[:, 1]
    return out


def kwargs_key_of(gen_kwargs: dict) -> str:
    """The canonical JSON of generation arguments (what groups jobs)."""
    return json.dumps(gen_kwargs, sort_keys=True, default=str)


@dataclass(frozen=True)
class LocalJobs:
    """A rank's distinct jobs: their :data:`JOB` records, their distinct prompts (cut to fit; ``n_score`` 0) and the
    generation arguments of each group it holds."""

    records: np.ndarray
    prompts: FlatUnits
    kwargs: dict[int, dict]


@dataclass(frozen=True)
class Crew:
    """Who computes a part of the lanes: ``workers`` (ranks, or groups of consecutive ranks computing each lane
    together) and ``step``, the claiming helper offset between workers
    (:func:`~distperp_harness.run.execution.claims.helper_step`; 0: no helper)."""

    workers: Workers
    step: int = 0


@dataclass(frozen=True)
class WideCrew:
    """The context-parallel groups' crew: jobs whose prompt has at least ``min_tokens`` tokens go to lanes of their own
    (never mixed with shorter ones), computed by ``crew``'s groups."""

    min_tokens: int
    crew: Crew


@dataclass(frozen=True)
class LanePart:
    """The lanes one crew computes: ``lanes`` (indices into the plan's lanes, ascending), ``plan`` over them (by
    position), ``owners``: ``int [len(lanes), 2]`` each one's owner and helper worker (``-1``: none), ``wide``: the
    context-parallel groups' part."""

    lanes: tuple[int, ...]
    plan: Plan
    owners: np.ndarray
    wide: bool = False

    def lanes_of(self, worker: int) -> list[int]:
        """The plan's indices of the lanes ``worker`` owns, in lane order."""
        return [self.lanes[i] for i in self.plan.batches_of(worker)]


@dataclass(frozen=True)
class GenerationPlan:
    """The global generation plan as every rank has it, and the prompts this rank may compute.

    ``table``: the canonical jobs; ``lanes``: cut from them (:func:`~distperp_harness.run.generation.lanes.plan_lanes`);
    ``parts``: who owns each lane (the context-parallel groups' part first, when there is one); ``available``: the
    prompt tokens of every lane this rank may compute (its own and, when claiming, its ward's), by prompt id;
    ``seed``: rank 0's; ``kwargs_of``: group hash -> generation arguments.
    """

    table: JobTable
    lanes: list[LanePlan]
    parts: list[LanePart]
    available: Available
    seed: int
    kwargs_of: dict[int, dict]


@dataclass(frozen=True)
class LaneAssignment:
    """The lanes of a merged job table and who computes them (the same on every rank: pure): ``parts`` (the wide
    one first), ``ranks``: ``int [lanes, k]`` the ranks that may compute each lane (``-1`` pads), ``lane_of_job``:
    ``int [jobs]`` each job's lane, in the table's job order."""

    lanes: list[LanePlan]
    parts: list[LanePart]
    ranks: np.ndarray
    lane_of_job: np.ndarray


def _part(lanes: Sequence[LanePlan], ids: Sequence[int], crew: Crew, wide: bool) -> LanePart:
    count = crew.workers.count
    plan = assign_batches([lanes[i].as_batch() for i in ids], count)
    owner = np.asarray(plan.owner, dtype=np.int64)
    helper = [helper_of(o, count, crew.step) for o in owner] if crew.step else np.full_like(owner, -1)
    pairs = np.stack([owner, np.asarray(helper, np.int64)], 1) if len(owner) else np.zeros((0, 2), np.int64)
    return LanePart(tuple(ids), plan, pairs, wide)


def assign_lanes(
    table: JobTable,
    rows_for: Callable[[int], int],
    min_shared: int,
    crew: Crew,
    fixed_prefixes: bool = False,
    wide: WideCrew | None = None,
) -> LaneAssignment:
    """Plan ``table``'s lanes (rows by ``rows_for``, shared prefixes of ``min_shared`` tokens or more) and their
    owners among ``crew``'s workers. ``fixed_prefixes`` (batch-invariant generation): each job continues its
    :func:`prefix_groups` prefix (``LanePlan.prefixes``) in whatever lane it lands, so that its bits do not follow
    the batching. ``wide``: jobs whose prompt has ``wide.min_tokens`` tokens or more go to lanes of their own, owned by
    ``wide.crew``'s groups (by the same rule over those lanes alone); the other lanes are cut and owned as without
    groups, except that a wide job ends the lane before it."""
    jobs = table.jobs
    lengths = table.lengths.tolist()
    alone = None if wide is None else (lambda j: lengths[j] >= wide.min_tokens)
    lanes = plan_lanes(
        lengths,
        jobs["group"].tolist(),
        jobs["max_new"].tolist(),
        rows_for,
        lambda a, b: ladder_shared(table, a, b, min_shared),
        wide=alone,
    )
    if fixed_prefixes:
        fixed = prefix_groups(table, min_shared)
        lanes = [dataclasses.replace(lane, prefixes=tuple(fixed[lane.start : lane.stop].tolist())) for lane in lanes]
    taken = [i for i, lane in enumerate(lanes) if alone is not None and alone(lane.start)]
    rest = [i for i in range(len(lanes)) if alone is None or not alone(lanes[i].start)]
    parts = [_part(lanes, taken, wide.crew, True)] if wide is not None and taken else []
    if rest or not parts:
        parts.append(_part(lanes, rest, crew, False))
    crews = [wide.crew if part.wide and wide is not None else crew for part in parts]
    width = max(2 * c.workers.tp for c in crews)
    ranks = np.full((len(lanes), width), -1, dtype=np.int64)
    for part, c in zip(parts, crews):
        if part.lanes:
            got = c.workers.ranks(part.owners)
            ranks[list(part.lanes), : got.shape[1]] = got
    lane_of_job = np.repeat(np.arange(len(lanes)), [lane.jobs for lane in lanes]).astype(np.int64)
    return LaneAssignment(lanes, parts, ranks, lane_of_job)


def plan_generation(  # noqa: PLR0913 - the run's group, its jobs, and the rules and crews it plans with
    collective,
    local: LocalJobs,
    seed: int,
    rows_for: Callable[[int], int],
    min_shared: int,
    crew: Crew | None = None,
    fixed_prefixes: bool = False,
    wide: WideCrew | None = None,
) -> GenerationPlan:
    """Exchange records, plan lanes and their owners, and move each prompt to the ranks that may compute its lanes
    (every rank calls this together). ``crew``: who computes lanes (a tensor-parallel group is one worker, its every
    member receives the prompts; default: every rank, no helper); ``fixed_prefixes``, ``wide``: see
    :func:`assign_lanes`."""
    small = collective.all_gather_object((seed, local.kwargs), "gather generation arguments")
    kwargs_of = {group: kw for _, part in small for group, kw in part.items()}
    records = local_records(local.prompts)
    parts = collective.all_gather_tensor(
        torch.from_numpy(encode_jobs(records, local.records)), "exchange generation job records"
    )
    table = JobTable.merge([decode_jobs(p.numpy()) for p in parts])
    crew = crew or Crew(Workers(collective.world_size))
    assigned = assign_lanes(table, rows_for, min_shared, crew, fixed_prefixes, wide)
    available = move_tokens(
        collective,
        table.prompts,
        lane_destinations(table, assigned.lane_of_job, assigned.ranks),
        local.prompts,
        table.prompts.ids(records[0]["key"]),
    )
    return GenerationPlan(table, assigned.lanes, assigned.parts, available, small[0][0], kwargs_of)
