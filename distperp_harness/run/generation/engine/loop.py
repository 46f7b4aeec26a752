"""One decode loop for every KV batch: continuous batching of one lane.

:func:`run_lane` walks a lane in steps:

1. **admit**: every free slot takes the next prompt of the queue (:class:`~.scheduler.Scheduler`); the admitted
   prompts are prefilled (:class:`~.prefill.Prefiller`) and their rows join the running batch;
2. **decode**: one forward of every running row's last token (the batch's :meth:`~.kv_batch.KVBatch.step`);
3. **choose**: each row's next token on the device (:class:`~.choose.Chooser`), read back once for all rows
   (:class:`~.transfer.HostReads`: the step's one synchronisation);
4. **stop**: each row ends as soon as the stop rule says so (stop strings of all rows in one batched decode); its
   keys and values are dropped at once and its slot is free for the next step's admission.

:func:`decode_lane` decodes a lane with a :class:`Decoder` (what every lane of a call shares), which picks the
batch: the fixed-shape buffers of its step (:mod:`.step`: eager, compiled or CUDA graphs) where that step covers
the lane, else the ``DynamicCache`` batch (eager).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch

from distperp_harness.run.generation.engine.choose import Chooser
from distperp_harness.run.generation.engine.kv_batch import DynamicKVBatch, KVBatch
from distperp_harness.run.generation.engine.masks import slots_refused
from distperp_harness.run.generation.engine.prefill import Prefiller, PrefixCache
from distperp_harness.run.generation.engine.scheduler import GenRow, Lane, Scheduler, StopRule
from distperp_harness.run.generation.engine.static_batch import StaticKVBatch
from distperp_harness.run.generation.engine.stats import LaneStats
from distperp_harness.run.generation.engine.step import StaticStep, capacity_for
from distperp_harness.run.generation.engine.transfer import HostReads
from distperp_harness.run.scoring.engine.kvcache import CacheNotShareable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def run_lane(
    scheduler: Scheduler, prefiller: Prefiller, batch: KVBatch, chooser: Chooser, reads: HostReads
) -> list[list[int]]:
    """Decode the scheduler's lane to the end; every prompt's new tokens, in lane order. Each forward (prefill or
    decode step) reads the device back once: its rows' chosen tokens."""

    def start(rows: Sequence[GenRow], logits: torch.Tensor) -> list[int]:
        return scheduler.advance(rows, reads.tokens(chooser.start(rows, logits)))

    while scheduler.queued or batch.rows:
        admitted = scheduler.admit(batch.free())
        for prefilled in prefiller.groups(admitted, start):
            batch.join(prefilled)
        if not batch.rows:
            continue
        rows = batch.rows
        logits = batch.step()
        batch.drop(scheduler.advance(rows, reads.tokens(chooser(rows, logits))))
    return scheduler.results()


@dataclass(frozen=True)
class Decoder:
    """What every lane of a call decodes with: the model and its tokenizer, the device, the rank's
    :class:`~.prefill.PrefixCache` (shared prefixes computed once per rank), ``around()`` (a context entered around
    every forward: prefix, prefill, decode; e.g. a shard group's step, where every member makes the same forward
    calls), the fixed-shape step (:class:`~.step.StaticStep` or a subclass; ``None``: every lane on the
    ``DynamicCache`` batch) and ``rows_alone`` (every forward's rows attend alone, on the ``DynamicCache`` batch:
    :class:`~.kv_batch.DynamicKVBatch`)."""

    model: PreTrainedModel
    tokenizer: Any
    device: torch.device
    prefixes: PrefixCache | None = None
    around: Callable[[], ContextManager] = contextlib.nullcontext
    static: StaticStep | None = None
    rows_alone: bool = False

    def batch_for(self, lane: Lane, rule: StopRule, stats: LaneStats) -> KVBatch:
        """The fixed-shape batch where the step covers the lane's bucket, else the dynamic batch."""
        static = self.static
        if static is not None and self.model is static.model and not self.rows_alone:
            capacity = capacity_for(max(len(p) for p in lane.prompts), rule.max_new, static.bucket)
            if static.covers(lane.slots, capacity):
                return StaticKVBatch(static, lane.slots, capacity, self.device, stats, self.around)
        return DynamicKVBatch(self.model, lane.slots, self.device, stats, self.around, self.rows_alone)


@torch.no_grad()
def decode_lane(
    decoder: Decoder,
    lane: Lane,
    rule: StopRule,
    *,
    warpers=None,
    on_done: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], LaneStats]:
    """New tokens for every prompt of ``lane``, in lane order, and the lane's :class:`~.stats.LaneStats`.

    ``warpers``: the distribution warpers of a sampled lane (``lane.seeds`` given); greedy otherwise.
    ``on_done(index, tokens)``: called as each row ends. With a compiled step that does not cover the lane, its
    decode forwards are counted in the step's ``eager_calls``. Raises
    :class:`~distperp_harness.run.scoring.engine.kvcache.CacheNotShareable` (before any forward) naming why slots
    do not serve the model (:func:`~.masks.slots_refused`; :func:`~.engines.choose_engine` sends such lanes to
    ``model.generate`` first).
    """
    refused = slots_refused(decoder.model)
    if refused is not None:
        raise CacheNotShareable(refused)
    scheduler = Scheduler(lane, rule, decoder.tokenizer.batch_decode, on_done)
    prefiller = Prefiller.for_lane(
        decoder.model, lane, decoder.tokenizer, decoder.device, decoder.prefixes, decoder.around, decoder.rows_alone
    )
    batch = decoder.batch_for(lane, rule, prefiller.stats)
    reads = HostReads()
    tokens = run_lane(scheduler, prefiller, batch, Chooser(lane.seeds, warpers, decoder.device), reads)
    stats = prefiller.stats
    stats.generated = sum(len(t) for t in tokens)
    stats.host_reads = reads.count
    if decoder.static is not None and isinstance(batch, DynamicKVBatch):
        decoder.static.count_eager(stats.decode_forwards)
    return tokens, stats
