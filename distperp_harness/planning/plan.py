"""The global scoring plan: world-size-independent batches, then a balanced assignment of batches to ranks.

Two pure steps, testable and simulable without any process group:

1. :func:`make_batches` packs units (given by their input lengths, in canonical order, longest first) into
   batches by a rule that never looks at the world size: a fixed number of rows, or a token budget. A unit is
   therefore always computed in the same batch, with the same neighbours and padding, on 1 rank or 1,024 —
   which is what makes the float results bit-identical across world sizes.
2. :func:`assign_batches` gives whole batches to ranks by cost (padded tokens plus an attention term, plus
   optionally a term for the scored tokens that go through the output head), longest-processing-time first:
   the costliest unassigned batch goes to the least-loaded rank. Ties between equally costly batches take the
   one scoring more tokens first, and ties between equally loaded ranks go to the rank that has scored fewer
   tokens (then the lower rank), so rolling windows of equal input length — which score anything from one
   token to ``max_length`` — also spread their scored tokens evenly. Deterministic.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Batch:
    """Units ``start .. stop-1`` of the canonical order, right-padded to ``padded_length`` input tokens.

    ``scored`` is the number of target tokens the batch scores (0 when the caller did not say); ``shared`` the tokens at
    the start of every row that the batch computes once (:func:`distperp_harness.planning.rows.shared_prefix`).
    """

    start: int
    stop: int
    padded_length: int
    scored: int = 0
    shared: int = 0

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def padded_tokens(self) -> int:
        """Token positions the batch computes: the shared prefix once, then every row's padded rest."""
        return self.shared + self.rows * (self.padded_length - self.shared)


@dataclass(frozen=True)
class Plan:
    """Batches (canonical, world-size independent) and the rank that computes each one."""

    batches: tuple[Batch, ...]
    owner: tuple[int, ...]
    world_size: int

    def batches_of(self, rank: int) -> list[int]:
        """Indices of the batches ``rank`` computes, in batch order."""
        return [i for i, r in enumerate(self.owner) if r == rank]


