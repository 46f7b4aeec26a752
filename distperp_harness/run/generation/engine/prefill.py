"""Rows joining a lane: the shared prefix's cache (:class:`PrefixCache`, once per rank) and the prefill of admitted
prompts (:class:`Prefiller`), the same for every KV batch kind.

Admitted prompts are prefilled together, left-padded among themselves: those that start with the lane's shared
prefix continue from its KV cache in one forward (one each where rows attend alone), the others whole in another.
Each forward's last logits give the rows their first tokens (the loop's ``start``: chosen on the device, read back
once per forward).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol, Sequence, cast

import torch

from distperp_harness.model.row_attention import attending_alone
from distperp_harness.model.row_products import at_least_rows
from distperp_harness.run.generation.engine.masks import mask_layout, row_masks, row_positions
from distperp_harness.run.generation.engine.scheduler import GenRow, Lane
from distperp_harness.run.generation.engine.stats import LaneStats
from distperp_harness.run.generation.engine.transfer import to_device
from distperp_harness.run.scoring.engine.kvcache import CacheNotShareable, cache_argument, whole_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)`` of shape ``[rows, kv heads, length, head dim]``."""


class CacheLayer(Protocol):
    """A cache layer holding every row's keys and values (``[rows, kv heads, length, head dim]``)."""

    keys: torch.Tensor
    values: torch.Tensor


class PrefillCache(Protocol):
    """A ``DynamicCache`` of plain ``DynamicLayer``s (:func:`plain_layers`; sliding-window and chunked layers kept
    whole too: :mod:`.masks`) that has run a prefill."""

    @property
    def layers(self) -> Sequence[CacheLayer]: ...


@dataclass(frozen=True)
class Prefilled:
    """One prefill forward's rows that go on running. ``group``: the rows prefilled together; ``cache`` (a
    ``DynamicCache``) and ``mask`` (``[len(group), width]``, 1 on each row's tokens) hold the whole group; ``keep``:
    the indices of its running rows; ``spans[i]``: how many trailing columns of ``mask`` row ``keep[i]`` reaches
    into (its first 1 and everything after it) and ``lengths[i]`` its tokens (its 1s: the next position), both
    known on the host so that no batch reads the mask back."""

    group: list[GenRow]
    cache: PrefillCache
    mask: torch.Tensor
    keep: list[int]
    spans: list[int]
    lengths: list[int]

    @property
    def rows(self) -> list[GenRow]:
        return [self.group[i] for i in self.keep]


