"""The fixed-shape KV batch: a lane's slots over one bucket's static buffers, edited in place, decoded by the
compiled step (:class:`~.step.CompiledStep`).

**Buffers** (:class:`StaticBuffers`). A lane of ``S`` slots whose longest prompt plus ``max_new`` is ``n`` tokens
decodes over transformers' ``StaticCache`` of ``[S, heads, C, head_dim]`` per layer (``StaticLayer``: allocated
once, ``mark_static_address``: CUDA graphs read them where they are), ``C`` = ``n`` rounded up to a bucket (few
shapes compile), and a boolean ``[S, C]`` mask of the columns each slot attends to.

**Rows** (:class:`StaticKVBatch`) are right-aligned at one write column ``w`` shared by all slots (like the dynamic
batch):

* **join**: each kept row's prefill key/value columns (keys rotated with its own positions) and mask are copied
  in place into the lowest free slot's columns ``[w - L, w)`` (``L`` the prefill's width; when ``w < L`` the live
  columns first move right to make room);
* **step**: one forward of ``[S, 1]`` tokens, per-row position ids, every slot attending to column ``w``, which it
  writes. A free slot is fed the pad token and sees only its own column: harmless, and counted
  (``padded_positions``);
* **full**: when ``w`` reaches ``C``, the live columns move left by the first column any live row uses (rare: a
  row never spans more than ``longest + max_new - 1 < C`` columns, so there is always room after it).

Everything is a function of the lane's prompts and generated tokens only: the same bits on any rank.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, Sequence, cast

import torch

from distperp_harness.run.generation.scheduler import Row
from distperp_harness.run.generation.stats import LaneStats
from distperp_harness.run.scoring.kvcache import CacheNotShareable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _Allocated(Protocol):
    """A ``StaticLayer`` after ``lazy_initialization``: its buffers exist (transformers types them ``None`` until
    then) and ``cumulative_length`` is a tensor."""

    keys: torch.Tensor
    values: torch.Tensor
    cumulative_length: torch.Tensor


class StaticBuffers:
    """One bucket's fixed tensors: a ``StaticCache`` of ``slots`` rows and ``capacity`` columns, and the mask
    ``allowed``; ``length`` is the column the next step writes (every layer's ``cumulative_length``). ``shapes``:
    ``(kv heads, key dim, value dim, dtype)`` per layer."""

    def __init__(
        self, model: PreTrainedModel, slots: int, capacity: int, shapes: Sequence[tuple], device: torch.device
    ) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.slots, self.capacity = slots, capacity
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        static = [layer for layer in self.cache.layers if type(layer) is StaticLayer]
        if len(self.cache.layers) != len(shapes) or len(static) != len(self.cache.layers):
            raise CacheNotShareable("/".join(sorted({type(layer).__name__ for layer in self.cache.layers})))
        for layer, (heads, k_dim, v_dim, dtype) in zip(static, shapes):  # allocates, marks static
            layer.lazy_initialization(
                torch.empty(slots, heads, 1, k_dim, dtype=dtype, device=device),
                torch.empty(slots, heads, 1, v_dim, dtype=dtype, device=device),
            )
        self.allowed = torch.zeros(slots, capacity, dtype=torch.bool, device=device)
        torch._dynamo.mark_static_address(self.allowed)
        self.length = 0

    @property
    def layers(self) -> list[_Allocated]:
        """The cache's layers, every one a ``StaticLayer`` with its buffers allocated (by ``__init__``)."""
        return cast(list[_Allocated], self.cache.layers)  # transformers types their buffers None-able

    def reset(self) -> None:
        """Empty every slot (zeros, so nothing of an earlier lane is left), write column 0."""
        for layer in self.layers:
            layer.keys.zero_()
            layer.values.zero_()
        self.allowed.zero_()
        self.set_length(0)

    def set_length(self, w: int) -> None:
        """The column the next decode step writes (every layer's ``cumulative_length``)."""
        for layer in self.layers:
            layer.cumulative_length.fill_(w)
        self.length = w

    def write(
        self, slot: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], mask_row: torch.Tensor, lo: int
    ) -> None:
        """Slot ``slot`` := one prefilled row: ``kv`` per layer ``([heads, L, dim], [heads, L, dim])`` and its
        ``[L]`` mask, at columns ``[lo, lo + L)``; every other column of the slot masked."""
        width = mask_row.shape[0]
        for layer, (k, v) in zip(self.layers, kv):
            layer.keys[slot, :, lo : lo + width] = k
            layer.values[slot, :, lo : lo + width] = v
        self.allowed[slot] = False
        self.allowed[slot, lo : lo + width] = mask_row.bool()

    def move(self, lo: int, hi: int, offset: int) -> None:
        """Columns ``[lo, hi)`` of every slot move by ``offset`` (in place); the columns they leave are masked."""
        if offset == 0 or hi <= lo:
            return
        for layer in self.layers:
            for t in (layer.keys, layer.values):
                t[:, :, lo + offset : hi + offset] = t[:, :, lo:hi].clone()
        self.allowed[:, lo + offset : hi + offset] = self.allowed[:, lo:hi].clone()
        if offset < 0:
            self.allowed[:, max(lo, hi + offset) : hi] = False
        else:
            self.allowed[:, lo : min(hi, lo + offset)] = False