def make_batches(
    lengths: Sequence[int],
    *,
    batch_size: int | None = None,
    token_budget: int | None = None,
    max_batch_size: int = 64,
    n_score: Sequence[int] | None = None,
    group_starts: Sequence[int] = (0,),
) -> list[Batch]:
    """Pack units, given by input ``lengths`` in canonical (non-increasing) order, into batches.

    Exactly one of ``batch_size`` (rows per batch) or ``token_budget`` (rows x padded length per batch, at
    most ``max_batch_size`` rows) is given. The result depends only on ``lengths`` and these arguments.
    ``n_score`` (scored tokens per unit, optional) only fills :attr:`Batch.scored`; it never moves a boundary.
    ``group_starts``: indices where a group of rows begins (the lengths are non-increasing within each group); no
    batch holds rows of two groups.
    """
    if (batch_size is None) == (token_budget is None):
        raise ValueError("give exactly one of batch_size or token_budget")
    starts = set(group_starts) | {0}
    ordered_starts = sorted(starts)
    if any(lengths[i] < lengths[i + 1] and i + 1 not in starts for i in range(len(lengths) - 1)):
        raise ValueError("lengths must be in canonical, non-increasing order")
    if n_score is not None and len(n_score) != len(lengths):
        raise ValueError(f"n_score has {len(n_score)} entries for {len(lengths)} units")
    scored_before = [0]
    for k in n_score or ():
        scored_before.append(scored_before[-1] + k)
    batches: list[Batch] = []
    start = 0
    n = len(lengths)
    while start < n:
        padded = lengths[start]
        if batch_size is not None:
            stop = min(n, start + batch_size)
        elif token_budget is not None:
            rows = max(1, min(max_batch_size, token_budget // max(1, padded)))
            stop = min(n, start + rows)
        else:  # exactly one of the two is given (checked above)
            raise ValueError("give exactly one of batch_size or token_budget")
        after = bisect.bisect_right(ordered_starts, start)
        if after < len(ordered_starts):
            stop = min(stop, ordered_starts[after])
        scored = scored_before[stop] - scored_before[start] if n_score is not None else 0
        batches.append(Batch(start, stop, padded, scored))
        start = stop
    return batches


def batch_cost(batch: Batch, attention_coef: float = 0.0, head_coef: float = 0.0) -> float:
    """Relative compute cost: ``padded_tokens * (1 + attention_coef * padded_length) + head_coef * scored``.

    ``attention_coef`` ≈ n_layers * hidden / n_params makes the quadratic attention term comparable to the
    linear (parameter) term; ``head_coef`` ≈ (vocab * hidden) / n_params weighs the scored tokens, which alone
    go through the output head and the log-softmax; 0 and 0 count padded tokens only.
    """
    return batch.padded_tokens * (1.0 + attention_coef * batch.padded_length) + head_coef * batch.scored


def assign_batches(
    batches: Sequence[Batch], world_size: int, attention_coef: float = 0.0, head_coef: float = 0.0
) -> Plan:
    """Longest-processing-time-first assignment of whole batches to ``world_size`` ranks.

    Batches in order of cost, then scored tokens (both descending), then index; each goes to the rank with the
    least cost so far, then the fewest scored tokens, then the lowest rank. O(n log n + n log world_size).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [batch_cost(b, attention_coef, head_coef) for b in batches]
    order = sorted(range(len(batches)), key=lambda i: (-costs[i], -batches[i].scored, i))
    heap: list[tuple[float, int, int]] = [(0.0, 0, rank) for rank in range(world_size)]
    owner = [0] * len(batches)
    for i in order:
        load, scored, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + costs[i], scored + batches[i].scored, rank))
    return Plan(tuple(batches), tuple(owner), world_size)


def rank_loads(plan: Plan, attention_coef: float = 0.0, head_coef: float = 0.0) -> list[float]:
    """Total cost per rank."""
    loads = [0.0] * plan.world_size
    for batch, rank in zip(plan.batches, plan.owner):
        loads[rank] += batch_cost(batch, attention_coef, head_coef)
    return loads


def whole_batch_bound(costs: Sequence[float], world_size: int) -> float:
    """A lower bound on the largest rank load of any assignment of these whole batches to ``world_size`` ranks.

    The largest of ``total / world_size`` and, for every ``k >= 0`` with ``k * world_size + 1`` batches, the sum of
    the ``k + 1`` smallest of the ``k * world_size + 1`` costliest batches (by pigeonhole some rank holds ``k + 1``
    of them). ``k = 0`` is the costliest batch; for equal costs this is ``ceil(n / world_size)`` batches.
    """
    ordered = sorted(costs, reverse=True)
    prefix = [0.0, *itertools.accumulate(ordered)]
    bound = prefix[-1] / world_size if world_size else 0.0
    k = 0
    while k * world_size < len(ordered):
        top = k * world_size + 1  # the costliest `top` batches; the k + 1 smallest of them end at index top - 1
        bound = max(bound, prefix[top] - prefix[top - k - 1])
        k += 1
    return bound


@dataclass(frozen=True)
class BalanceReport:
    """A plan's load per rank (cost, padded and scored tokens), its max/mean, and the best max/mean whole batches
    allow."""

    world_size: int
    batches: int
    padded_tokens_per_rank: list[int]
    scored_tokens_per_rank: list[int]
    cost_per_rank: list[float]
    max_over_mean: float
    best_max_over_mean: float
    scored_max_over_mean: float


def balance_report(plan: Plan, attention_coef: float = 0.0, head_coef: float = 0.0) -> BalanceReport:
    """Load statistics: cost, padded and scored tokens per rank, max/mean, and the best max/mean whole batches allow.

    ``best_max_over_mean`` is :func:`whole_batch_bound` over the mean: no assignment of these whole batches can do
    better. ``scored_max_over_mean`` is 1.0 when the batches do not carry scored counts.
    """
    loads = rank_loads(plan, attention_coef, head_coef)
    tokens = [0] * plan.world_size
    scored = [0] * plan.world_size
    for batch, rank in zip(plan.batches, plan.owner):
        tokens[rank] += batch.padded_tokens
        scored[rank] += batch.scored
    total = sum(loads)
    mean = total / plan.world_size if plan.world_size else 0.0
    scored_mean = sum(scored) / plan.world_size if plan.world_size else 0.0
    bound = whole_batch_bound([batch_cost(b, attention_coef, head_coef) for b in plan.batches], plan.world_size)
    return BalanceReport(
        world_size=plan.world_size,
        batches=len(plan.batches),
        padded_tokens_per_rank=tokens,
        scored_tokens_per_rank=scored,
        cost_per_rank=loads,
        max_over_mean=(max(loads) / mean) if mean else 1.0,
        best_max_over_mean=(bound / mean) if mean else 1.0,
        scored_max_over_mean=(max(scored) / scored_mean) if scored_mean else 1.0,
    )


def round_robin_max_over_mean(doc_costs: Sequence[float], world_size: int) -> float:
    """max/mean load of lm-eval's split: document ``i`` goes to rank ``i % world_size`` (for comparison)."""
    loads = [0.0] * world_size
    for i, cost in enumerate(doc_costs):
        loads[i % world_size] += cost
    mean = sum(loads) / world_size
    return max(loads) / mean if mean else 1.0
