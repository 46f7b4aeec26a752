"""The running rows of a lane and their keys and values: one interface (:class:`KVBatch`), two implementations.

* :class:`DynamicKVBatch` (here): transformers' ``DynamicCache`` with plain ``DynamicLayer``s (sliding-window and
  chunked layers kept whole: :mod:`.masks`), edited between forwards. Rows are right-aligned (the cache holds
  ``[pads][row tokens]`` per row; the attention mask hides the pads, and applies each layer type's window by the
  row's positions; each row keeps its own positions); joining rows left-pads the narrower side, a finished row's KV
  row is dropped at once, and leading columns no row uses any more are trimmed. The decode forward is eager; with
  ``rows_alone`` each row attends over its own trailing columns alone (``batch_invariant=true``).
* :class:`~.static_batch.StaticKVBatch`: fixed ``[slots, heads, capacity, dim]`` buffers edited in place, the decode
  step compiled (:mod:`.step`).

Both give the same rows the same tokens: the scheduler decides everything, the batch only stores and computes.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, Sequence

import torch
import torch.nn.functional as F

from distperp_harness.run.generation.engine.masks import mask_layout, row_masks
from distperp_harness.run.generation.engine.prefill import PrefillCache, Prefilled, alone_rows, last_logits
from distperp_harness.run.generation.engine.scheduler import GenRow
from distperp_harness.run.generation.engine.stats import LaneStats
from distperp_harness.run.generation.engine.transfer import to_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class KVBatch(Protocol):
    """The running rows of one lane (at most ``slots``) and their KV cache."""

    @property
    def rows(self) -> list[GenRow]:
        """The running rows, in the order :meth:`step` returns their logits."""

    def free(self) -> int:
        """Slots a newly admitted row may take now."""

    def join(self, prefilled: Prefilled) -> None:
        """A prefill's running rows start running, with their rows of its cache and mask."""

    def step(self) -> torch.Tensor:
        """One decode forward of every running row's last token: ``[len(rows), vocab]`` logits. Never reads the
        device back (the loop's one read a step is the chosen tokens)."""

    def drop(self, keep: Sequence[int]) -> None:
        """Only ``rows[i]`` for ``i`` in ``keep`` keep running; the others' keys and values are released."""


def join_right_aligned(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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


class DynamicKVBatch:
    """:class:`KVBatch` over one ``DynamicCache`` edited between eager forwards (module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        slots: int,
        device: torch.device,
        stats: LaneStats,
        around: Callable[[], ContextManager] = contextlib.nullcontext,
        rows_alone: bool = False,
    ) -> None:
        self.model, self.slots, self.device, self.stats, self.around = model, slots, device, stats, around
        self.rows_alone = rows_alone  # each row attends over its own keys alone: [pads][prefix][row], no pads inside
        self.rows: list[GenRow] = []
        self.cache: PrefillCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, columns] long
        self._spans: list[int] = []  # per row: the trailing columns from its first used one (host-side)
        self.layout = mask_layout(model)  # 4D masks: transformers reads a 2D one back (may it skip it?)

    def free(self) -> int:
        return self.slots - len(self.rows)

    def join(self, prefilled: Prefilled) -> None:
        cache = prefilled.cache
        index = to_device(prefilled.keep, torch.long, self.device)
        mask = prefilled.mask.index_select(0, index)
        layers = [(layer.keys.index_select(0, index), layer.values.index_select(0, index)) for layer in cache.layers]
        if self.cache is None or self.mask is None:  # no running row: both are set and cleared together
            self.cache, self.mask = cache, mask
            for layer, (k, v) in zip(cache.layers, layers):
                layer.keys, layer.values = k, v
        else:
            self.mask = join_right_aligned(self.mask, mask)
            for layer, (k, v) in zip(self.cache.layers, layers):
                layer.keys, layer.values = join_right_aligned(layer.keys, k), join_right_aligned(layer.values, v)
        self.rows = self.rows + prefilled.rows
        self._spans = self._spans + prefilled.spans

    def step(self) -> torch.Tensor:
        rows, device = self.rows, self.device
        if self.mask is None:
            raise RuntimeError("internal error: a decode step with no running row")
        positions = self.mask.sum(1, keepdim=True)  # each row's next position: the tokens it holds
        self.mask = torch.cat([self.mask, torch.ones((len(rows), 1), dtype=self.mask.dtype, device=device)], 1)
        self.stats.peak_cache_positions = max(self.stats.peak_cache_positions, self.mask.numel())
        ids = to_device([[r.tokens[-1]] for r in rows], torch.long, device)
        mask = self.mask if self.layout is None else row_masks(self.model, self.layout, self.mask, 1)
        alone = [(1, span + 1) for span in self._spans] if self.rows_alone else None
        with self.around(), alone_rows(self.model, alone):
            logits = last_logits(self.model, self.cache, ids, attention_mask=mask, position_ids=positions)
        self._spans = [span + 1 for span in self._spans]
        self.stats.decode_forwards += 1
        self.stats.decode_positions += len(rows)
        return logits

    def drop(self, keep: Sequence[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self._spans = [self._spans[i] for i in keep]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        if self.cache is None or self.mask is None:
            raise RuntimeError("internal error: running rows without their cache")
        index = to_device(list(keep), torch.long, self.device)
        mask = self.mask.index_select(0, index)
        first = mask.shape[1] - max(self._spans)  # leading columns no row uses any more
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
