"""A prefix computed once and continued by several rows: its key/value cache, repeated to the rows.

Scoring (a batch's rows sharing their first tokens) and generation (prompts sharing a few-shot block) both use it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from distperp_harness.model.attention import AttentionLayout, declared_layout

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CacheNotShareable(ValueError):
    """The model's cache cannot be repeated to several rows or restarted from (e.g. recurrent layers)."""


def cache_argument(model: torch.nn.Module) -> str:
    """The argument a model's ``forward`` (and ``generate``) takes a key/value cache under: ``cache``
    (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def body_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM: what returns ``last_hidden_state`` before the output head
    (``base_model``, or the ``model`` attribute where a class names its base model by a prefix it does not hold)."""
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def whole_cache():
    """An empty ``DynamicCache`` whose layers are all plain ``DynamicLayer``s, created as the forward reaches them:
    every layer keeps every key and value, sliding-window and chunked layers included (the tree mask applies their
    windows by position, :mod:`~distperp_harness.run.scoring.engine.masks`). A layer that needs another kind of
    cache (recurrent state) fails on it, and the probe then refuses cached prefixes."""
    from transformers import DynamicCache

    return DynamicCache()


def prefix_cache(model: PreTrainedModel, prefix_ids: torch.Tensor, rows: int):
    """The key/value cache of ``prefix_ids`` (``[1, p]``, positions ``0 .. p-1``) repeated to ``rows`` rows, every
    layer kept whole (:func:`whole_cache`). Only for models whose every layer attends by a mask
    (:func:`~distperp_harness.model.attention.declared_layout`).

    Runs the base model only (no output head: the prefix's logits are never read).

    Raises:
        CacheNotShareable: naming the cache type, when it cannot be repeated or restarted from.
    """
    layout = declared_layout(getattr(model, "config", None))
    if not isinstance(layout, AttentionLayout):
        raise CacheNotShareable(f"cache ({layout.removeprefix('its ')})")  # recurrent state: rows cannot share it
    body = body_of(model)
    out = body(input_ids=prefix_ids, use_cache=True, **{cache_argument(body): whole_cache()})
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave") or any(getattr(cache, "is_linear", None) or ()):
        raise CacheNotShareable(type(cache).__name__)
    if layers is not None and any(getattr(layer, "keys", None) is None for layer in layers):
        raise CacheNotShareable("a layer that wrote no keys")
    cache.batch_repeat_interleave(rows)
    return cache