def last_logits(model: torch.nn.Module, cache, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """``[rows, vocab]`` logits of the last position of ``input_ids``, the forward writing its keys and values into
    ``cache`` (every generation forward: prefix, prefill, decode)."""
    return model(
        input_ids=input_ids, use_cache=True, logits_to_keep=1, **inputs, **{cache_argument(model): cache}
    ).logits[:, -1, :]


def alone_rows(model: torch.nn.Module, lengths: Sequence[tuple[int, int]] | None) -> ContextManager:
    """The context of a generation forward whose right-aligned rows attend alone, row ``b`` with its last
    ``lengths[b] = (queries, keys)`` positions over its last keys, with every matrix product of 16 rows or a number
    that computes as 16 do (:mod:`~distperp_harness.model.row_attention`,
    :mod:`~distperp_harness.model.row_products`); None: the forward as the model does it."""
    if lengths is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(at_least_rows(model))
    stack.enter_context(attending_alone(model, lengths, right=True))
    return stack


def plain_layers(cache) -> list:
    """The layers of a ``DynamicCache`` when every one is a plain ``DynamicLayer`` (rows can be joined, dropped and
    trimmed); raises :class:`~distperp_harness.run.scoring.engine.kvcache.CacheNotShareable` naming the layer types
    otherwise."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        names = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise CacheNotShareable("/".join(names))
    return layers


class PrefixCache:
    """KV caches of shared prefixes (batch of one), kept per rank across lanes: a few-shot block or a chat system
    prompt is computed once per rank, not once per lane. A prefix's cache is the same bits whenever it is computed
    (same tokens, batch of one), so reusing it never changes a result."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()

    def get(
        self,
        model: PreTrainedModel,
        prefix: Sequence[int],
        device: torch.device,
        around: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> tuple[KV, bool]:
        """``(the prefix's per-layer keys and values, computed now)``; ``around``: see :class:`Prefiller`."""
        key = tuple(prefix)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], False
        cache = whole_cache()
        ids = to_device([key], torch.long, device)
        layout = mask_layout(model)
        extra = {}  # full attention: the model's own causal mask; windows: slots' masks by position (masks.py)
        if layout is not None and layout.span:
            extra["attention_mask"] = row_masks(model, layout, torch.ones_like(ids), len(key))
        with around():  # the root forward (one position of the head), as every other forward of generation
            last_logits(model, cache, ids, **extra)
        self._entries[key] = [(layer.keys, layer.values) for layer in plain_layers(cache)]
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return self._entries[key], True


@dataclass
class Prefiller:
    """Prefills the rows admitted to one lane. ``around()``: a context entered around every forward (e.g. a shard
    group's step: every member makes the same forward calls); ``stats``: the lane's counters (prefill work).
    Build it with :meth:`for_lane`, which computes (or reuses) the lane's shared prefix first."""

    model: PreTrainedModel
    lane: Lane
    pad: int
    device: torch.device
    stats: LaneStats
    around: Callable[[], ContextManager] = contextlib.nullcontext
    prefix_kv: KV | None = None
    rows_alone: bool = False
    prefixes: PrefixCache | None = None

    @classmethod
    def for_lane(
        cls,
        model: PreTrainedModel,
        lane: Lane,
        tokenizer,
        device: torch.device,
        prefixes: PrefixCache | None,
        around: Callable[[], ContextManager],
        rows_alone: bool = False,
    ) -> Prefiller:
        stats = LaneStats(
            prompts=len(lane.prompts), prompt_tokens=sum(len(p) for p in lane.prompts), shared_tokens=len(lane.prefix)
        )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        out = cls(model, lane, pad, device, stats, around, rows_alone=rows_alone, prefixes=prefixes or PrefixCache())
        if not lane.prefixes and any(lane.uses_prefix(i) for i in range(len(lane.prompts))):
            out.prefix_kv, stats.prefix_computed = (prefixes or PrefixCache()).get(model, lane.prefix, device, around)
            stats.prefill_positions += len(lane.prefix) if stats.prefix_computed else 0
        return out

    def groups(
        self, admitted: Sequence[GenRow], start: Callable[[Sequence[GenRow], torch.Tensor], list[int]]
    ) -> Iterator[Prefilled]:
        """Prefill ``admitted`` rows: those continuing the lane's prefix first (one forward for them, or one each with
        ``rows_alone``), then those prefilled whole, one forward; ``start(group, last_logits)`` gives each row its
        first token and returns the indices of the rows still running (rows that already ended are dropped). Yields
        a :class:`Prefilled` per group with a row still running. Lazy: a group is prefilled only when the previous
        one has been taken, so consume each in the loop that yields it (a running batch written from group 1 is what
        group 2 joins), never ``list()`` it."""
        lane = self.lane
        continuing = [r for r in admitted if lane.uses_prefix(r.job)]
        # rows attending alone continue their prefix one row per forward: [prefix][own tokens] with no pads between,
        # so that each row's keys are its trailing columns (and each may continue a prefix of its own)
        groups = [[r] for r in continuing] if self.rows_alone or lane.prefixes else [continuing]
        groups.append([r for r in admitted if not lane.uses_prefix(r.job)])
        for k, group in enumerate(groups):
            if not group:
                continue
            kv, shared = self._prefix_of(group[0].job) if k < len(groups) - 1 else (None, 0)
            prompts = [lane.prompts[r.job] for r in group]
            with self.around():
                cache, mask, logits = self._prefill(prompts, shared, kv)
            keep = start(group, logits)
            if keep:
                width = int(mask.shape[1])  # a shared prefix starts at column 0; a whole prompt after its pads
                spans = [width if shared else len(prompts[i]) for i in keep]
                yield Prefilled(group, cache, mask, keep, spans, [len(prompts[i]) for i in keep])

    def _prefix_of(self, job: int) -> tuple[KV | None, int]:
        """``(keys and values, tokens)`` of the prefix prompt ``job`` continues: the lane's, or its own (computed
        once per rank, :class:`PrefixCache`)."""
        prefix = self.lane.prefix_of(job)
        if not self.lane.prefixes:
            return self.prefix_kv, len(prefix)
        kv, computed = (self.prefixes or PrefixCache()).get(self.model, prefix, self.device, self.around)
        self.stats.prefix_computed = self.stats.prefix_computed or computed
        self.stats.prefill_positions += len(prefix) if computed else 0
        return kv, len(prefix)

    def _prefill(
        self, prompts: Sequence[Sequence[int]], shared: int, prefix_kv: KV | None = None
    ) -> tuple[PrefillCache, torch.Tensor, torch.Tensor]:
        """``[prefix][pads][own tokens]`` per row (the prefix from its cache), positions from the mask's cumulative
        sum. Returns the rows' cache, mask ``[rows, shared + width]`` and last logits."""
        device = self.device
        suffixes = [list(p[shared:]) for p in prompts]
        width = max(len(s) for s in suffixes)
        ids = to_device([[self.pad] * (width - len(s)) + s for s in suffixes], torch.long, device)
        own = to_device([[0] * (width - len(s)) + [1] * len(s) for s in suffixes], torch.long, device)
        cache = whole_cache()
        if shared:
            mask = torch.cat([torch.ones((len(prompts), shared), dtype=torch.long, device=device), own], 1)
            for i, (k, v) in enumerate(prefix_kv or []):
                cache.update(
                    k.expand(len(prompts), -1, -1, -1).contiguous(), v.expand(len(prompts), -1, -1, -1).contiguous(), i
                )
        else:
            mask = own
        positions = row_positions(mask).clamp_min(0)[:, shared:]
        positions = positions.masked_fill(own == 0, 1)  # what generate gives pads; never attended to
        layout = mask_layout(self.model)  # 4D: causal over [prefix][pads][own], pads hidden, windows by position
        # rows of equal length from column 0 under plain causal layers need no mask: sdpa takes its causal path (as
        # each row alone does under batch_invariant) instead of a [rows, width, width] mask (4 GiB as float32 for
        # one 32k-token prompt), and no all-ones 2D mask is read back to find that out
        plain = not shared and all(len(s) == width for s in suffixes)
        attention: Any
        if layout is None:
            attention = mask
        else:
            attention = None if plain and not layout.span else row_masks(self.model, layout, mask, width)
        with alone_rows(self.model, [(len(s), shared + len(s)) for s in suffixes] if self.rows_alone else None):
            logits = last_logits(self.model, cache, ids, attention_mask=attention, position_ids=positions)
        plain_layers(cache)
        self.stats.prefill_forwards += 1
        self.stats.prefill_positions += ids.numel()
        return cast(PrefillCache, cache), mask, logits  # plain layers, checked above
