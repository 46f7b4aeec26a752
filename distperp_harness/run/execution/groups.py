"""Workers: who computes what when several processes compute each forward together (``tp_size`` > 1).

A tensor-parallel group of ``tp`` consecutive ranks computes one forward together and every member gets the same
logits, so the group is *one* data-parallel worker: the global plan gives batches and lanes to ``world // tp``
workers (:class:`Workers`), each unit's tokens go to every member of the workers that may compute it, and only the
group's first rank (its leader) reports results, so each result travels once.

Members walk the leader's path (:class:`Follow`): the leader claims batches or lanes as any rank does
(:mod:`distperp_harness.run.execution.claims`), decides whether ``resume_dir`` already holds each, and publishes every
decision in the store in order; the members read the same decisions in the same order and make the same forward
calls. What a member computes is never a decision of its own, so a group can never split.

With ``tp`` = 1 a worker is a rank and nothing is published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distperp_harness.distributed.store import CollectiveError


@dataclass(frozen=True)
class Workers:
    """The data-parallel workers of a world of ``world_size`` ranks in groups of ``tp`` consecutive ranks."""

    world_size: int
    tp: int = 1

    @property
    def count(self) -> int:
        return self.world_size // self.tp

    def of(self, rank: int) -> int:
        """The worker rank ``rank`` belongs to."""
        return rank // self.tp

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` reports its worker's results (the group's first rank; every rank when ``tp`` = 1)."""
        return rank % self.tp == 0

    def ranks(self, workers: np.ndarray) -> np.ndarray:
        """``int [n, k]`` worker numbers (``-1``: none) → ``int [n, k * tp]`` the ranks of those workers' members."""
        workers = np.asarray(workers, dtype=np.int64)
        if self.tp == 1:
            return workers
        members = workers[..., None] * self.tp + np.arange(self.tp)
        members[workers < 0] = -1
        return members.reshape(len(workers), workers.shape[1] * self.tp)  # no -1: n may be 0


class Follow:
    """A TP group's shared sequence of decisions over the process group's store: the leader's :meth:`share`
    publishes a value, a member's returns the leader's value at the same position (waiting for it).

    Args:
        store: the process group's store; ``prefix``: unique to this call, equal on every rank.
        rank, tp: this rank and the group size; the group is ranks ``rank - rank % tp ..``.
    """

    def __init__(self, store: Any, prefix: str, rank: int, tp: int) -> None:
        self.store, self.rank = store, rank
        self.first = rank - rank % tp
        self.leader = rank == self.first
        self.prefix = f"{prefix}/tp{self.first}"
        self.position = 0

    def share(self, value: int) -> int:
        """The leader's ``value`` (members pass anything and get the leader's).

        Raises:
            CollectiveError: a member waited longer than the store's timeout (the run's ``timeout=``) for its leader.
        """
        key = f"{self.prefix}/{self.position}"
        self.position += 1
        try:
            if self.leader:
                self.store.set(key, str(int(value)))
                return int(value)
            return int(self.store.get(key))  # waits for the key
        except Exception as exc:  # the store raises DistStoreError variants (timeout, host gone)
            what = (
                "could not publish its next decision to its tensor-parallel group (the store is gone)"
                if self.leader
                else f"waited for the next decision of its tensor-parallel group's leader, rank "
                f"{self.first}, and none came (it died, hung, or the store is gone)"
            )
            raise CollectiveError(
                f"distperp: rank {self.rank} {what}. The evaluation is incomplete and no results were written. "
                f"Underlying error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
