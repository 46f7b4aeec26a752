"""One scoring call across all processes: records → one plan → tokens to computers → claim and score → results back.

Every rank passes the units of the requests lm-eval gave it (its round-robin share plus padding copies) and:

1. turns its distinct units into fixed-size records and prefix hashes (:mod:`distperp_harness.planning.records`) and
   exchanges those, never tokens; every rank merges them into the same canonical table;
2. plans rows (:mod:`distperp_harness.planning.rowplan`), world-size-independent batches and their owners from the table
   alone;
3. sends each unit's tokens only to the ranks that may compute it
   (:func:`~distperp_harness.run.execution.routing.move_tokens`);
4. computes the batches it takes through the :class:`~distperp_harness.run.execution.executor.Executor` (claims: its
   own, then its ward's; resume; the failure channel; a shard group's steps; a tensor-parallel group as one worker of
   the plan, its leader reporting), each row built exactly from its units' tokens
   (:func:`~distperp_harness.planning.rows.row_of`);
5. sends each unit's float64 results to the ranks that hold it
   (:func:`~distperp_harness.run.execution.routing.return_results`) and assembles its own requests in a fixed order.

Rows, batches and their numbers depend only on the set of units: the same bits on 1 process or N, whichever rank
computes a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from distperp_harness.planning.plan import Batch, assign_batches, balance_report
from distperp_harness.planning.records import FlatUnits, GlobalTable, HashCollision, decode, encode, local_records
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rowplan import PlannedRows, batch_shared, plan_from_records
from distperp_harness.planning.rows import Row, ShareMode, row_of, shared_prefix, unit_rows
from distperp_harness.run.execution.calls import RankShare, RunStats, ScoringCall
from distperp_harness.run.execution.claims import helper_of
from distperp_harness.run.execution.executor import Executor
from distperp_harness.run.execution.routing import move_tokens, return_results
from distperp_harness.run.rules import ScoringRule
from distperp_harness.run.scoring.engine.forward import GREEDY, LL, N_COLUMNS, N_TOKENS, REF_LL, TOP1


def _forward_calls(executor: Executor, batches: Sequence[Batch], b: int) -> int:
    """Forward calls of each model for batch ``b`` (what a shard group's idle members match)."""
    return executor.forward_calls(batches[b].stop - batches[b].start, batches[b].shared)


@dataclass(frozen=True)
class RequestResult:
    """Aggregated result of one request: sums over its units in float64."""

    loglikelihood: float
    is_greedy: bool
    n_tokens: int
    ref_loglikelihood: float | None = None
    top1_agree: int | None = None
    kl: np.ndarray | None = None


Progress = Callable[[int], None]


def score_requests(  # noqa: PLR0913 - keyword-only hooks, each optional
    per_request_units: Sequence[Sequence[Unit]],
    executor: Executor,
    rule: ScoringRule,
    *,
    kind: str = "score",
    stats: RunStats | None = None,
    progress: Callable[[int], Progress] | None = None,
    log: Callable[[str], None] | None = None,
    prepare: Callable[[bool], None] | None = None,
) -> list[RequestResult]:
    """Score this rank's requests as part of the global plan; every rank must call this together.

    Args:
        per_request_units: for each local request, its units in order (an empty list scores nothing).
        executor: runs the batches this rank takes (:class:`~distperp_harness.run.execution.executor.Executor`: claims,
            resume, the failure channel, a shard group's steps); its forwards' statistics are per unit, in row order.
        rule: how rows, batches and costs are planned; batches hold ``rule.batching`` rows each.
        stats: when given, the call's :class:`~distperp_harness.run.execution.calls.ScoringCall` is appended (with every
            rank's :class:`~distperp_harness.run.execution.calls.RankFacts`) and the fingerprint takes every unit's
            results.
        progress: given the number of tokens this rank is planned to score (the results' ``n_tokens``), returns
            an update callback.
        log: where rank 0's notes about the plan go (idle ranks).
        prepare: called on every rank, together, once the global plan is known, with whether any batch computed
            without a shared prefix cache has a row of several units (tree rows; compiling warms their graph then).

    Returns:
        One :class:`RequestResult` per local request, identical bits for every world size.
    """
    t0 = time.perf_counter()
    collective, sharing, with_reference = executor.collective, rule.sharing, rule.with_reference
    received_before = getattr(collective, "bytes_received", 0)
    me = collective.rank
    local = list({u.key(): u for units in per_request_units for u in units}.values())
    flat = FlatUnits.of(local)
    records = local_records(flat)
    if len(np.unique(records[0]["key"], axis=0)) != len(local):
        raise HashCollision(f"rank {me} holds two different units under one 128-bit key")
    parts = collective.all_gather_tensor(torch.from_numpy(encode(*records)), "exchange unit records")
    t_met = time.perf_counter()  # every rank has arrived: what follows is the call's own pace
    table = GlobalTable([decode(p.numpy()) for p in parts])
    local_ids = table.ids(records[0]["key"])
    index_of = {u.key(): int(i) for u, i in zip(local, local_ids)}

    planned = plan_from_records(table, sharing.mode, sharing.max_row_length, rule.attention_coef)
    batches = rule.batching.batches(planned.lengths.tolist(), planned.scored.tolist(), planned.group_starts)
    if sharing.mode == ShareMode.PREFIX and sharing.cached_prefix:
        batches = [dataclasses.replace(b, shared=batch_shared(planned, b.start, b.stop)) for b in batches]
    if prepare is not None:
        prepare(
            sharing.mode == ShareMode.PREFIX
            and any(len(planned.members[r]) > 1 for b in batches if not b.shared for r in range(b.start, b.stop))
        )
    workers = executor.workers  # a tensor-parallel group is one worker; without TP a worker is a rank
    plan = assign_batches(batches, workers.count, rule.attention_coef, rule.head_coef)
    step = executor.step
    owner = np.asarray(plan.owner, dtype=np.int64)
    ranks = workers.ranks(
        np.stack([owner, [helper_of(o, workers.count, step) for o in owner] if step else np.full_like(owner, -1)], 1)
        if len(owner)
        else np.zeros((0, 2), np.int64)
    )
    unit_batch = np.empty(len(table), dtype=np.int64)
    for b, batch in enumerate(batches):
        for r in range(batch.start, batch.stop):
            unit_batch[planned.members[r]] = b
    available = move_tokens(collective, table, ranks[unit_batch], flat, local_ids)
    t_plan = time.perf_counter() - t0
    if log is not None and me == 0 and len(batches) < workers.count:
        log(
            f"{kind}: {len(batches)} batches for {workers.count} workers: {workers.count - len(batches)} have no "
            f"batch (batches never depend on the number of processes; batch_size="
            f"{max(1, len(planned.members) // workers.count)} or smaller would give every worker one)"
        )

    scored = np.bincount(unit_batch, weights=table.units["n_score"], minlength=len(batches)).astype(np.int64)
    update = progress(int(sum(scored[i] for i in plan.batches_of(executor.worker)))) if progress else None
    prefix = f"distperp/claims/{collective.sequence}"
    claims = executor.claims(plan.batches_of, prefix)
    computed: dict[int, tuple[np.ndarray, int, np.ndarray | None]] = {}
    done: list[int] = []
    mark = 0  # the sum of this rank's unit marks (:func:`unit_mark`)
    local_checks = flat.check_hashes()
    checks = available.check_hashes(local_checks)
    tokens_here = 0
    for b in executor.batches(claims, functools.partial(_forward_calls, executor, batches), prefix):
        batch = batches[b]
        rows = [_build_row(planned, r, available, sharing.mode) for r in range(batch.start, batch.stop)]
        shared = shared_prefix(rows) if batch.shared else 0
        _check_against_plan(planned, batch, rows, shared, sharing.mode)
        scores = executor.score(rows, shared)
        if not executor.reports:
            continue  # a tensor-parallel member: its leader reports the same bits and counts the tokens
        if scores is None:  # Executor.score: only a member that does not report gets None
            raise RuntimeError(f"internal error: no scores for batch {b} on a rank that reports them")
        tokens_here += shared + sum(row.length - shared for row in rows)
        if update:
            update(int(scored[b]))  # the tokens the results count (n_tokens), as the bar's total does
        ids = [uid for row in rows for uid in row.unit_ids]
        kl = scores.kl_rows() if with_reference else [None] * len(ids)
        for j, uid in enumerate(ids):
            computed[uid] = (scores.stats[j], checks[uid], kl[j])
            mark += unit_mark(uid, scores.stats[j])
        done.append(b)
    t_score = time.perf_counter() - t0
    share = RankShare(me, len(done), claims.taken_from_ward, round(t_score - t_plan, 4), tokens_here)
    everyone = collective.all_gather_object((done, share, mark), "gather which batches each rank computed")
    computer = np.full(len(batches), -1, dtype=np.int64)
    for rank, (part, _, _) in enumerate(everyone):
        computer[np.asarray(part, dtype=np.int64)] = rank
    if (computer < 0).any():
        raise RuntimeError("internal error: some batches of the plan were not computed by any rank")
    results = return_results(
        collective, table, unit_batch, computer, computed, local_ids, local_checks, N_COLUMNS, with_reference
    )
    out = [_assemble([results[index_of[u.key()]] for u in units], with_reference) for units in per_request_units]
    if stats is not None:
        stats._digest.update((sum(m for _, _, m in everyone) % (1 << 8 * MARK_BYTES)).to_bytes(MARK_BYTES, "little"))
        balance = balance_report(plan, rule.attention_coef, rule.head_coef)
        per_rank = [s for _, s, _ in everyone]
        tokens = sum(s.tokens or 0 for s in per_rank)  # a scoring share always counts its tokens
        input_tokens = int((table.units["length"].astype(np.int64) - 1).sum())
        stats.calls.append(
            ScoringCall(
                kind=kind,
                units=len(table),
                rows=len(planned.members),
                share_mode=sharing.mode,
                computed_tokens=tokens,
                tokens_saved=input_tokens - tokens,
                contexts=len(np.unique(table.units["context"])),
                row_groups=len(planned.group_starts),
                batches=len(batches),
                batches_sharing_a_prefix=sum(1 for b in batches if b.shared),
                scored_tokens=int(table.units["n_score"].astype(np.int64).sum()),
                padded_tokens_per_rank=balance.padded_tokens_per_rank,
                max_over_mean=balance.max_over_mean,
                best_max_over_mean=balance.best_max_over_mean,
                scored_max_over_mean=balance.scored_max_over_mean,
                claiming=executor.claiming_mode,
                per_rank=per_rank,
                planning_seconds=t_plan,
                scoring_seconds=t_score,
                total_seconds=time.perf_counter() - t0,
                seconds_after_arrival=time.perf_counter() - t_met,
                facts=executor.facts(received_before),
                max_batch_rows=max((b.stop - b.start for b in batches), default=0),
            )
        )
    return out


MARK_BYTES = 16


def unit_mark(uid: int, stats: np.ndarray) -> int:
    """A unit's mark: a 128-bit hash of its id (its place in the call's canonical unit order) and its results. The
    call's fingerprint is the sum of all marks: equal exactly when every unit's results are (up to a hash
    collision), whichever batch, rank or order computed them, and each rank adds only its own units."""
    return int.from_bytes(
        hashlib.blake2b(
            int(uid).to_bytes(8, "little") + np.ascontiguousarray(stats).tobytes(), digest_size=MARK_BYTES
        ).digest(),
        "little",
    )


def _check_against_plan(planned: PlannedRows, batch: Batch, rows: Sequence[Row], shared: int, mode: ShareMode) -> None:
    """The rows built from tokens are what the plan promised: no longer than planned, one path each where masks are
    not allowed, and sharing at least the planned prefix (shard groups count forward calls from the plan). Only a
    collision of prefix hashes breaks this; the run then stops rather than compute something else."""
    for r, row in zip(range(batch.start, batch.stop), rows):
        if row.length > planned.lengths[r] or (mode != ShareMode.PREFIX and row.packed):
            raise HashCollision(
                f"row {r} holds {row.length} tokens ({len(row.runs)} runs) where its plan allows "
                f"{planned.lengths[r]} ({mode}): prefix hashes collided"
            )
    if shared < batch.shared:
        raise HashCollision(
            f"the rows of a batch share {shared} tokens where the plan counted on {batch.shared}: "
            "prefix hashes collided"
        )


def _build_row(planned: PlannedRows, r: int, available, mode: ShareMode) -> Row:
    ids = planned.members[r]
    units = [available.unit(int(i)) for i in ids]
    if mode == ShareMode.OFF:
        return unit_rows(units, int(ids[0]))[0]
    return row_of(units, ids)


def _assemble(parts: list[tuple[np.ndarray, np.ndarray | None]], with_kl: bool) -> RequestResult:
    if not parts:
        return RequestResult(
            0.0, True, 0, 0.0 if with_kl else None, 0 if with_kl else None, np.zeros(0) if with_kl else None
        )
    rows = np.stack([stats for stats, _ in parts])
    result = RequestResult(
        loglikelihood=math.fsum(rows[:, LL]),
        is_greedy=bool(rows[:, GREEDY].all()),
        n_tokens=int(rows[:, N_TOKENS].sum()),
    )
    if not with_kl:
        return result
    return RequestResult(
        result.loglikelihood,
        result.is_greedy,
        result.n_tokens,
        ref_loglikelihood=math.fsum(rows[:, REF_LL]),
        top1_agree=int(rows[:, TOP1].sum()),
        kl=np.concatenate([kl for _, kl in parts]),
    )
