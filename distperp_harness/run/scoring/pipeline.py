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

from distperp_harness.planning.plan import Batch, balance_report
from distperp_harness.planning.records import FlatUnits, GlobalTable, HashCollision, decode, encode, local_records
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rowplan import PlannedRows, batch_shared, group_of, plan_from_records
from distperp_harness.planning.rows import Row, ShareMode, row_of, shared_prefix, unit_rows, unscored_common_prefix
from distperp_harness.run.execution.calls import RankShare, RunStats, ScoringCall
from distperp_harness.run.execution.executor import Executor
from distperp_harness.run.execution.routing import move_tokens, return_results
from distperp_harness.run.rules import CachedPrefix, ScoringRule, Sharing
from distperp_harness.run.scoring.engine.forward import GREEDY, LL, N_COLUMNS, N_TOKENS, REF_LL, TOP1
from distperp_harness.run.scoring.routes import Route, WideRows, batch_ranks, planned_here, routes, split


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
    wide: WideRows | None = None,
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
        wide: with ``cp_size`` > 1, the context-parallel groups' executor and the row length from which a batch is
            theirs (:mod:`~distperp_harness.run.scoring.routes`); the other batches stay on ``executor``.

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

    keys = sharing.keys(table.units["length"].astype(np.int64) - 1)  # by each unit's input length
    planned = plan_from_records(table, sharing.mode, sharing.max_row_length, rule.attention_coef, keys)
    batches = rule.batching.batches(planned.lengths.tolist(), planned.scored.tolist(), planned.group_starts)
    if sharing.mode == ShareMode.PREFIX and sharing.cached_prefix is not CachedPrefix.NONE:
        batches = [dataclasses.replace(b, shared=_cached(planned, b, sharing, keys)) for b in batches]
    batches, taken = split(batches, planned.lengths, wide)
    if prepare is not None:
        prepare(
            sharing.mode == ShareMode.PREFIX
            and any(len(planned.members[r]) > 1 for b in batches if not b.shared for r in range(b.start, b.stop))
        )
    routed = routes(batches, executor, wide, taken, rule.attention_coef, rule.head_coef)
    unit_batch = np.empty(len(table), dtype=np.int64)
    for b, batch in enumerate(batches):
        for r in range(batch.start, batch.stop):
            unit_batch[planned.members[r]] = b
    ranks = batch_ranks(routed, len(batches))
    available = move_tokens(collective, table, ranks[unit_batch], flat, local_ids)
    t_plan = time.perf_counter() - t0
    if log is not None and me == 0:
        _say_idle_workers(log, kind, len(batches), len(planned.members), executor.workers.count)

    scored = np.bincount(unit_batch, weights=table.units["n_score"], minlength=len(batches)).astype(np.int64)
    update = progress(planned_here(routed, scored)) if progress else None
    local_checks = flat.check_hashes()
    checks = available.check_hashes(local_checks)
    mine = _Computed()

    def build(b: int) -> tuple[list[Row], int]:
        batch = batches[b]
        rows = [_build_row(planned, r, available, sharing.mode) for r in range(batch.start, batch.stop)]
        if sharing.cached_prefix is CachedPrefix.GROUP:  # the group's prefix: a row's bits whatever its batch-mates
            shared = batch.shared if unscored_common_prefix(rows) >= batch.shared else 0
        else:
            shared = shared_prefix(rows) if batch.shared else 0
        _check_against_plan(planned, batch, rows, shared, sharing.mode)
        return rows, shared

    for part in routed:
        prefix = f"distperp/claims/{collective.sequence}{part.suffix}"
        mine.compute(part, batches, build, prefix, checks, with_reference, lambda b: update and update(int(scored[b])))
    done, computed, mark = mine.batches, mine.results, mine.mark
    t_score = time.perf_counter() - t0
    share = RankShare(me, len(done), mine.from_ward, round(t_score - t_plan, 4), mine.tokens)
    everyone = collective.all_gather_object((done, share, mark), "gather which batches each rank computed")
    computer = np.full(len(batches), -1, dtype=np.int64)
    for rank, (theirs, _, _) in enumerate(everyone):
        computer[np.asarray(theirs, dtype=np.int64)] = rank
    if (computer < 0).any():
        raise RuntimeError("internal error: some batches of the plan were not computed by any rank")
    results = return_results(
        collective, table, unit_batch, computer, computed, local_ids, local_checks, N_COLUMNS, with_reference
    )
    out = [_assemble([results[index_of[u.key()]] for u in units], with_reference) for units in per_request_units]
    if stats is not None:
        stats._digest.update((sum(m for _, _, m in everyone) % (1 << 8 * MARK_BYTES)).to_bytes(MARK_BYTES, "little"))
        balance = balance_report(routed[0].plan, rule.attention_coef, rule.head_coef)  # the wide part's, if any
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
                context_parallel_rows=sum(batches[b].stop - batches[b].start for b in taken),
            )
        )
    return out


