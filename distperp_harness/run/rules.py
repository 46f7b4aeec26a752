"""The rules a scoring call is planned by, below the orchestrators that apply them: how rows are batched
(:class:`Batching`), how units share rows (:class:`Sharing`, a :class:`~distperp_harness.planning.rows.ShareMode`)
and what else the global plan weighs (:class:`ScoringRule`). :mod:`~distperp_harness.run.budget` and
:mod:`~distperp_harness.run.runtime` choose them; :mod:`~distperp_harness.run.scoring.pipeline` and generation follow
them."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from distperp_harness.model.lengths import LengthRule
from distperp_harness.planning.plan import Batch, make_batches
from distperp_harness.planning.rows import ShareMode


@dataclass(frozen=True)
class Batching:
    """World-size-independent batching rule: fixed rows per batch, or a token budget per batch."""

    batch_size: int | None = 1
    token_budget: int | None = None
    max_batch_size: int = 64

    def batches(
        self, lengths: Sequence[int], n_score: Sequence[int] | None = None, group_starts: Sequence[int] = (0,)
    ) -> list[Batch]:
        """Batches over rows in plan order, never across ``group_starts``; ``n_score`` only annotates them."""
        if self.token_budget is not None:
            return make_batches(
                lengths,
                token_budget=self.token_budget,
                max_batch_size=self.max_batch_size,
                n_score=n_score,
                group_starts=group_starts,
            )
        return make_batches(lengths, batch_size=self.batch_size, n_score=n_score, group_starts=group_starts)

    def rows_for(self, padded_length: int) -> int:
        """Rows a batch of ``padded_length`` tokens may hold under this rule."""
        if self.token_budget is not None:
            return max(1, min(self.max_batch_size, self.token_budget // max(1, padded_length)))
        return int(self.batch_size or 1)


class CachedPrefix(enum.Enum):
    """Which prefix a batch of rows computes once, its rows continuing that prefix's key/value cache."""

    NONE = "none: each row computes its whole prefix"
    BATCH = "the batch's common prefix"
    GROUP = "its row group's common prefix, whatever the batching (a row's bits then follow the plan, not the batch)"


@dataclass(frozen=True)
class Sharing:
    """How units share rows: ``mode`` (see :func:`distperp_harness.planning.rows.build_rows`), the longest packed row,
    which prefix a batch computes once for its rows to continue (``cached_prefix``, :class:`CachedPrefix`), and which
    input lengths may share a forward at all (``lengths``, :class:`~distperp_harness.model.lengths.LengthRule`; None:
    every length)."""

    mode: ShareMode = ShareMode.OFF
    max_row_length: int | None = None
    cached_prefix: CachedPrefix = CachedPrefix.BATCH
    lengths: LengthRule | None = None

    def keys(self, input_lengths: np.ndarray) -> np.ndarray | None:
        """Each unit's length key (:meth:`LengthRule.keys`), or None when every length shares."""
        return None if self.lengths is None or self.lengths.uniform else self.lengths.keys(input_lengths)

    def prefix_allowed(self, shared: int, key: int | None) -> bool:
        """Whether rows of length key ``key`` may continue a cached prefix of ``shared`` tokens: its forward keys
        alike (its longest path is ``shared``)."""
        return key is None or self.lengths is None or self.lengths.key(shared) == key


@dataclass(frozen=True)
class ScoringRule:
    """How a scoring call's global plan is made: rows (``sharing``), batches (``batching``) and their costs
    (``attention_coef``, ``head_coef``: see :func:`distperp_harness.planning.plan.assign_batches`), and whether the
    scores carry the reference's comparison (``with_reference``)."""

    batching: Batching
    sharing: Sharing = Sharing()
    attention_coef: float = 0.0
    head_coef: float = 0.0
    with_reference: bool = False


def slots_within(rule: LengthRule, rows_for: Callable[[int], int], length: int) -> int:
    """Slots of a generation lane whose rows grow to ``length`` tokens under a length rule that keeps some lengths
    apart (:class:`~distperp_harness.model.lengths.LengthRule`): ``rows_for(length)`` where every length up to
    ``length`` has one key (a row's forward then keys alike whatever its batch-mates' lengths), else one."""
    return rows_for(length) if rule.key(length) == rule.key(1) else 1


def one_slot(length: int) -> int:
    """Slots of a generation lane whose sequences decode alone (``batch_invariant=true``), whatever ``length``:
    every prefill and decode step then has shapes set by its own sequence."""
    del length
    return 1


def lane_slots(
    rows_for: Callable[[int], int], lengths: LengthRule | None, alone: bool
) -> tuple[Callable[[int], int], bool]:
    """``(slots of a generation lane whose rows grow to a length, whether lanes may share a prompt prefix)``: one
    slot and no sharing where sequences decode alone (``alone``: ``batch_invariant=true``'s check failed, or products
    whose rows follow the batch); under a length rule that keeps lengths apart, ``rows_for`` only where a lane's rows
    stay within one key of it (:func:`slots_within`) and no sharing; else ``rows_for`` and sharing."""
    if alone:
        return one_slot, False
    if lengths is not None and not lengths.uniform:
        return functools.partial(slots_within, lengths, rows_for), False
    return rows_for, True
