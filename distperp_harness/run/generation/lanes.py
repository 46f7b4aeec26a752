"""The global generation plan: distinct jobs in canonical order, cut into lanes by a rule that ignores the world size.

A lane (:class:`LanePlan`) is a run of consecutive jobs with equal generation arguments, decoded by ``slots``
rows of continuous batching (:mod:`.loop`). Jobs come in the canonical order of :class:`~.jobs.JobTable`
(arguments, then the prompts' prefix blocks: prompts sharing a few-shot block or a system prompt sit together, and
a lane computes their common block once). A lane holds up to ``LANE_ROUNDS * slots`` jobs; ``slots`` is the
batching rule's number of rows for the lane's longest prompt plus its ``max_gen_toks`` (the KV cache every slot may
grow to), so a task asking for 1,280 new tokens gets fewer slots than one asking for 32.

Everything here is a pure function of the global job set: lanes, their slots and shared prefixes are the same for
1 process or 1,024, which is what makes the texts the same. Lanes go to ranks as scoring batches do
(:func:`~distperp_harness.planning.plan.assign_batches`), costed by prompt tokens plus the new tokens each job may
generate (``max_gen_toks``), and are claimed like them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from distperp_harness.planning.plan import Batch
from distperp_harness.planning.rows import common_prefix_length

LANE_ROUNDS = 4
"""Jobs per lane, in slots: each slot is refilled about this many times before the lane drains. More rounds keep the
slots fuller (the drain at a lane's end runs fewer rows); fewer give more lanes to spread over ranks."""


@dataclass(frozen=True)
class LanePlan:
    """Jobs ``start .. stop-1`` of the canonical order, ``slots`` rows, ``max_new`` new tokens at most per job,
    ``longest`` the longest prompt (tokens); ``shared`` and ``donor``: the prefix the lane is planned to compute once
    (its cost; the lane finds it exactly from its prompts with :func:`lane_prefix`); ``prefixes``: with
    batch-invariant generation, each job's own prefix (tokens it continues from a cache; 0: prefilled whole), fixed
    by the job set (:func:`~distperp_harness.run.generation.jobs.prefix_groups`), else empty."""

    start: int
    stop: int
    slots: int
    shared: int
    max_new: int
    longest: int
    donor: int = 0
    prefixes: tuple[int, ...] = ()

    @property
    def jobs(self) -> int:
        return self.stop - self.start

    def as_batch(self) -> Batch:
        """The lane as a plan batch for costing: every job's prompt and ``max_new`` tokens, the prefix once."""
        return Batch(self.start, self.stop, self.longest + self.max_new, shared=self.shared)


def lane_prefix(prompts: Sequence[Sequence[int]], min_tokens: int) -> tuple[int, int]:
    """``(length, donor)``: the prefix ``prompts[donor][:length]`` that a lane computes once, or ``(0, 0)``.

    The donor is the lane's middle prompt (in canonical order prompts with a common block sit together, so it lies
    in the largest cluster); the length is the longest prefix of it that at least half of the prompts (and at
    least two) start with, leaving each of them one token of its own (the last prompt token predicts the first new
    one). Prompts that do not start with it are prefilled whole. 0 when under ``min_tokens``. A pure function of
    the prompts.
    """
    if len(prompts) < 2:
        return 0, 0
    donor = len(prompts) // 2
    reach = sorted(
        (min(common_prefix_length(prompts[donor], p), len(p) - 1, len(prompts[donor]) - 1) for p in prompts),
        reverse=True,
    )
    length = reach[max(2, (len(prompts) + 1) // 2) - 1]
    return (length, donor) if length >= max(1, min_tokens) else (0, 0)


def common_prefix(prompts: Sequence[Sequence[int]], min_tokens: int) -> int:
    """Tokens every prompt starts with, leaving each one token of its own; 0 when under ``min_tokens`` or for one
    prompt (the shared prefix of a ``model.generate`` batch, whose rows all continue it)."""
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    n = min([limit] + [common_prefix_length(prompts[0], p) for p in prompts[1:]])
    return n if n >= max(1, min_tokens) else 0


def plan_lanes(
    lengths: Sequence[int],
    groups: Sequence,
    max_new: Sequence[int],
    slots_for: Callable[[int], int],
    shared_of: Callable[[int, int], tuple[int, int]],
    rounds: int = LANE_ROUNDS,
    wide: Callable[[int], bool] | None = None,
) -> list[LanePlan]:
    """Lanes over jobs in canonical order, from their prompts' lengths (prompts already cut to fit
    ``max_length - max_new``).

    ``groups[i]``: job ``i``'s generation arguments (a lane never mixes two); ``max_new[i]``: its new-token limit;
    ``slots_for(length)``: rows the batching rule allows when each grows to ``length`` tokens;
    ``shared_of(start, stop)``: ``(length, donor)`` of the prefix the lane of jobs ``start .. stop-1`` computes once
    (for its cost; :func:`lane_prefix` over the prompts, or the planner's estimate from prefix hashes). A lane
    grows while it holds fewer than ``rounds * slots_for(longest prompt so far + max_new)`` jobs. ``wide(i)``: job
    ``i``'s prompt goes to a context-parallel group: a lane never mixes such jobs with others, and shares no prefix.
    """
    lanes, start = [], 0
    while start < len(lengths):
        longest = int(lengths[start])
        kind = wide is not None and wide(start)
        stop = start + 1
        while stop < len(lengths) and groups[stop] == groups[start] and (wide is None or wide(stop) == kind):
            longer = max(longest, int(lengths[stop]))
            if stop - start + 1 > rounds * max(1, slots_for(longer + max_new[start])):
                break
            longest, stop = longer, stop + 1
        slots = max(1, min(stop - start, slots_for(longest + max_new[start])))
        shared, donor = (0, 0) if kind else shared_of(start, stop)
        lanes.append(LanePlan(start, stop, slots, shared, int(max_new[start]), longest, donor))
        start = stop
    return lanes