class StaticKVBatch:
    """:class:`~.kv_batch.KVBatch` over ``buffers``, decoded by ``step`` (a :class:`~.step.CompiledStep`: called
    as ``step.run(buffers, ids, positions)``; its ``state`` counts shifts and padded positions)."""

    def __init__(
        self,
        step,
        buffers: StaticBuffers,
        device: torch.device,
        stats: LaneStats,
        around: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> None:
        self.step_fn, self.buffers, self.device, self.stats, self.around = step, buffers, device, stats, around
        self.pad = step.pad
        slots = buffers.slots
        self._by_slot: list[Row | None] = [None] * slots
        self._position = [0] * slots  # each slot's next position: the tokens its row holds
        self._start = [0] * slots  # each slot's first column
        self._w = 0  # the column the next step writes
        buffers.reset()
        stats.peak_cache_positions = slots * buffers.capacity

    @property
    def rows(self) -> list[Row]:
        return [r for r in self._by_slot if r is not None]

    def _live(self) -> list[int]:
        return [s for s, r in enumerate(self._by_slot) if r is not None]

    def free(self) -> int:
        return self._by_slot.count(None)

    def join(self, group: Sequence[Row], cache, mask: torch.Tensor, keep: Sequence[int]) -> None:
        buffers, width = self.buffers, mask.shape[1]
        if self._w < width:  # room on the left for the new rows: the live columns move right
            running = self._live()
            if running:
                first = min(self._start[s] for s in running)
                buffers.move(first, self._w, width - self._w)
                for s in running:
                    self._start[s] += width - self._w
            self._w = width
            buffers.set_length(self._w)
        free = [s for s, r in enumerate(self._by_slot) if r is None]
        for s, i in zip(free, keep):
            buffers.write(s, [(layer.keys[i], layer.values[i]) for layer in cache.layers], mask[i], self._w - width)
            self._by_slot[s], self._position[s], self._start[s] = group[i], int(mask[i].sum()), self._w - width

    def _shift_left(self, running: list[int]) -> None:
        first = min(self._start[s] for s in running)
        self.buffers.move(first, self._w, -first)
        for s in running:
            self._start[s] -= first
        self._w -= first
        self.buffers.set_length(self._w)
        self.step_fn.state.shifts += 1

    def step(self) -> torch.Tensor:
        buffers, device, slots = self.buffers, self.device, self.buffers.slots
        running = self._live()
        if self._w == buffers.capacity:
            self._shift_left(running)
        w = self._w
        ids = torch.tensor(
            [[r.tokens[-1] if r is not None else self.pad] for r in self._by_slot], dtype=torch.long, device=device
        )
        positions = torch.tensor(
            [[self._position[s] if r is not None else 0] for s, r in enumerate(self._by_slot)],
            dtype=torch.long,
            device=device,
        )
        buffers.allowed[:, w] = True  # every slot sees the column it writes; a free slot only that one
        with self.around():
            logits = self.step_fn.run(buffers, ids, positions)
        buffers.allowed[:, w] = torch.tensor([r is not None for r in self._by_slot], device=device)
        self._w = w + 1
        buffers.length = self._w
        for s in running:
            self._position[s] += 1
        self.stats.decode_forwards += 1
        self.stats.decode_positions += len(running)
        self.stats.padded_positions += slots - len(running)
        self.step_fn.state.padded_positions += slots - len(running)
        return logits.index_select(0, torch.tensor(running, dtype=torch.long, device=device))

    def drop(self, keep: Sequence[int]) -> None:
        kept = set(keep)
        for i, s in enumerate(self._live()):
            if i not in kept:
                self._by_slot[s] = None
                self.buffers.allowed[s] = False
