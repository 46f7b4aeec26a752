"""The fixed tensors of :mod:`~distperp_harness.run.static_slots`: one bucket's ``StaticCache`` and mask, edited in
place between compiled decode steps, and what the compiled step needs from transformers' attention.

:class:`StaticBuffers` holds ``[slots, kv heads, capacity, head_dim]`` keys and values per layer (transformers'
``StaticLayer``: allocated once, ``mark_static_address``: CUDA graphs read them where they are) and a ``[slots,
capacity]`` boolean mask; ``length`` is the column the next step writes (every layer's ``cumulative_length``).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from distperp_harness.run.kvcache import CacheNotShareable, cache_argument


class StaticBuffers:
    """One bucket's fixed tensors: a ``StaticCache`` of ``slots`` rows and ``capacity`` columns, and the mask."""

    def __init__(self, model: torch.nn.Module, slots: int, capacity: int, shapes: Sequence[tuple],
                 device: torch.device) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.slots, self.capacity = slots, capacity
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        if len(self.cache.layers) != len(shapes) or any(type(layer) is not StaticLayer for layer in self.cache.layers):
            raise CacheNotShareable("/".join(sorted({type(layer).__name__ for layer in self.cache.layers})))
        for layer, (heads, k_dim, v_dim, dtype) in zip(self.cache.layers, shapes):  # allocates, marks static
            layer.lazy_initialization(torch.empty(slots, heads, 1, k_dim, dtype=dtype, device=device),
                                      torch.empty(slots, heads, 1, v_dim, dtype=dtype, device=device))
        self.allowed = torch.zeros(slots, capacity, dtype=torch.bool, device=device)
        torch._dynamo.mark_static_address(self.allowed)
        self.length = 0

    def reset(self) -> None:
        """Empty every slot (zeros, so nothing of an earlier lane is left), write column 0."""
        for layer in self.cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
        self.allowed.zero_()
        self.set_length(0)

    def set_length(self, w: int) -> None:
        """The column the next decode step writes (every layer's ``cumulative_length``)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(w)
        self.length = w

    def write(self, slot: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], mask_row: torch.Tensor,
              lo: int) -> None:
        """Slot ``slot`` := one prefilled row: ``kv`` per layer ``([heads, L, dim], [heads, L, dim])`` and its
        ``[L]`` mask, at columns ``[lo, lo + L)``; every other column of the slot masked."""
        width = mask_row.shape[0]
        for layer, (k, v) in zip(self.cache.layers, kv):
            layer.keys[slot, :, lo:lo + width] = k
            layer.values[slot, :, lo:lo + width] = v
        self.allowed[slot] = False
        self.allowed[slot, lo:lo + width] = mask_row.bool()

    def move(self, lo: int, hi: int, offset: int) -> None:
        """Columns ``[lo, hi)`` of every slot move by ``offset`` (in place); the columns they leave are masked."""
        if offset == 0 or hi <= lo:
            return
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, lo + offset:hi + offset] = t[:, :, lo:hi].clone()
        self.allowed[:, lo + offset:hi + offset] = self.allowed[:, lo:hi].clone()
        if offset < 0:
            self.allowed[:, max(lo, hi + offset):hi] = False
        else:
            self.allowed[:, lo:min(hi, lo + offset)] = False


def _not_compiling() -> bool:
    return False


@contextlib.contextmanager
def _packed_gqa():
    """transformers' sdpa attention of one query token with grouped key/value heads reshapes the query to the
    key/value heads (``pack_gqa``) in eager, but under dynamo repeats every cached key and value to every head
    (``repeat_kv``): a copy of the whole static cache per layer and step, measured 1.15-1.5x slower than eager on
    CPU. Around the compiled step its "compiling?" check answers no, so the graph takes the eager path's reshape
    (the same value at trace time and at every call: the guard on it holds)."""
    from transformers.integrations import sdpa_attention

    before = getattr(sdpa_attention, "is_torchdynamo_compiling", None)
    if before is None:
        yield
        return
    sdpa_attention.is_torchdynamo_compiling = _not_compiling
    try:
        yield
    finally:
        sdpa_attention.is_torchdynamo_compiling = before


def kv_shapes(model: torch.nn.Module, device: torch.device, pad: int) -> list[tuple]:
    """``(kv heads, key dim, value dim, dtype)`` per layer, read from a one-token forward's ``DynamicCache``."""
    from transformers import DynamicCache

    from distperp_harness.run.slots import _plain_layers

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([[pad]], device=device), use_cache=True, logits_to_keep=1,
          **{cache_argument(model): cache})
    return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
            for layer in _plain_layers(cache)]
