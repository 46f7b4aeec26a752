"""Continuous batching of one lane: ``slots`` rows decode together, each stops on its own, a freed slot is refilled.

A *lane* is a fixed list of prompts (:mod:`distperp_harness.run.lanes`). :func:`decode_lane` walks it in steps:

1. **admit**: every free slot takes the next prompt of the lane's queue, in order; the admitted prompts are
   prefilled together (left-padded among themselves; those that start with the lane's shared prefix from its KV
   cache, computed once per rank by :class:`PrefixCache`, in one forward, the others whole in another), and their
   last logits give each its first token. Their KV rows join the running batch, right-aligned (the batch cache holds ``[pads][row tokens]`` per
   row; the attention mask hides the pads; each row keeps its own positions).
2. **decode**: one forward of every running row's last token.
3. **stop**: a row ends as soon as its new tokens hold one of its ``until`` strings (the tail of its new tokens
   decoded, as lm-eval's criteria look), or an EOS id, or it has ``max_new`` tokens; its KV row is dropped at
   once, and leading cache columns that no row uses any more are trimmed.

Which prompt enters which slot at which step, and so the shape and content of every forward, is a pure function
of the lane's prompts and the tokens generated: a lane gives the same bits on any rank, for any world size.

The batch cache is transformers' ``DynamicCache`` with plain ``DynamicLayer``s, edited between forwards (rows
joined, dropped, columns trimmed). A model whose cache has other layers (sliding windows, recurrent state) raises
:class:`~distperp_harness.run.kvcache.CacheNotShareable` before any token is chosen; the caller then generates
that lane with ``model.generate`` batches.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F

from distperp_harness.run.kvcache import CacheNotShareable, cache_argument
from distperp_harness.run.sampling import draw, generators_for


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
    def of(cls, tokenizer, until: Sequence[str], eos_ids: Sequence[int], max_new: int,
           allowed: Callable[[list[int]], bool] | None = None) -> "StopRule":
        """lm-eval's lookback: the longest stop string's token count plus 2 (``MultiTokenEOSCriteria``)."""
        until = tuple(s for s in until if s)
        lookback = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in until), default=0) + 2
        return cls(until, frozenset(int(i) for i in eos_ids), int(max_new), lookback, allowed)

    def done(self, tokens: list[int], decode: Callable[[list[int]], str]) -> bool:
        if tokens[-1] in self.eos_ids or len(tokens) >= self.max_new:
            return True
        if not self.until:
            return False
        tail = decode(tokens[-self.lookback:])
        return any(s in tail for s in self.until) and (self.allowed is None or self.allowed(tokens))


@dataclass
class LaneStats:
    """Work of one lane. ``prefill_positions`` counts every position run through the model before the first token
    (pads included, a shared prefix only when computed here); ``decode_positions``: rows of every decode forward;
    ``generated``: new tokens kept (up to and including the one that ended each row); ``padded_positions``: free
    slots' positions a fixed-shape decode step computed (:mod:`~distperp_harness.run.static_slots`; 0 here)."""

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

    def add(self, other: "LaneStats") -> None:
        for name in ("prompts", "prompt_tokens", "prefill_forwards", "prefill_positions", "decode_forwards",
                     "decode_positions", "generated", "padded_positions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_cache_positions = max(self.peak_cache_positions, other.peak_cache_positions)


class PrefixCache:
    """KV caches of shared prefixes (batch of one), kept per rank across lanes: a few-shot block or a chat system
    prompt is computed once per rank, not once per lane. A prefix's cache is the same bits whenever it is computed
    (same tokens, batch of one), so reusing it never changes a result."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def get(self, model: torch.nn.Module, prefix: Sequence[int], device: torch.device,
            around: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[list, bool]:
        """``(per-layer (keys, values) of shape [1, heads, len, dim], computed now)``; ``around``: see
        :func:`decode_lane`."""
        key = tuple(prefix)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], False
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with around():  # the root forward (one position of the head), as every other forward of generation
            model(input_ids=torch.tensor([key], device=device), use_cache=True, logits_to_keep=1,
                  **{cache_argument(model): cache})
        layers = _plain_layers(cache)
        self._entries[key] = [(layer.keys, layer.values) for layer in layers]
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return self._entries[key], True


def _plain_layers(cache) -> list:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        names = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise CacheNotShareable("/".join(names))
    return layers


@dataclass
class _Row:
    job: int
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Lane:
    """What :func:`decode_lane` needs: prompts (already cut to fit), the shared prefix (tokens; empty: none; the
    prompts that start with it and hold more continue from its cache), slots and seeds (``None`` for greedy)."""

    prompts: Sequence[Sequence[int]]
    prefix: tuple[int, ...]
    slots: int
    seeds: Sequence[int] | None = None

    def uses_prefix(self, index: int) -> bool:
        prompt, n = self.prompts[index], len(self.prefix)
        return n > 0 and len(prompt) > n and tuple(prompt[:n]) == self.prefix


@torch.no_grad()
def decode_lane(model: torch.nn.Module, lane: Lane, rule: StopRule, *, tokenizer, device: torch.device,
                prefixes: PrefixCache | None = None, warpers=None,
                on_done: Callable[[int, list[int]], None] | None = None,
                around: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[list[list[int]], LaneStats]:
    """New tokens for every prompt of ``lane``, in lane order, and the lane's :class:`LaneStats`.

    ``warpers``: the distribution warpers of a sampled lane (``lane.seeds`` given); greedy otherwise.
    ``on_done(index, tokens)``: called as each row ends. ``around()``: a context entered around every forward
    (prefix, prefill, decode), e.g. a shard group's step (every member makes the same forward calls). Raises
    :class:`CacheNotShareable` (before choosing any token) when the model's cache cannot be edited row by row.
    """

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    arg = cache_argument(model)
    decode = tokenizer.decode
    stats = LaneStats(prompts=len(lane.prompts), prompt_tokens=sum(len(p) for p in lane.prompts),
                      shared_tokens=len(lane.prefix))
    prefix_kv = None
    if any(lane.uses_prefix(i) for i in range(len(lane.prompts))):
        prefix_kv, stats.prefix_computed = (prefixes or PrefixCache()).get(model, lane.prefix, device, around)
        stats.prefill_positions += len(lane.prefix) if stats.prefix_computed else 0
    out: list[list[int] | None] = [None] * len(lane.prompts)
    queue = list(range(len(lane.prompts)))[::-1]  # pop() takes the next prompt
    rows: list[_Row] = []
    cache, mask = None, None  # the running batch: DynamicCache, [rows, columns] long

    choose, ended = row_rules(lane, rule, decode, warpers, out, on_done)

    def finish(keep: list[int]) -> None:
        nonlocal cache, mask, rows
        if len(keep) == len(rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=device)
        rows = [rows[i] for i in keep]
        if not rows:
            cache, mask = None, None
            return
        mask = mask.index_select(0, index)
        first = int(mask.any(0).to(torch.int8).argmax())  # leading columns no row uses any more
        mask = mask[:, first:]
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]

    while queue or rows:
        admitted = [_Row(queue.pop()) for _ in range(min(lane.slots - len(rows), len(queue)))]
        for group, new_cache, new_mask, keep in admit(model, arg, lane, admitted, prefix_kv, pad, device, stats,
                                                      around, choose, ended):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            new_mask = new_mask.index_select(0, index)
            new_layers = [(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                          for layer in new_cache.layers]
            if cache is None:
                cache, mask, rows = new_cache, new_mask, [group[i] for i in keep]
                for layer, (k, v) in zip(cache.layers, new_layers):
                    layer.keys, layer.values = k, v
            else:
                mask = _join(mask, new_mask)
                for layer, (k, v) in zip(cache.layers, new_layers):
                    layer.keys, layer.values = _join(layer.keys, k), _join(layer.values, v)
                rows = rows + [group[i] for i in keep]
        if not rows:
            continue
        positions = mask.sum(1, keepdim=True)  # each row's next position: the tokens it holds
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], 1)
        stats.peak_cache_positions = max(stats.peak_cache_positions, mask.numel())
        ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=device)
        with around():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{arg: cache}).logits[:, -1, :]
        stats.decode_forwards += 1
        stats.decode_positions += len(rows)
        for r, token in zip(rows, choose(logits, rows)):
            r.tokens.append(token)
        finish([i for i, r in enumerate(rows) if not ended(r)])
    stats.generated = sum(len(t) for t in out)
    return out, stats


def _join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``b`` after rows of ``a`` (dim 0), both right-aligned along the sequence dimension (dim 2 of KV
    tensors, dim 1 of masks): the shorter one is padded with zeros on the left."""
    dim = 1 if a.dim() == 2 else 2
    width = max(a.shape[dim], b.shape[dim])

    def left(t: torch.Tensor) -> torch.Tensor:
        extra = width - t.shape[dim]
        if not extra:
            return t
        pad = (extra, 0) if dim == 1 else (0, 0, extra, 0)
        return F.pad(t, pad)

    return torch.cat([left(a), left(b)], 0)


def row_rules(lane: Lane, rule: StopRule, decode, warpers, out: list,
              on_done: Callable[[int, list[int]], None] | None):
    """The per-row rules every engine shares: ``choose(logits, rows)`` is each row's next token (argmax, or drawn
    with the row's own generator in a sampled lane); ``ended(row)`` says whether the row is done by ``rule`` and,
    if so, records its tokens in ``out[row.job]`` and calls ``on_done(row.job, tokens)``."""

    def choose(logits: torch.Tensor, batch_rows: Sequence[_Row]) -> list[int]:
        if lane.seeds is None:
            return logits.argmax(-1).tolist()
        return draw(warpers, logits, [r.generator for r in batch_rows]).tolist()

    def ended(row: _Row) -> bool:
        if rule.done(row.tokens, decode):
            out[row.job] = row.tokens
            if on_done is not None:
                on_done(row.job, row.tokens)
            return True
        return False

    return choose, ended


def admit(model: torch.nn.Module, arg: str, lane: Lane, admitted: Sequence[_Row], prefix_kv, pad: int,
          device: torch.device, stats: LaneStats, around: Callable[[], ContextManager],
          choose: Callable[[torch.Tensor, Sequence[_Row]], list[int]], ended: Callable[[_Row], bool]):
    """Prefill rows joining a lane: those continuing the lane's prefix first, then those prefilled whole, one
    forward per group. Sampled rows get their generators, every row its first token (``choose``), and rows that
    already ended (``ended``) are dropped. Yields ``(group, cache, mask, keep)`` per group with a row still
    running: ``cache``/``mask`` hold the whole group, ``keep`` the indices of its running rows. Lazy: a group is
    prefilled only when the previous one has been taken, so consume each in the loop that yields it (a running
    batch written from group 1 is what group 2 joins), never ``list()`` it.
    """
    groups = [[r for r in admitted if lane.uses_prefix(r.job)], [r for r in admitted if not lane.uses_prefix(r.job)]]
    for group, shared in zip(groups, (len(lane.prefix), 0)):
        if not group:
            continue
        with around():
            new_cache, new_mask, logits = _prefill(model, arg, [lane.prompts[r.job] for r in group], shared,
                                                   prefix_kv, pad, device, stats)
        if lane.seeds is not None:
            for r, g in zip(group, generators_for([lane.seeds[r.job] for r in group], device)):
                r.generator = g
        for r, token in zip(group, choose(logits, group)):
            r.tokens.append(token)
        keep = [i for i, r in enumerate(group) if not ended(r)]
        if keep:
            yield group, new_cache, new_mask, keep


def _prefill(model: torch.nn.Module, arg: str, prompts: Sequence[Sequence[int]], shared: int, prefix_kv,
             pad: int, device: torch.device, stats: LaneStats):
    """Prefill ``prompts`` together: ``[prefix][pads][own tokens]`` per row (the prefix from its cache), positions
    from the mask's cumulative sum. Returns the rows' cache, mask ``[rows, shared + width]`` and last logits."""
    from transformers import DynamicCache

    suffixes = [list(p[shared:]) for p in prompts]
    width = max(len(s) for s in suffixes)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in suffixes], dtype=torch.long, device=device)
    own = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in suffixes], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    if shared:
        mask = torch.cat([torch.ones((len(prompts), shared), dtype=torch.long, device=device), own], 1)
        for i, (k, v) in enumerate(prefix_kv):
            cache.update(k.expand(len(prompts), -1, -1, -1).contiguous(),
                         v.expand(len(prompts), -1, -1, -1).contiguous(), i)
    else:
        mask = own
    positions = (mask.cumsum(1) - 1).clamp_min(0)[:, shared:]
    positions = positions.masked_fill(own == 0, 1)  # what generate gives pads; never attended to
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                   **{arg: cache}).logits[:, -1, :]
    _plain_layers(cache)
    stats.prefill_forwards += 1
    stats.prefill_positions += ids.numel()
    return cache, mask, logits
