"""A rank-local step whose outcome every rank must share: one rank's error becomes the same error on every rank.

Why: a step that reads files (loading a checkpoint) can fail on some ranks only (a file missing on one node, a disk
error). The ranks that succeeded would go on to the next collective while the failed ones leave, and the gathers
after it pair up wrongly (a hang, or one rank's error read as another's payload). :func:`agreed` runs the step, then
gathers every rank's outcome (one small all-gather, also on success), so every rank either goes on or raises: the
failing ranks their own error, the others :class:`StepFailed` naming the first failing rank and its error; an
in-process caller (``series``) catches an error on every rank alike.

Contract: the block must hold no collective of its own that a failing rank could skip (its peers would wait in it
before reaching the agreement): with ``shard_size`` > 1 or ``tp_size`` > 1 loading is collective, and a rank that
fails while reading leaves the others in the sharding's gathers until ``timeout``, as without this module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from distperp_harness.distributed.controlplane import host_name
from distperp_harness.distributed.failfast import describe, record_of
from distperp_harness.errors import InputError


class StepFailed(InputError):
    """Raised by the ranks whose step succeeded when it failed on another: ``rank``, the first failing rank (rank
    order); ``cause``, its error's first line with its type. The failing ranks raise their own error."""

    def __init__(self, message: str, *, rank: int, cause: str) -> None:
        super().__init__(message, same_on_every_rank=True)
        self.rank, self.cause = rank, cause


@contextlib.contextmanager
def agreed(collective: Any, stage: str) -> Iterator[None]:
    """Run the block on every rank, then agree on its outcome (module doc): a rank whose block raised raises its own
    error again (unchanged: one process sees what it always saw); when the block raised on some other rank, this one
    raises :class:`StepFailed` naming the first failing rank (``rank 1 (host) failed while <stage>: <error>``).
    ``stage`` also names the gather. Only exceptions (``Exception``) are agreed on; an interrupt leaves as it came."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # this rank's failure, told to every rank below
        error = exc
    mine = None if error is None else (host_name(), describe(error))
    outcomes = collective.all_gather_object(mine, f"agree on {stage}")
    if error is not None:
        raise error
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        rank, (host, cause) = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise StepFailed(
            f"{record_of(rank, cause, where=host, stage=stage)}{others}. Every rank stops this step alike. Fix: make "
            "the files readable on every node (the same path, the same contents), or give a checkpoint every rank "
            "can load.",
            rank=rank,
            cause=cause,
        )
