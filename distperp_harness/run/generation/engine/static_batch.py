"""The fixed-shape KV batch: a lane's slots over one bucket's static buffers, edited in place, decoded by the
compiled step (:class:`~.step.CompiledStep`).

**Buffers** (:class:`StaticBuffers`). A lane of ``S`` slots whose longest prompt plus ``max_new`` is ``n`` tokens
decodes over transformers' ``StaticCache`` of ``[S, heads, C, head_dim]`` per layer (every layer a plain
``StaticLayer``, sliding-window and chunked ones too: allocated once, ``mark_static_address``: CUDA graphs read them
where they are), ``C`` = ``n`` rounded up to a bucket (few shapes compile), a boolean ``[S, C]`` mask of the columns
each slot attends to and, for a model with windows, each column's position in its slot's row (``[S, C]``: the step
applies each layer type's window or chunk by position, :mod:`.masks`).

**Rows** (:class:`StaticKVBatch`) are right-aligned at one write column ``w`` shared by all slots (like the dynamic
batch):

* **join**: each kept row's prefill key/value columns (keys rotated with its own positions) and mask are copied
  in place into the lowest free slot's columns ``[w - L, w)`` (``L`` the prefill's width; when ``w < L`` the live
  columns first move right to make room);
* **step**: one forward of ``[S, 1]`` tokens, per-row position ids, every slot attending to column ``w`` (at its
  row's next position), which it writes. A free slot is fed the pad token and sees only its own column: harmless,
  and counted (``padded_positions``). The step's inputs (tokens and positions) reach the device in one
  non-blocking copy into fixed tensors (:attr:`StaticBuffers.inputs`), and nothing is read back: the forward can be
  replayed as a CUDA graph (:mod:`.cudagraphs`);
* **full**: when ``w`` reaches ``C``, the live columns move left by the first column any live row uses (rare: a
  row never spans more than ``longest + max_new - 1 < C`` columns, so there is always room after it).

Everything is a function of the lane's prompts and generated tokens only: the same bits on any rank.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, Sequence, cast

import torch

from distperp_harness.run.generation.engine.masks import row_positions
from distperp_harness.run.generation.engine.prefill import Prefilled
from distperp_harness.run.generation.engine.scheduler import GenRow
from distperp_harness.run.generation.engine.stats import LaneStats
from distperp_harness.run.generation.engine.transfer import to_device, write_into
from distperp_harness.run.scoring.engine.kvcache import CacheNotShareable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _Allocated(Protocol):
    """A ``StaticLayer`` after ``lazy_initialization``: its buffers exist (transformers types them ``None`` until
    then) and ``cumulative_length`` is a tensor."""

    keys: torch.Tensor
    values: torch.Tensor
    cumulative_length: torch.Tensor


def whole_static_cache(model: PreTrainedModel, capacity: int, layers: int):
    """transformers' ``StaticCache`` of ``capacity`` columns for ``model`` with its ``layers`` layers all plain
    ``StaticLayer``s: a sliding-window or chunked layer keeps every column too (the step's masks apply its window).

    Raises:
        CacheNotShareable: naming transformers' layer types, when a layer holds more than keys and values, or the
            cache's layers are not the ``layers`` the model's forward wrote.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=model.config, max_cache_len=capacity)
    kinds = {type(layer) for layer in cache.layers}
    if len(cache.layers) != layers or kinds - {StaticLayer, StaticSlidingWindowLayer}:
        raise CacheNotShareable("/".join(sorted(kind.__name__ for kind in kinds)))
    cache.layers = [StaticLayer(max_cache_len=capacity) for _ in range(layers)]
    return cache


