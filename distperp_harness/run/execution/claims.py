"""Claiming batches: every rank works at its own pace, a slow one computes fewer batches, and the bits stay the same.

The plan gives each batch an *owner* (:func:`distperp_harness.planning.plan.assign_batches`: costliest first, balanced
by cost) and, when claiming is on, a *helper*: the owner's rank plus ``step`` (the number of processes per node on
several nodes, so a slow node is helped by another node; else 1), modulo the world size. The owner and its helper
both receive the batch's tokens. A rank computes its own batches in plan order (costliest first), then its ward's
(the rank it helps) from the cheapest end, until the two meet. Each batch is taken exactly once: before computing it
a rank adds 1 to the batch's counter in the process group's store (``TCPStore.add`` is atomic), and only the rank
that sees 1 computes it. Owner and helper move towards each other, so the first batch a rank fails to take ends its
walk in that direction.

A batch is computed identically by whichever rank computes it (the ranks agreed on device identity, options and
versions at start), so which rank took it never changes a bit. With one process nothing is claimed.

**Shard groups claim together** (sharded weights: every forward of a group gathers parameters from all its ranks,
so they must make the same forward calls). A group's helper is another group (on another node when there are
several), member for member. The group walks in steps (:class:`GroupSteps`): in each step every member takes its
next batch as above, announces the forward calls it needs (0 when it has none left) in the store, reads its group's,
and runs its batch and then idle forwards up to the step's largest count; the walk ends when a step needs none.
"""

from __future__ import annotations

import enum
from typing import Any, Iterator, Sequence

from distperp_harness.distributed.store import CollectiveError


class Claiming(str, enum.Enum):
    """How a call's units were taken: ``dynamic`` (owner, then its helper, as ranks go) or ``static`` (each rank
    its own only: ``claim=false``, or one process). A ``str`` enum: the call records show its value."""

    DYNAMIC = "dynamic"
    STATIC = "static"

    def __str__(self) -> str:
        return self.value


def helper_of(owner: int, world_size: int, step: int) -> int:
    """The rank that helps ``owner`` (receives its batches' tokens and may take the cheapest of them)."""
    return (owner + step) % world_size


def helper_step(world_size: int, local_world_size: int, shard_size: int = 1) -> int:
    """Offset between a rank and its helper: one node's worth of processes when there are several nodes, else one
    shard group's (one process without sharding); 0 when there is nobody to help (one process, or one shard group)."""
    if world_size <= shard_size:
        return 0
    step = local_world_size if world_size // max(1, local_world_size) > 1 else shard_size
    if step % shard_size:  # shard groups lie within nodes, so a node's processes are whole groups; else stay safe
        step = shard_size
    return step % world_size or shard_size


class Claims:
    """The batches this rank computes, taken one at a time (module docstring).

    Args:
        own: this rank's batches in plan order; ``ward``: the batches of the rank it helps, in plan order.
        store: the process group's store (``None``: no claiming, ``own`` only); ``prefix``: a key prefix unique to
            this scoring call and equal on every rank.
    """

    def __init__(self, own: Sequence[int], ward: Sequence[int] = (), store: Any = None, prefix: str = "") -> None:
        self.own, self.ward, self.store, self.prefix = list(own), list(ward), store, prefix
        self.taken_from_ward = 0

    def __iter__(self) -> Iterator[int]:
        """Batches in the order this rank computes them; each is taken just before it is yielded."""
        for b in self.own:
            if not self._take(b):
                break  # the helper took this one and every later one
            yield b
        if self.store is None:
            return
        for b in reversed(self.ward):
            if not self._take(b):
                return  # the owner took this one and every earlier one
            self.taken_from_ward += 1
            yield b

    def _take(self, batch: int) -> bool:
        if self.store is None:
            return True
        return int(self.store.add(f"{self.prefix}/{batch}", 1)) == 1


class GroupSteps:
    """One shard group's lockstep over the store: :meth:`agree` announces this member's forward calls for the step
    and returns the group's largest (every member of the group must call it the same number of times).

    Args:
        store: the process group's store; ``prefix``: unique to this scoring call, equal on every rank.
        rank, shard_size: this rank; the group is ranks ``rank - rank % shard_size ..`` (the mesh's shard dimension).
    """

    def __init__(self, store: Any, prefix: str, rank: int, shard_size: int) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        first = rank - rank % shard_size
        self.group = range(first, first + shard_size)
        self.step = 0

    def agree(self, calls: int) -> int:
        """Raises:
        CollectiveError: a member did not announce its step within the store's timeout (the run's ``timeout=``),
            naming the members that never arrived."""
        key = f"{self.prefix}/step{self.step}"
        self.step += 1
        try:
            self.store.set(f"{key}/{self.rank}", str(int(calls)))
            return max(int(self.store.get(f"{key}/{r}")) for r in self.group)  # get waits for the key
        except Exception as exc:  # the store raises DistStoreError variants (timeout, host gone)
            raise CollectiveError(self._explain(key, exc)) from exc

    def _explain(self, key: str, exc: Exception) -> str:
        try:
            missing = [r for r in self.group if not self.store.check([f"{key}/{r}"])]
        except Exception:  # store host gone
            missing = []
        who = (
            f"rank(s) {missing} never arrived (died, hung, or were killed)"
            if missing
            else "the store that keeps the group in step is unreachable (rank 0 died or was killed)"
        )
        return (
            f"distperp: the step of shard group {list(self.group)} before its next gather of sharded weights "
            f"failed on rank {self.rank}: {who}. The evaluation is incomplete and no results were written. "
            f"Underlying error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
