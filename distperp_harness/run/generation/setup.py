"""What ``generate_until`` needs from the loaded run (:class:`GenerationSetup`, built by the lm face; nothing in
generation reads the LM object), and the shared-prefix threshold it defaults to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from distperp_harness.planning.rows import MIN_SHARED_PREFIX
from distperp_harness.run.execution.executor import Executor
from distperp_harness.run.generation.engine.step import StaticStep

if TYPE_CHECKING:
    from distperp_harness.run.generation.engine.batchgen import CausalLM

MIN_SHARED_TOKENS = MIN_SHARED_PREFIX
"""Shortest common prefix a lane starts from a shared KV cache (the rule scoring's batches follow too): the saved
prefill is ``(rows - 1) * prefix`` tokens against one extra forward call."""

NO_SHARING = 1 << 62
"""``min_shared_tokens`` that turns prefix sharing off (``share_prefix=false``)."""


@dataclass(frozen=True)
class GenerationSetup:
    """What generation needs from the loaded run (the lm face builds it; nothing here reads the LM object).

    ``rows_for(length)`` is the number of slots a lane may hold when each row grows to ``length`` tokens
    (:func:`distperp_harness.run.budget.generation_rows`: the batching rule, capped by KV-cache bytes).
    ``max_gen_toks``: the default for requests that set none (each request's own limit sizes its lane).
    ``seed``: lm-eval's torch seed (``None``: ``torch.initial_seed()`` at the call); rank 0's is used by all.
    ``min_shared_tokens``: see :data:`MIN_SHARED_TOKENS` (a huge value turns sharing off).
    ``executor``: runs the lanes this rank takes (:class:`~distperp_harness.run.execution.executor.Executor`: claims,
    ``resume_dir`` (finished lanes saved and reused), the failure channel, and with sharded weights the shard
    group's steps: every member one forward per step, its own or an idle one once it has no lane left).
    ``progress(total_prompts)``: returns ``update(prompts, new_tokens)`` (rank 0's bar), or ``None``.
    ``think_end``: the ``think_end_token`` (a string or a token id; :mod:`.thinking`): the answer is the text after
    the trace, and a stop string ends a row only in the answer part.
    ``static``: the run's fixed-shape decode step (:func:`~.engines.decode_step`: eager, compiled or CUDA graphs;
    ``None``: every lane on the dynamic cache): ``prepare(collective, lanes)`` after planning; lanes it covers
    decode over it. ``rows_alone``: every prefill and decode forward's rows attend alone and its products have at
    least 16 rows or a number measured to compute as 16 do (``batch_invariant=true`` where
    :mod:`~distperp_harness.run.scoring.engine.invariance` found that enough): a sequence's bits do not depend on
    its batch-mates.
    """

    model: CausalLM
    tokenizer: Any
    executor: Executor
    device: torch.device
    max_length: int
    max_gen_toks: int
    add_bos_token: bool | None
    rows_for: Callable[[int], int]
    seed: int | None = None
    min_shared_tokens: int = MIN_SHARED_TOKENS
    progress: Callable[[int], Callable[[int, int], None]] | None = None
    think_end: str | int | None = None
    static: StaticStep | None = None
    rows_alone: bool = False
