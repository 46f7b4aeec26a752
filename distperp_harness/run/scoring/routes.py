"""Which workers compute which batch of a scoring call.

Without context parallelism every batch goes to the call's executor, whose workers are ranks (or tensor-parallel
groups). With ``cp_size`` > 1 (:class:`WideRows`), a batch whose longest planned row has at least ``cp_min_tokens``
tokens goes to the context-parallel executor, whose workers are groups that compute each row together; every other
batch stays data parallel on every rank, so short rows of a mixed task waste nothing. Each part is assigned by the
same rule (:func:`~distperp_harness.planning.plan.assign_batches`) on its own workers, and which part a batch
belongs to depends on the batch alone: the same on every rank and for every number of groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distperp_harness.planning.plan import Batch, Plan, assign_batches
from distperp_harness.run.execution.claims import helper_of
from distperp_harness.run.execution.executor import Executor


@dataclass(frozen=True)
class WideRows:
    """Batches with a row of at least ``min_tokens`` planned tokens are computed by ``executor`` (its workers are
    context-parallel groups; its batches compute no shared prefix once, since its cache would be split)."""

    executor: Executor
    min_tokens: int

    def takes(self, lengths: np.ndarray, batch: Batch) -> bool:
        return batch.stop > batch.start and int(lengths[batch.start : batch.stop].max()) >= self.min_tokens


@dataclass(frozen=True)
class Route:
    """One executor's part of a call: ``batches`` (the call's batch indices, in order) assigned by ``plan`` (over
    those batches) to the executor's workers; ``suffix`` keeps its claims apart from the other part's."""

    executor: Executor
    batches: tuple[int, ...]
    plan: Plan
    suffix: str

    def batches_of(self, worker: int) -> list[int]:
        """The call's indices of the batches ``worker`` owns, in batch order."""
        return [self.batches[i] for i in self.plan.batches_of(worker)]

    def ranks(self) -> np.ndarray:
        """``int [len(batches), 2 * group]``: the ranks that may compute each batch (its owner's members, then its
        helper's when claiming; ``-1``: none)."""
        workers, step = self.executor.workers, self.executor.step
        owner = np.asarray(self.plan.owner, dtype=np.int64)
        if not len(owner):
            return np.zeros((0, 2 * workers.tp), np.int64)
        helper = [helper_of(o, workers.count, step) for o in owner] if step else np.full_like(owner, -1)
        return workers.ranks(np.stack([owner, np.asarray(helper, dtype=np.int64)], 1))


def split(batches: Sequence[Batch], lengths: np.ndarray, wide: WideRows | None) -> tuple[list[Batch], frozenset[int]]:
    """``batches`` with the wide ones' shared prefix dropped, and the indices of the wide ones."""
    if wide is None:
        return list(batches), frozenset()
    taken = frozenset(b for b, batch in enumerate(batches) if wide.takes(lengths, batch))
    return [dataclasses.replace(b, shared=0) if i in taken else b for i, b in enumerate(batches)], taken


def routes(
    batches: Sequence[Batch],
    executor: Executor,
    wide: WideRows | None,
    taken: frozenset[int],
    attention_coef: float,
    head_coef: float,
) -> list[Route]:
    """The call's parts: the wide batches on ``wide``'s groups first (every rank meets its group there before
    anything else), then the rest on ``executor``'s workers (claiming evens out what the groups left uneven)."""
    parts: list[tuple[Executor, list[int], str]] = []
    if wide is not None and taken:
        parts.append((wide.executor, sorted(taken), "/wide"))
    rest = [b for b in range(len(batches)) if b not in taken]
    if rest or not parts:
        parts.append((executor, rest, ""))
    return [
        Route(ex, tuple(ids), assign_batches([batches[b] for b in ids], ex.workers.count, attention_coef, head_coef), s)
        for ex, ids, s in parts
    ]


def batch_ranks(parts: Sequence[Route], count: int) -> np.ndarray:
    """``int [count, k]``: for every batch of the call, the ranks that may compute it (``-1`` pads)."""
    width = max((2 * p.executor.workers.tp for p in parts), default=2)
    out = np.full((count, width), -1, dtype=np.int64)
    for part in parts:
        ranks = part.ranks()
        out[list(part.batches), : ranks.shape[1]] = ranks
    return out


def planned_here(parts: Sequence[Route], scored: np.ndarray) -> int:
    """What this rank's workers own in ``parts``: the sum of ``scored`` (per batch of the call) over those batches."""
    return int(sum(int(scored[b]) for p in parts for b in p.batches_of(p.executor.worker)))
