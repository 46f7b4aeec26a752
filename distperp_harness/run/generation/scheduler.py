"""The scheduler of one lane: its queue, its rows' states, admission in lane order, each row's next token and the
stop rules. It owns no tensor but the logits it is handed; the KV batch (:mod:`.kv_batch`, :mod:`.static_batch`)
owns the cache and the decode forward.

A *lane* (:class:`Lane`) is a fixed list of prompts decoded in ``slots`` rows (:mod:`.lanes` cuts them). Which
prompt is admitted when is a pure function of the lane's prompts and the tokens generated (a free slot takes the
next prompt of the queue, in lane order), so a lane gives the same bits on any rank, for any world size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from distperp_harness.run.generation.sampling import draw, generators_for


class RowState(enum.Enum):
    """Where a prompt of a lane is: waiting in the queue, decoding in a slot, or done (its tokens recorded)."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Row:
    """One prompt of a lane (``job``: its index in the lane) and the tokens generated for it so far."""

    job: int
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    state: RowState = RowState.QUEUED


@dataclass(frozen=True)
class StopRule:
    """When a row ends: ``until`` strings found in the decoded last ``lookback`` new tokens, an ``eos_ids`` token,
    or ``max_new`` new tokens. ``allowed(tokens)``: when given, a stop string ends the row only where it returns
    True (a thinking trace still open, for example); EOS and ``max_new`` always end it."""

    until: tuple[str, ...]
    eos_ids: frozenset[int]
    max_new: int
    lookback: int
    allowed: Callable[[list[int]], bool] | None = None

    @classmethod
    def of(
        cls,
        tokenizer,
        until: Sequence[str],
        eos_ids: Sequence[int],
        max_new: int,
        allowed: Callable[[list[int]], bool] | None = None,
    ) -> StopRule:
        """lm-eval's lookback: the longest stop string's token count plus 2 (``MultiTokenEOSCriteria``)."""
        until = tuple(s for s in until if s)
        lookback = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in until), default=0) + 2
        return cls(until, frozenset(int(i) for i in eos_ids), int(max_new), lookback, allowed)

    def done(self, tokens: list[int], decode: Callable[[list[int]], str]) -> bool:
        if tokens[-1] in self.eos_ids or len(tokens) >= self.max_new:
            return True
        if not self.until:
            return False
        tail = decode(tokens[-self.lookback :])
        return any(s in tail for s in self.until) and (self.allowed is None or self.allowed(tokens))


def eos_ids(tokenizer, model: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS and the model's ``generation_config`` EOS ids (what ``generate`` stops at)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return [int(i) for i in ids if i is not None]


@dataclass(frozen=True)
class Lane:
    """A lane's prompts (already cut to fit), the shared prefix (tokens; empty: none; the prompts that start with it
    and hold more continue from its cache), slots and seeds (``None`` for greedy)."""

    prompts: Sequence[Sequence[int]]
    prefix: tuple[int, ...]
    slots: int
    seeds: Sequence[int] | None = None

    def uses_prefix(self, index: int) -> bool:
        prompt, n = self.prompts[index], len(self.prefix)
        return n > 0 and len(prompt) > n and tuple(prompt[:n]) == self.prefix


class Scheduler:
    """The queue and rows of one lane.

    ``admit(free)`` takes the next prompts for ``free`` slots; ``start(rows, logits, device)`` gives freshly
    prefilled rows their generators (sampled lanes) and first tokens; ``advance(rows, logits)`` appends every
    running row's next token. Both return the indices of the rows still running; a row that ends is FINISHED, its
    tokens go to :attr:`out` and ``on_done(job, tokens)`` is called, in row order."""

    def __init__(
        self,
        lane: Lane,
        rule: StopRule,
        decode: Callable[[list[int]], str],
        warpers=None,
        on_done: Callable[[int, list[int]], None] | None = None,
    ) -> None:
        self.lane, self.rule, self._decode = lane, rule, decode
        self._warpers, self._on_done = warpers, on_done
        self._queue = list(range(len(lane.prompts)))[::-1]  # pop() takes the next prompt
        self.out: list[list[int] | None] = [None] * len(lane.prompts)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def admit(self, free: int) -> list[Row]:
        """The next ``free`` prompts (fewer when the queue runs out), in lane order."""
        return [Row(self._queue.pop()) for _ in range(min(free, len(self._queue)))]

    def start(self, rows: Sequence[Row], logits: torch.Tensor, device: torch.device) -> list[int]:
        """First tokens of prefilled ``rows`` from their last logits ``[len(rows), vocab]``."""
        if self.lane.seeds is not None:
            for r, g in zip(rows, generators_for([self.lane.seeds[r.job] for r in rows], device)):
                r.generator = g
        return self.advance(rows, logits)

    def advance(self, rows: Sequence[Row], logits: torch.Tensor) -> list[int]:
        """Each row's next token (argmax, or drawn with the row's own generator in a sampled lane) from its row of
        ``logits``; then the stop rule, row by row."""
        if self.lane.seeds is None:
            chosen = logits.argmax(-1).tolist()
        else:
            # every row of a sampled lane got its generator at start(); draw() refuses a count that differs
            generators = [r.generator for r in rows if r.generator is not None]
            chosen = draw(self._warpers, logits, generators).tolist()
        for r, token in zip(rows, chosen):
            r.tokens.append(token)
        keep = []
        for i, r in enumerate(rows):
            if self.rule.done(r.tokens, self._decode):
                r.state = RowState.FINISHED
                self.out[r.job] = r.tokens
                if self._on_done is not None:
                    self._on_done(r.job, r.tokens)
            else:
                r.state = RowState.RUNNING
                keep.append(i)
        return keep

    def results(self) -> list[list[int]]:
        """Every prompt's new tokens, in lane order (once every row finished)."""
        missing = [i for i, t in enumerate(self.out) if t is None]
        if missing:
            raise RuntimeError(f"lane results asked for with {len(missing)} rows not finished (first: {missing[0]})")
        return [t for t in self.out if t is not None]
