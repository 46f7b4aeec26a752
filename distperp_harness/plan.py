"""The global scoring plan: world-size-independent batches, then a balanced assignment of batches to ranks.

Two pure steps, testable and simulable without any process group:

1. :func:`make_batches` packs units (given by their input lengths, in canonical order, longest first) into
   batches by a rule that never looks at the world size: a fixed number of rows, or a token budget. A unit is
   therefore always computed in the same batch, with the same neighbours and padding, on 1 rank or 1,024 —
   which is what makes the float results bit-identical across world sizes.
2. :func:`assign_batches` gives whole batches to ranks by cost (padded tokens plus an attention term),
   longest-processing-time first: the costliest unassigned batch goes to the least-loaded rank (ties: lower
   batch index, lower rank). Deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Batch:
    """Units ``start .. stop-1`` of the canonical order, right-padded to ``padded_length`` input tokens."""

    start: int
    stop: int
    padded_length: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.padded_length


@dataclass(frozen=True)
class Plan:
    """Batches (canonical, world-size independent) and the rank that computes each one."""

    batches: tuple[Batch, ...]
    owner: tuple[int, ...]
    world_size: int

    def batches_of(self, rank: int) -> list[int]:
        """Indices of the batches ``rank`` computes, in batch order."""
        return [i for i, r in enumerate(self.owner) if r == rank]


def make_batches(lengths: Sequence[int], *, batch_size: int | None = None, token_budget: int | None = None,
                 max_batch_size: int = 64) -> list[Batch]:
    """Pack units, given by input ``lengths`` in canonical (non-increasing) order, into batches.

    Exactly one of ``batch_size`` (rows per batch) or ``token_budget`` (rows x padded length per batch, at
    most ``max_batch_size`` rows) is given. The result depends only on ``lengths`` and these arguments.
    """
    if (batch_size is None) == (token_budget is None):
        raise ValueError("give exactly one of batch_size or token_budget")
    if any(lengths[i] < lengths[i + 1] for i in range(len(lengths) - 1)):
        raise ValueError("lengths must be in canonical, non-increasing order")
    batches: list[Batch] = []
    start = 0
    n = len(lengths)
    while start < n:
        padded = lengths[start]
        if batch_size is not None:
            stop = min(n, start + batch_size)
        else:
            rows = max(1, min(max_batch_size, token_budget // max(1, padded)))
            stop = min(n, start + rows)
        batches.append(Batch(start, stop, padded))
        start = stop
    return batches


def batch_cost(batch: Batch, attention_coef: float = 0.0) -> float:
    """Relative compute cost: padded tokens times ``1 + attention_coef * padded_length``.

    ``attention_coef`` ≈ n_layers * hidden / n_params makes the quadratic attention term comparable to the
    linear (parameter) term; 0 counts tokens only.
    """
    return batch.padded_tokens * (1.0 + attention_coef * batch.padded_length)


def assign_batches(batches: Sequence[Batch], world_size: int, attention_coef: float = 0.0) -> Plan:
    """Longest-processing-time-first assignment of whole batches to ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [batch_cost(b, attention_coef) for b in batches]
    order = sorted(range(len(batches)), key=lambda i: (-costs[i], i))
    heap = [(0.0, rank) for rank in range(world_size)]
    owner = [0] * len(batches)
    for i in order:
        load, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    return Plan(tuple(batches), tuple(owner), world_size)


def rank_loads(plan: Plan, attention_coef: float = 0.0) -> list[float]:
    """Total cost per rank."""
    loads = [0.0] * plan.world_size
    for batch, rank in zip(plan.batches, plan.owner):
        loads[rank] += batch_cost(batch, attention_coef)
    return loads


def balance_report(plan: Plan, attention_coef: float = 0.0) -> dict:
    """Load statistics: cost per rank, max/mean, and the best max/mean whole batches allow.

    ``best_max_over_mean`` is the lower bound ``max(largest batch, total / world_size) / mean``; no assignment
    of whole batches can do better.
    """
    loads = rank_loads(plan, attention_coef)
    tokens = [0] * plan.world_size
    for batch, rank in zip(plan.batches, plan.owner):
        tokens[rank] += batch.padded_tokens
    total = sum(loads)
    mean = total / plan.world_size if plan.world_size else 0.0
    largest = max((batch_cost(b, attention_coef) for b in plan.batches), default=0.0)
    return {
        "world_size": plan.world_size,
        "batches": len(plan.batches),
        "padded_tokens_per_rank": tokens,
        "cost_per_rank": loads,
        "max_over_mean": (max(loads) / mean) if mean else 1.0,
        "best_max_over_mean": (max(largest, mean) / mean) if mean else 1.0,
    }


def round_robin_max_over_mean(doc_costs: Sequence[float], world_size: int) -> float:
    """max/mean load of lm-eval's split: document ``i`` goes to rank ``i % world_size`` (for comparison)."""
    loads = [0.0] * world_size
    for i, cost in enumerate(doc_costs):
        loads[i % world_size] += cost
    mean = sum(loads) / world_size
    return max(loads) / mean if mean else 1.0
