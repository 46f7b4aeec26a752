"""What decoding one lane computed (:class:`LaneStats`): the counters every engine fills and the call record sums."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LaneStats:
    """Work of one lane. ``prefill_positions`` counts every position run through the model before the first token
    (pads included, a shared prefix only when computed here); ``decode_positions``: rows of every decode forward;
    ``generated``: new tokens kept (up to and including the one that ended each row); ``padded_positions``: free
    slots' positions a fixed-shape decode step computed (:mod:`.static_batch`; 0 elsewhere); ``host_reads``: reads of
    the device back to the host (one per prefill and decode forward: the chosen tokens)."""

    prompts: int = 0
    prompt_tokens: int = 0
    shared_tokens: int = 0
    prefix_computed: bool = False
    prefill_forwards: int = 0
    prefill_positions: int = 0
    decode_forwards: int = 0
    decode_positions: int = 0
    generated: int = 0
    peak_cache_positions: int = 0
    padded_positions: int = 0
    host_reads: int = 0

    SUMMED = (
        "prompts",
        "prompt_tokens",
        "prefill_forwards",
        "prefill_positions",
        "decode_forwards",
        "decode_positions",
        "generated",
        "padded_positions",
        "host_reads",
    )

    def add(self, other: LaneStats) -> None:
        for name in self.SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_cache_positions = max(self.peak_cache_positions, other.peak_cache_positions)


@dataclass(frozen=True)
class LaneRecord:
    """What one computed lane reports to its call's record (gathered from every rank): the lane's index in the
    global plan, the engine that decoded it (``slots`` or ``generate``), its slots and its work."""

    lane: int
    engine: str
    slots: int
    stats: LaneStats
