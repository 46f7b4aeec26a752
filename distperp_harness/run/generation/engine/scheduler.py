"""The scheduler of one lane: its queue, admission in lane order, each row's tokens and the stop rules. It owns no
tensor: tokens are chosen on the device (:mod:`.choose`) and handed to it as host integers once a step; the KV batch
(:mod:`.kv_batch`, :mod:`.static_batch`) owns the cache and the decode forward.

A *lane* (:class:`Lane`) is a fixed list of prompts decoded in ``slots`` rows (:mod:`.lanes` cuts them). Which
prompt is admitted when is a pure function of the lane's prompts and the tokens generated (a free slot takes the
next prompt of the queue, in lane order), so a lane gives the same bits on any rank, for any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass
class GenRow:
    """One prompt of a lane (``job``: its index in the lane) and the tokens generated for it so far."""

    job: int
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


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
        """Whether one row ends with ``tokens`` (``decode``: token ids to text)."""
        return self.ended([tokens], lambda tails: [decode(t) for t in tails])[0]

    def ended(self, rows: Sequence[list[int]], batch_decode: Callable[[list[list[int]]], list[str]]) -> list[bool]:
        """Whether each row ends with its tokens; the stop strings of every row still open are looked for in one
        ``batch_decode`` of their last ``lookback`` tokens (one call a step, not one per row)."""
        out = [tokens[-1] in self.eos_ids or len(tokens) >= self.max_new for tokens in rows]
        open_rows = [i for i, done in enumerate(out) if not done]
        if not self.until or not open_rows:
            return out
        tails = batch_decode([rows[i][-self.lookback :] for i in open_rows])
        for i, tail in zip(open_rows, tails):
            out[i] = any(s in tail for s in self.until) and (self.allowed is None or self.allowed(rows[i]))
        return out


def eos_ids(tokenizer, model: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS and the model's ``generation_config`` EOS ids (what ``generate`` stops at)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return [int(i) for i in ids if i is not None]


@dataclass(frozen=True)
class Lane:
    """A lane's prompts (already cut to fit), the shared prefix (tokens; empty: none; the prompts that start with it
    and hold more continue from its cache), slots and seeds (``None`` for greedy). ``prefixes``: instead of one
    shared prefix, each prompt's own (its first ``prefixes[i]`` tokens continued from their cache; 0: whole)."""

    prompts: Sequence[Sequence[int]]
    prefix: tuple[int, ...]
    slots: int
    seeds: Sequence[int] | None = None
    prefixes: Sequence[int] = ()

    def uses_prefix(self, index: int) -> bool:
        prompt, n = self.prompts[index], len(self.prefix_of(index))
        return n > 0 and len(prompt) > n and (bool(self.prefixes) or tuple(prompt[:n]) == self.prefix)

    def prefix_of(self, index: int) -> tuple[int, ...]:
        """The prefix prompt ``index`` continues where it :meth:`uses_prefix`."""
        return tuple(self.prompts[index][: self.prefixes[index]]) if self.prefixes else self.prefix


class Scheduler:
    """The queue and rows of one lane.

    ``admit(free)`` takes the next prompts for ``free`` slots; ``advance(rows, tokens)`` appends each running row's
    next token (chosen on the device, read back once for the whole step) and returns the indices of the rows still
    running; a row that ends has its tokens in :attr:`out` and ``on_done(job, tokens)`` is called, in row order.
    ``batch_decode``: token id lists to texts in one call (the stop strings of a step's rows)."""

    def __init__(
        self,
        lane: Lane,
        rule: StopRule,
        batch_decode: Callable[[list[list[int]]], list[str]],
        on_done: Callable[[int, list[int]], None] | None = None,
    ) -> None:
        self.lane, self.rule, self._batch_decode, self._on_done = lane, rule, batch_decode, on_done
        self._queue = list(range(len(lane.prompts)))[::-1]  # pop() takes the next prompt
        self.out: list[list[int] | None] = [None] * len(lane.prompts)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def admit(self, free: int) -> list[GenRow]:
        """The next ``free`` prompts (fewer when the queue runs out), in lane order."""
        return [GenRow(self._queue.pop()) for _ in range(min(free, len(self._queue)))]

    def advance(self, rows: Sequence[GenRow], tokens: Sequence[int]) -> list[int]:
        """GenRow ``rows[i]`` takes ``tokens[i]``; then the stop rule for every row at once. Returns the indices of the
        rows still running."""
        for r, token in zip(rows, tokens):
            r.tokens.append(token)
        keep = []
        for i, (r, done) in enumerate(zip(rows, self.rule.ended([r.tokens for r in rows], self._batch_decode))):
            if done:
                self.out[r.job] = r.tokens
                if self._on_done is not None:
                    self._on_done(r.job, r.tokens)
            else:
                keep.append(i)
        return keep

    def results(self) -> list[list[int]]:
        """Every prompt's new tokens, in lane order (once every row finished)."""
        missing = [i for i, t in enumerate(self.out) if t is None]
        if missing:
            raise RuntimeError(f"lane results asked for with {len(missing)} rows not finished (first: {missing[0]})")
        return [t for t in self.out if t is not None]
