"""Typed records of what one model instance's calls did: :class:`ScoringCall` (``loglikelihood``,
``loglikelihood_rolling``, the reference comparison of generations) and :class:`GenerationCall`
(``generate_until``), each with one :class:`RankShare` per rank. ``to_dict()`` gives the entry of
``config.distperp.calls`` in the results JSON (the keys ``commands/compare.py`` and users read)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from distperp_harness.run.execution.claims import Claiming


@dataclass(frozen=True)
class RankShare:
    """What one rank computed in a call: ``units`` batches (scoring) or lanes (generation), of which ``from_ward``
    were taken from the rank it helps; ``tokens`` positions computed (scoring; ``None`` for generation)."""

    rank: int
    units: int
    from_ward: int
    seconds: float
    tokens: int | None = None

    def to_dict(self, unit_name: str) -> dict[str, Any]:
        out = {"rank": self.rank, unit_name: self.units, "from_ward": self.from_ward}
        if self.tokens is not None:
            out["tokens"] = self.tokens
        return {**out, "seconds": self.seconds}


@dataclass(frozen=True)
class RankFacts:
    """Measured on each rank at the end of a call: peak device memory, bytes received during the call, and the
    resume store's counters (``None`` without ``resume_dir``)."""

    peak_memory_bytes: int
    bytes_received: int
    resume_counts: Any = None


@dataclass
class ScoringCall:
    """One scoring call over the global plan. ``computed_tokens``: positions run through the model (shared prefixes
    once); ``tokens_saved``: the units' input tokens minus those; balance figures from
    :func:`distperp_harness.planning.plan.balance_report`; ``*_seconds`` from the call's start on this rank;
    ``max_batch_rows``: the most rows a batch of the plan holds (the effective batch size under ``auto``);
    ``context_parallel_rows``: rows computed by context-parallel groups (``cp_size`` > 1, at least ``cp_min_tokens``
    tokens)."""

    kind: str
    units: int
    rows: int
    share_mode: str
    computed_tokens: int
    tokens_saved: int
    contexts: int
    row_groups: int
    batches: int
    batches_sharing_a_prefix: int
    scored_tokens: int
    padded_tokens_per_rank: list
    max_over_mean: float
    best_max_over_mean: float
    scored_max_over_mean: float
    claiming: Claiming
    per_rank: list[RankShare]
    planning_seconds: float
    scoring_seconds: float
    total_seconds: float
    seconds_after_arrival: float
    facts: list[RankFacts] = field(default_factory=list)
    max_batch_rows: int = 0
    context_parallel_rows: int = 0

    def summary(self, world_size: int, fingerprint: str) -> str:
        """The call's one log line: tokens, units, rows, tokens saved, batches, time, speed, balance, fingerprint."""
        groups = f"; {self.context_parallel_rows} rows by context-parallel groups" if self.context_parallel_rows else ""
        return (
            f"{self.kind}: {self.scored_tokens} tokens in {self.units} units, {self.rows} rows "
            f"({self.tokens_saved} input tokens saved), {self.batches} batches on {world_size} process(es) in "
            f"{self.total_seconds:.1f} s ({self.scored_tokens / max(self.total_seconds, 1e-9):.0f} tok/s{groups}); "
            f"load max/mean {self.max_over_mean:.3f}; fingerprint {fingerprint}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("per_rank", "facts")}
        out["computed_tokens_per_context"] = self.computed_tokens / max(1, self.contexts)
        out["per_rank"] = [share.to_dict("batches") for share in self.per_rank]
        return {**out, **_facts(self.facts)}


@dataclass
class GenerationCall:
    """One ``generate_until`` call. Positions count every position run through the model, pads included:
    ``prefill_positions`` of ``prompt_tokens`` prompt tokens, ``decode_positions`` for ``generated`` new tokens
    (``padded_positions``: free slots a fixed-shape step computed besides). ``host_reads``: reads of the device back
    to the host (one per forward); ``decode_step``: ``static``, ``compiled``, ``cuda graphs`` or ``dynamic``."""

    jobs: int
    sampled_jobs: int
    seed: int
    lanes: int
    lanes_computed: int
    slots_max: int
    engines: list[str]
    shared_lanes: int
    min_shared_tokens: int
    shared_tokens_min_max: list[int] | None
    prefixes_computed: int
    prompt_tokens: int
    prefill_positions: int
    prefill_forwards: int
    decode_forwards: int
    decode_positions: int
    generated: int
    peak_cache_positions: int
    claiming: Claiming
    per_rank: list[RankShare]
    world_size: int
    seconds: float
    facts: list[RankFacts] = field(default_factory=list)
    padded_positions: int = 0
    host_reads: int = 0
    decode_step: str = "dynamic"
    kind: str = "generate_until"

    @property
    def decode_positions_per_generated(self) -> float:
        return self.decode_positions / max(1, self.generated)

    def to_dict(self) -> dict[str, Any]:
        """``seconds``, not ``total_seconds`` (compare.py divides the scoring calls' scored tokens by their
        ``total_seconds``); ``lanes``, not ``batches`` (resume counts those)."""
        out = {
            "kind": self.kind,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("per_rank", "facts", "kind")
            },
        }
        out["decode_positions_per_generated"] = self.decode_positions_per_generated
        out["per_rank"] = [share.to_dict("lanes") for share in self.per_rank]
        return {**out, **_facts(self.facts)}


def _facts(facts: list[RankFacts]) -> dict[str, list]:
    if not facts:
        return {}
    return {
        "peak_memory_bytes_per_rank": [f.peak_memory_bytes for f in facts],
        "bytes_received_per_rank": [f.bytes_received for f in facts],
    }


Call = ScoringCall | GenerationCall


@dataclass
class RunStats:
    """The calls of one model instance, and the fingerprint of their scoring results so far."""

    calls: list[Call] = field(default_factory=list)
    _digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    tp_size: int = 1
    cp_size: int = 1

    @property
    def fingerprint(self) -> str:
        """16 hex digits of every scoring call's per-unit results, in call order (each call's part:
        :func:`~distperp_harness.run.scoring.pipeline.unit_mark`): equal exactly when the results are, whatever the
        batch size, batch order or number of processes; ``tpN:`` first when ``tp_size`` = N > 1 (tensor parallelism sums
        in another order: its bits compare with runs of the same ``tp_size`` only), ``cpN:`` when ``cp_size`` = N > 1
        and a group computed some row (each member's matrix products have a share of the row's tokens, which a
        CPU's kernels may round otherwise; rows shorter than ``cp_min_tokens`` are computed as with ``cp_size=1``)."""
        digits = self._digest.hexdigest()[:16]
        if self.cp_size > 1 and any(getattr(c, "context_parallel_rows", 0) for c in self.calls):
            return f"cp{self.cp_size}:{digits}"
        return digits if self.tp_size == 1 else f"tp{self.tp_size}:{digits}"

    def to_dicts(self) -> list[dict[str, Any]]:
        return [call.to_dict() for call in self.calls]