class StaticBuffers:
    """One bucket's fixed tensors: a ``StaticCache`` of ``slots`` rows and ``capacity`` columns
    (:func:`whole_static_cache`), the mask ``allowed``, each column's position in its slot's row
    ``key_positions`` (kept up to date only when ``windowed``: a rule of the model's layout needs positions), the
    step's ``inputs`` (``[2, slots]``: row 0 the tokens, row 1 the positions; :attr:`ids` and :attr:`positions` are
    ``[slots, 1]`` views of them) and ``live`` (the slots holding a row); ``length`` is the column the next step
    writes (every layer's ``cumulative_length``). ``shapes``: ``(kv heads, key dim, value dim, dtype)`` per layer.
    Every tensor keeps its address for the buffers' life (compiled graphs and CUDA graphs read them where they
    are)."""

    def __init__(
        self,
        model: PreTrainedModel,
        slots: int,
        capacity: int,
        shapes: Sequence[tuple],
        device: torch.device,
        windowed: bool = False,
    ) -> None:
        self.slots, self.capacity, self.windowed = slots, capacity, windowed
        self.cache = whole_static_cache(model, capacity, len(shapes))
        for layer, (heads, k_dim, v_dim, dtype) in zip(self.cache.layers, shapes):  # allocates, marks static
            layer.lazy_initialization(
                torch.empty(slots, heads, 1, k_dim, dtype=dtype, device=device),
                torch.empty(slots, heads, 1, v_dim, dtype=dtype, device=device),
            )
        self.allowed = torch.zeros(slots, capacity, dtype=torch.bool, device=device)
        self.key_positions = torch.zeros(slots, capacity, dtype=torch.long, device=device)
        self.inputs = torch.zeros(2, slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        for t in (self.allowed, self.key_positions, self.inputs):
            torch._dynamo.mark_static_address(t)
        self.length = 0

    @property
    def ids(self) -> torch.Tensor:
        """``[slots, 1]``: each slot's token of the next step (a view of :attr:`inputs`)."""
        return self.inputs[0].unsqueeze(1)

    @property
    def positions(self) -> torch.Tensor:
        """``[slots, 1]``: each slot's position of the next step (a view of :attr:`inputs`)."""
        return self.inputs[1].unsqueeze(1)

    def feed(self, ids: Sequence[int], positions: Sequence[int]) -> None:
        """The next step's tokens and positions, one per slot, in one copy that does not wait for the device."""
        write_into(self.inputs, [list(ids), list(positions)])

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
        self.key_positions.zero_()
        self.inputs.zero_()
        self.live.zero_()
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
        ``[L]`` mask, at columns ``[lo, lo + L)`` (with their positions: the row's tokens before each); every other
        column of the slot masked."""
        width = mask_row.shape[0]
        for layer, (k, v) in zip(self.layers, kv):
            layer.keys[slot, :, lo : lo + width] = k
            layer.values[slot, :, lo : lo + width] = v
        self.allowed[slot] = False
        self.allowed[slot, lo : lo + width] = mask_row.bool()
        if self.windowed:
            self.key_positions[slot, lo : lo + width] = row_positions(mask_row[None])[0]
        self.live[slot] = True

    def open_column(self, w: int) -> None:
        """Before a step that writes column ``w``: every slot sees it (a free slot only it), at the position its
        token is fed at (on the device: nothing is read back)."""
        self.allowed[:, w] = True
        if self.windowed:
            self.key_positions[:, w] = self.inputs[1]

    def move(self, lo: int, hi: int, offset: int) -> None:
        """Columns ``[lo, hi)`` of every slot move by ``offset`` (in place); the columns they leave are masked."""
        if offset == 0 or hi <= lo:
            return
        for layer in self.layers:
            for t in (layer.keys, layer.values):
                t[:, :, lo + offset : hi + offset] = t[:, :, lo:hi].clone()
        self.allowed[:, lo + offset : hi + offset] = self.allowed[:, lo:hi].clone()
        self.key_positions[:, lo + offset : hi + offset] = self.key_positions[:, lo:hi].clone()
        if offset < 0:
            self.allowed[:, max(lo, hi + offset) : hi] = False
        else:
            self.allowed[:, lo : min(hi, lo + offset)] = False


class StaticKVBatch:
    """:class:`~.kv_batch.KVBatch` of ``slots`` slots and ``capacity`` columns, decoded by ``step`` (a
    :class:`~.step.StaticStep`: its ``buffers_for`` gives the bucket's buffers at the first join, ``run(buffers)``
    computes a step; its ``state`` counts shifts and padded positions)."""

    def __init__(
        self,
        step,
        slots: int,
        capacity: int,
        device: torch.device,
        stats: LaneStats,
        around: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> None:
        self.step_fn, self.device, self.stats, self.around = step, device, stats, around
        self.slots, self.capacity = slots, capacity
        self.pad = step.pad
        self._buffers: StaticBuffers | None = None
        self._by_slot: list[GenRow | None] = [None] * slots
        self._position = [0] * slots  # each slot's next position: the tokens its row holds
        self._start = [0] * slots  # each slot's first column
        self._w = 0  # the column the next step writes
        stats.peak_cache_positions = slots * capacity

    @property
    def buffers(self) -> StaticBuffers:
        if self._buffers is None:
            raise RuntimeError("internal error: the static batch's buffers used before any row joined")
        return self._buffers

    @property
    def rows(self) -> list[GenRow]:
        return [r for r in self._by_slot if r is not None]

    def _live(self) -> list[int]:
        return [s for s, r in enumerate(self._by_slot) if r is not None]

    def free(self) -> int:
        return self._by_slot.count(None)

    def join(self, prefilled: Prefilled) -> None:
        cache, mask = prefilled.cache, prefilled.mask
        if self._buffers is None:  # the first rows: the bucket's buffers, emptied (shapes from this prefill)
            self._buffers = self.step_fn.buffers_for(self.slots, self.capacity, cache)
            self._buffers.reset()
        buffers = self._buffers
        width = int(mask.shape[1])
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
        for s, i, length in zip(free, prefilled.keep, prefilled.lengths):
            buffers.write(s, [(layer.keys[i], layer.values[i]) for layer in cache.layers], mask[i], self._w - width)
            self._by_slot[s], self._position[s], self._start[s] = prefilled.group[i], length, self._w - width

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
        buffers.feed(
            [r.tokens[-1] if r is not None else self.pad for r in self._by_slot],
            [self._position[s] if r is not None else 0 for s, r in enumerate(self._by_slot)],
        )
        buffers.open_column(w)  # every slot sees the column it writes; a free slot only that one
        with self.around():
            logits = self.step_fn.run(buffers)
        buffers.allowed[:, w] = buffers.live
        self._w = w + 1
        buffers.length = self._w
        for s in running:
            self._position[s] += 1
        self.stats.decode_forwards += 1
        self.stats.decode_positions += len(running)
        self.stats.padded_positions += slots - len(running)
        self.step_fn.state.padded_positions += slots - len(running)
        if len(running) == slots:
            return logits
        return logits.index_select(0, to_device(running, torch.long, device))

    def drop(self, keep: Sequence[int]) -> None:
        kept = set(keep)
        for i, s in enumerate(self._live()):
            if i not in kept:
                self._by_slot[s] = None
                self.buffers.allowed[s] = False
                self.buffers.live[s] = False
