"""Which models slots decode (:func:`slots_refused`) and the attention masks of their forwards (:func:`row_masks`,
:func:`layer_masks`).

**Caches kept whole.** Every forward of slots (the shared prefix, a prefill, a decode step, the fixed-shape step)
writes into a cache whose layers are all plain (``DynamicLayer``, ``StaticLayer``): a sliding-window or chunked
layer keeps every key and value, like a full-attention one. The cache therefore never decides what a layer sees:
the mask does, so a row's keys and values can be joined, dropped and trimmed like any other's. Memory grows like a
full-attention model's (every layer, every token of a row), which is what the KV estimate
(:func:`~distperp_harness.model.memory.kv_cache_bytes_per_token`) counts.

**Masks by position.** The model gets one 4D mask per rule of its layout
(:class:`~distperp_harness.model.attention.AttentionLayout`, as decided for it:
:func:`~distperp_harness.run.scoring.engine.support.paths_of`): a query sees a key of its own row, at or before its
column, and where its layer type has a window or chunk, within it by **positions**
(:meth:`~distperp_harness.model.attention.LayerAttention.allows`): a column's position is how many of its row's
tokens come before it (the running count of the row's mask), so pads between a shared prefix and a row's own
tokens, and columns left by other rows, never count. The masks are in the form the attention implementation takes
(:func:`~distperp_harness.run.scoring.engine.masks.attention_form`), a mapping from layer type to mask where the
layout is keyed. Built on the device from what is already there (masks, positions): nothing is read back.

A model without a dense-mask layout (flash attention, say) gets transformers' 2D mask instead, and slots only where
every layer attends fully.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distperp_harness.model.attention import AttentionLayout
from distperp_harness.run.scoring.engine.masks import attention_form
from distperp_harness.run.scoring.engine.support import DENSE_IMPLEMENTATIONS, paths_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Mask = Any
"""What a forward's ``attention_mask`` is: a 4D tensor, or a mapping from layer type to one (keyed layouts)."""


def implementation(model: torch.nn.Module) -> str | None:
    """``model``'s attention implementation (``sdpa``, ``eager``, ...)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def mask_layout(model: torch.nn.Module) -> AttentionLayout | None:
    """The layout generation's 4D masks follow for ``model``: its decided layout where its attention takes a dense
    mask (sdpa, eager) and it takes distperp's masks (``paths.dense_masks``); None: forwards pass the 2D mask."""
    paths = paths_of(model)
    return paths.layout if implementation(model) in DENSE_IMPLEMENTATIONS and paths.dense_masks else None


def _cache_layer_kinds(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """``(window layer types, other layer types)`` of the ``DynamicCache`` transformers makes for ``model``, beyond
    plain ``DynamicLayer`` (class names)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    try:
        layers = DynamicCache(config=getattr(model, "config", None)).layers
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # a configuration transformers cannot read
        return set(), {f"DynamicCache ({type(exc).__name__}: {exc})"}
    if not layers:
        return set(), {"DynamicCache with no layers"}
    windowed = {type(layer).__name__ for layer in layers if type(layer) is DynamicSlidingWindowLayer}
    other = {type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)}
    return windowed, other


def has_windows(model: torch.nn.Module) -> bool:
    """Whether transformers gives any of ``model``'s layers a sliding-window (or chunked) cache: layers that
    ``model.generate`` masks by column index, not by position."""
    return bool(_cache_layer_kinds(model)[0])


def slots_refused(model: PreTrainedModel) -> str | None:
    """Why slots cannot decode ``model`` (None: they can), judged from transformers' cache layers for it and its
    decided paths (:func:`~distperp_harness.run.scoring.engine.support.paths_of`):

    * full-attention layers only (plain ``DynamicLayer``): slots, with 4D masks where :func:`mask_layout` gives one;
    * sliding-window or chunked layers: slots keep their keys whole and apply the windows in the mask, so the model
      must take distperp's 4D masks (sdpa or eager, ``paths.dense_masks``) and continue a whole cache
      (``paths.cached_prefix`` allowed);
    * any other layer (linear attention, state spaces: a recurrent state, not keys): never.
    """
    windowed, other = _cache_layer_kinds(model)
    if other:
        return f"its {'/'.join(sorted(other | windowed))} cache cannot be edited row by row"
    if not windowed:
        return None
    paths = paths_of(model)
    need = "slots keep its sliding-window/chunked layers' keys whole and apply the windows in their own 4D masks"
    impl = implementation(model)
    if impl not in DENSE_IMPLEMENTATIONS:
        return f"{need}, which attention implementation {impl!r} does not take (sdpa or eager does)"
    if not paths.dense_masks:
        return f"{need}, which the model does not take ({paths.packed_rows or 'no attention layout'})"
    if paths.cached_prefix is not None:
        return f"{need}, and its rows cannot continue a whole cache ({paths.cached_prefix})"
    return None


def row_positions(row_mask: torch.Tensor) -> torch.Tensor:
    """``[rows, columns]``: each column's position in its row, the row's tokens before it (``row_mask``: 1 on the
    row's tokens; a column outside the row gets the next token's, or -1 before the first)."""
    return row_mask.cumsum(1) - 1


def layer_masks(
    model: PreTrainedModel,
    layout: AttentionLayout,
    allowed: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
) -> Mask:
    """The masks of ``layout`` for ``model``: ``allowed`` (``bool [rows, 1, queries, keys]``: causality and the
    rows' own columns) under each rule, the rule evaluated on ``positions = (query positions [rows, queries], key
    positions [rows, keys])``; one mask, or a mapping from layer type to mask where ``layout.keyed``. ``positions``
    may be None only when no rule has a window or chunk (``layout.span == 0``)."""
    forms: dict = {}
    for rule in layout.rules:
        extra = None
        if rule.span:
            if positions is None:
                raise ValueError(f"internal error: the {rule.describe()} rule needs the tokens' positions")
            query_pos, key_pos = positions
            extra = rule.allows(query_pos[:, None, :, None], key_pos[:, None, None, :])
        forms[rule] = attention_form(model, allowed if extra is None else allowed & extra)
    if layout.keyed:
        return {name: forms[rule] for name, rule in layout.kinds}
    return forms[layout.rules[0]]


def row_masks(model: PreTrainedModel, layout: AttentionLayout, row_mask: torch.Tensor, queries: int) -> Mask:
    """The masks of the last ``queries`` columns of rows whose tokens ``row_mask`` (``[rows, columns]``, 1 on a
    row's tokens) marks: each query sees its row's tokens at or before its column, within each rule by position."""
    columns = int(row_mask.shape[1])
    keys = torch.arange(columns, device=row_mask.device)
    causal = keys[None, :] <= (columns - queries + torch.arange(queries, device=row_mask.device))[:, None]
    allowed = (row_mask.bool()[:, None, :] & causal[None])[:, None]
    if not layout.span:
        return layer_masks(model, layout, allowed, None)
    pos = row_positions(row_mask)
    return layer_masks(model, layout, allowed, (pos[:, columns - queries :], pos))
