"""A prefix computed once and continued by several rows: its key/value cache, repeated to the rows.

Scoring (a batch's rows sharing their first tokens) and generation (prompts sharing a few-shot block) both use it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CacheNotShareable(ValueError):
    """The model's cache cannot be repeated to several rows or restarted from (e.g. recurrent layers)."""


def cache_argument(model: torch.nn.Module) -> str:
    """The argument a model's ``forward`` (and ``generate``) takes a key/value cache under: ``cache``
    (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefix_cache(model: PreTrainedModel, prefix_ids: torch.Tensor, rows: int):
    """The key/value cache of ``prefix_ids`` (``[1, p]``, positions ``0 .. p-1``) repeated to ``rows`` rows.

    Runs the base model only (no output head: the prefix's logits are never read).

    Raises:
        CacheNotShareable: naming the cache type, when it cannot be repeated or restarted from.
    """
    out = model.base_model(input_ids=prefix_ids, use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave") or any(getattr(cache, "is_linear", None) or ()):
        raise CacheNotShareable(type(cache).__name__)
    cache.batch_repeat_interleave(rows)
    return cache
