"""One scoring call across all processes: exchange units → rows → global plan → score own batches → gather.

Every rank passes the units of the requests lm-eval gave it (its round-robin share plus padding copies).
The units of all ranks are exchanged as int64 tensors, deduplicated into one canonical :class:`UnitTable`,
grouped into rows (:mod:`distperp_harness.rows`: shared inputs and shared prefixes, from the table alone), packed
into world-size-independent batches of rows and assigned to ranks by cost. Each rank scores its batches;
per-unit float64 statistics (and per-token KL values) are all-gathered, so every rank holds the whole
table and rebuilds the results of its own requests in a fixed order: the same bits on 1 process or N.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from distperp_harness.collective import Collective
from distperp_harness.plan import Batch, assign_batches, balance_report, make_batches
from distperp_harness.requests import Unit, UnitTable, pack_units, unpack_units
from distperp_harness.rows import Row, plan_rows, shared_prefix
from distperp_harness.scoring import GREEDY, LL, N_COLUMNS, N_TOKENS, REF_LL, TOP1, BatchScores, forward_calls
from distperp_harness.sharding import idle_calls


@dataclass(frozen=True)
class Batching:
    """World-size-independent batching rule: fixed rows per batch, or a token budget per batch."""

    batch_size: int | None = 1
    token_budget: int | None = None
    max_batch_size: int = 64

    def batches(self, lengths: Sequence[int], n_score: Sequence[int] | None = None,
                group_starts: Sequence[int] = (0,)) -> list[Batch]:
        """Batches over rows in plan order, never across ``group_starts``; ``n_score`` only annotates them."""
        if self.token_budget is not None:
            return make_batches(lengths, token_budget=self.token_budget, max_batch_size=self.max_batch_size,
                                n_score=n_score, group_starts=group_starts)
        return make_batches(lengths, batch_size=self.batch_size, n_score=n_score, group_starts=group_starts)

    def rows_for(self, padded_length: int) -> int:
        """Rows a batch of ``padded_length`` tokens may hold under this rule."""
        if self.token_budget is not None:
            return max(1, min(self.max_batch_size, self.token_budget // max(1, padded_length)))
        return int(self.batch_size or 1)


@dataclass(frozen=True)
class RequestResult:
    """Aggregated result of one request: sums over its units in float64."""

    loglikelihood: float
    is_greedy: bool
    n_tokens: int
    ref_loglikelihood: float | None = None
    top1_agree: int | None = None
    kl: np.ndarray | None = None


@dataclass
class RunStats:
    """What the results JSON reports about the scoring calls of one model instance."""

    calls: list[dict] = field(default_factory=list)
    _digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)

    @property
    def fingerprint(self) -> str:
        return self._digest.hexdigest()[:16]


@dataclass(frozen=True)
class Sharing:
    """How units share rows: ``mode`` (see :func:`distperp_harness.rows.build_rows`) and the longest packed row."""

    mode: str = "off"
    max_row_length: int | None = None


ScoreFn = Callable[[Sequence[Row], int], BatchScores]
Progress = Callable[[int], None]


def score_requests(per_request_units: Sequence[Sequence[Unit]], *, collective: Collective, score_fn: ScoreFn,
                   batching: Batching, attention_coef: float = 0.0, head_coef: float = 0.0,
                   with_reference: bool = False, sharing: Sharing = Sharing(),
                   stats: RunStats | None = None, progress: Callable[[int], Progress] | None = None,
                   kind: str = "score", shard_size: int = 1,
                   idle_fn: Callable[[], None] | None = None) -> list[RequestResult]:
    """Score this rank's requests as part of the global plan; every rank must call this together.

    Args:
        per_request_units: for each local request, its units in order (an empty list scores nothing).
        score_fn: scores one batch of rows given the tokens they share (see
            :func:`distperp_harness.scoring.score_batch`); its statistics are per unit, in row order.
        sharing: how units share rows; the batches hold ``batching`` rows each (``batch_size=N``: N rows).
        progress: given the number of padded tokens this rank will compute, returns an update callback.
        shard_size, idle_fn: with sharded weights (``shard_size`` > 1) every forward gathers parameters from the
            rank's whole shard group, so after its own batches a rank calls ``idle_fn`` (a forward whose result
            is dropped) until it has made as many forward calls as the busiest rank of its group.

    Returns:
        One :class:`RequestResult` per local request, identical bits for every world size.
    """
    t0 = time.perf_counter()
    table = _global_table(per_request_units, collective)
    row_plan = plan_rows(table.units, sharing.mode, sharing.max_row_length, attention_coef)
    computed = row_plan.rows
    batches = batching.batches([r.length for r in computed], [r.scored for r in computed], row_plan.group_starts)
    if sharing.mode == "prefix":
        batches = [dataclasses.replace(b, shared=shared_prefix(computed[b.start: b.stop])) for b in batches]
    plan = assign_batches(batches, collective.world_size, attention_coef, head_coef)
    mine = plan.batches_of(collective.rank)
    update = progress(sum(batches[i].padded_tokens for i in mine)) if progress else None

    ids, unit_stats, kl_rows = [], [], []
    for i in mine:
        batch = batches[i]
        scores = score_fn(computed[batch.start: batch.stop], batch.shared)
        ids.extend(uid for row in computed[batch.start: batch.stop] for uid in row.unit_ids)
        unit_stats.append(scores.stats)
        if with_reference:
            kl_rows.extend(scores.kl)
        if update:
            update(batch.padded_tokens)
    counts = [0] * collective.world_size  # forward calls per rank: a batch with a shared prefix makes two
    for batch, owner in zip(batches, plan.owner):
        counts[owner] += forward_calls(batch.shared)
    for _ in range(idle_calls(counts, collective.rank, shard_size)):
        idle_fn()
    t_score = time.perf_counter() - t0

    full, kl_full = _gather_results(collective, table, ids, unit_stats, kl_rows if with_reference else None)
    results = [_assemble(table.ids(units), full, kl_full) for units in per_request_units]
    if stats is not None:
        stats._digest.update(full.tobytes())
        report = balance_report(plan, attention_coef, head_coef)
        tokens = sum(b.shared + sum(r.length - b.shared for r in computed[b.start: b.stop]) for b in batches)
        contexts = len({u.tokens[: u.input_length - u.n_score + 1] for u in table.units})
        stats.calls.append({
            "kind": kind, "units": len(table), "rows": len(computed), "share_mode": sharing.mode,
            "computed_tokens": tokens, "tokens_saved": sum(u.input_length for u in table.units) - tokens,
            "contexts": contexts, "computed_tokens_per_context": tokens / max(1, contexts),
            "row_groups": len(row_plan.group_starts), "batches": len(batches),
            "batches_sharing_a_prefix": sum(1 for b in batches if b.shared),
            "scored_tokens": int(full[:, N_TOKENS].sum()),
            "padded_tokens_per_rank": report["padded_tokens_per_rank"],
            "max_over_mean": report["max_over_mean"], "best_max_over_mean": report["best_max_over_mean"],
            "scored_max_over_mean": report["scored_max_over_mean"],
            "scoring_seconds": t_score, "total_seconds": time.perf_counter() - t0,
        })
    return results


def _global_table(per_request_units: Sequence[Sequence[Unit]], collective: Collective) -> UnitTable:
    local = list({u.key(): u for units in per_request_units for u in units}.values())
    lengths, n_score, flat = pack_units(local)
    meta = collective.all_gather_tensor(torch.from_numpy(np.stack([lengths, n_score], axis=1)), "gather unit shapes")
    tokens = collective.all_gather_tensor(torch.from_numpy(flat), "gather unit tokens")
    everyone: list[Unit] = []
    for m, t in zip(meta, tokens):
        m = m.numpy()
        everyone.extend(unpack_units(m[:, 0], m[:, 1], t.numpy()))
    return UnitTable(everyone)


def _gather_results(collective: Collective, table: UnitTable, ids: list[int], rows: list[np.ndarray],
                    kl_rows: list[np.ndarray] | None) -> tuple[np.ndarray, list[np.ndarray] | None]:
    local = np.zeros((len(ids), N_COLUMNS + 1), dtype=np.float64)
    if ids:
        local[:, 0] = ids
        local[:, 1:] = np.concatenate(rows, axis=0)
    parts = collective.all_gather_tensor(torch.from_numpy(local), "gather scores")
    full = np.full((len(table), N_COLUMNS), np.nan, dtype=np.float64)
    kl_full: list[np.ndarray] | None = None
    if kl_rows is not None:
        flat = np.concatenate(kl_rows) if kl_rows else np.zeros(0, dtype=np.float64)
        kl_parts = collective.all_gather_tensor(torch.from_numpy(flat), "gather KL values")
        kl_full = [np.zeros(0)] * len(table)
    for r, part in enumerate(parts):
        part = part.numpy()
        unit_ids = part[:, 0].astype(np.int64)
        full[unit_ids] = part[:, 1:]
        if kl_full is not None:
            values = kl_parts[r].numpy()
            offsets = np.concatenate([[0], np.cumsum(part[:, 1 + N_TOKENS].astype(np.int64))])
            for j, uid in enumerate(unit_ids):
                kl_full[uid] = values[offsets[j]: offsets[j + 1]]
    if np.isnan(full[:, LL]).any():
        raise RuntimeError("internal error: some units of the plan were not scored by any rank")
    return full, kl_full


def _assemble(unit_ids: list[int], full: np.ndarray, kl_full: list[np.ndarray] | None) -> RequestResult:
    if not unit_ids:
        return RequestResult(0.0, True, 0, 0.0 if kl_full is not None else None,
                             0 if kl_full is not None else None,
                             np.zeros(0) if kl_full is not None else None)
    rows = full[unit_ids]
    result = RequestResult(
        loglikelihood=math.fsum(rows[:, LL]),
        is_greedy=bool(rows[:, GREEDY].all()),
        n_tokens=int(rows[:, N_TOKENS].sum()),
    )
    if kl_full is None:
        return result
    return RequestResult(result.loglikelihood, result.is_greedy, result.n_tokens,
                         ref_loglikelihood=math.fsum(rows[:, REF_LL]), top1_agree=int(rows[:, TOP1].sum()),
                         kl=np.concatenate([kl_full[u] for u in unit_ids]))