MARK_BYTES = 16


@dataclass
class _Computed:
    """What this rank computed and reports in a call: each unit's results and check hash, the batches, the sum of
    the units' marks (:func:`unit_mark`), the tokens computed and the batches taken from its ward."""

    results: dict[int, tuple[np.ndarray, int, np.ndarray | None]] = dataclasses.field(default_factory=dict)
    batches: list[int] = dataclasses.field(default_factory=list)
    mark: int = 0
    tokens: int = 0
    from_ward: int = 0

    def compute(
        self,
        part: Route,
        batches: Sequence[Batch],
        build: Callable[[int], tuple[list[Row], int]],
        prefix: str,
        checks: dict[int, int],
        with_reference: bool,
        scored: Callable[[int], object],
    ) -> None:
        """Walk ``part``'s batches this rank takes (claims under ``prefix``); a group's member computes and drops,
        its leader reports (``scored(b)`` after each reported batch: progress)."""
        ex = part.executor
        claims = ex.claims(part.batches_of, prefix)
        for b in ex.batches(claims, functools.partial(_forward_calls, ex, batches), prefix):
            rows, shared = build(b)
            scores = ex.score(rows, shared)
            if not ex.reports:
                continue  # a group's member: its leader reports the same bits and counts the tokens
            if scores is None:  # Executor.score: only a member that does not report gets None
                raise RuntimeError(f"internal error: no scores for batch {b} on a rank that reports them")
            self.tokens += shared + sum(row.length - shared for row in rows)
            scored(b)  # the tokens the results count (n_tokens), as the bar's total does
            ids = [uid for row in rows for uid in row.unit_ids]
            kl = scores.kl_rows() if with_reference else [None] * len(ids)
            for j, uid in enumerate(ids):
                self.results[uid] = (scores.stats[j], int(checks[uid]), kl[j])
                self.mark += unit_mark(uid, scores.stats[j])
            self.batches.append(b)
        self.from_ward += claims.taken_from_ward


def _say_idle_workers(log: Callable[[str], None], kind: str, batches: int, rows: int, workers: int) -> None:
    """One line when the plan has fewer batches than workers (a tensor-parallel group is one worker)."""
    if batches < workers:
        log(
            f"{kind}: {batches} batches for {workers} workers: {workers - batches} have no batch (batches never "
            f"depend on the number of processes; batch_size={max(1, rows // workers)} or smaller would give every "
            "worker one)"
        )


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


def _cached(planned: PlannedRows, batch: Batch, sharing: Sharing, keys: np.ndarray | None) -> int:
    """The prefix ``batch`` computes once (:func:`batch_shared` of the batch's rows, or with
    :attr:`CachedPrefix.GROUP` of its row group's, whatever the batching), or 0 where a forward of that prefix alone
    would take another length choice than the batch's rows (:meth:`Sharing.prefix_allowed`)."""
    start, stop = batch.start, batch.stop
    if sharing.cached_prefix is CachedPrefix.GROUP:
        start, stop = group_of(planned.group_starts, len(planned.members), start)
    shared = batch_shared(planned, start, stop)
    key = None if keys is None or not shared else int(keys[planned.members[batch.start][0]])
    return shared if sharing.prefix_allowed(shared, key) else 0


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
