"""Attention of each row over its own keys: a row's bits independent of its batch-mates (issue 64's building block).

A right-padded batch run through transformers' sdpa attention gives a row other bits than the row alone: the
kernel's reduction over keys is split by the padded length (CPU flash attention sums keys in blocks and a vector
tail). Under :data:`ATTENTION`, registered in transformers' attention interface, each row of a batch attends in its
own call to exactly its own keys (its query and key lengths set by :func:`row_lengths` for the forward), so its
attention output is the bits it gets alone; the padding positions' outputs are zeros. With the matrix products'
row invariance (at least 16 rows: the engine pads every forward to 16 positions), a row's hidden states are then
the same bits whatever the batch. Outside :func:`row_lengths` the function is transformers' sdpa attention.

Used under ``batch_invariant=true`` (:func:`attending_alone` around each forward, the rows' lengths set per
forward): scoring's batches (left-aligned rows) and generation's prefills and decode steps (right-aligned rows,
``right=True``); :mod:`distperp_harness.run.scoring.engine.invariance` checks once per run that the local kernels
make a row's bits independent of its batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import torch

ATTENTION = "distperp_rows"
"""The name the row-wise attention function is registered under in transformers' attention interface."""

_LENGTHS: contextvars.ContextVar[tuple[tuple[tuple[int, int], ...], bool] | None] = contextvars.ContextVar(
    "distperp_row_lengths", default=None
)


@contextlib.contextmanager
def row_lengths(lengths: Sequence[int] | Sequence[tuple[int, int]], right: bool = False) -> Iterator[None]:
    """Within the block, each row ``b`` of a forward attends with its first ``queries[b]`` positions over its first
    ``keys[b]`` keys: ``lengths`` holds one length per row (queries = keys: a forward without a cache) or
    ``(queries, keys)`` pairs (keys include a cache's). ``right``: rows are right-aligned (generation's cache:
    ``[pads][row]``), so a row's queries and keys are the *last* ones of its columns."""
    pairs = tuple((n, n) if isinstance(n, int) else (int(n[0]), int(n[1])) for n in lengths)
    if any(q < 1 or k < q for q, k in pairs):
        raise ValueError(f"row lengths must have 1 <= queries <= keys, got {pairs}")
    token = _LENGTHS.set((pairs, right))
    try:
        yield
    finally:
        _LENGTHS.reset(token)


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``query`` ``[rows, heads, positions, dim]``): each row alone over its own
    keys (module doc); ``[rows, positions, heads, dim]`` out, as sdpa's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    given = _LENGTHS.get()
    if given is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths, right = given
    if len(lengths) != query.shape[0]:
        raise ValueError(f"row_lengths holds {len(lengths)} rows, the forward has {query.shape[0]}")
    kwargs.pop("is_causal", None)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    n_queries, n_keys = query.shape[2], key.shape[2]
    for b, (queries, keys) in enumerate(lengths):
        # left-aligned: a row's keys are the first ``keys`` (a cache's, then its own), its queries the last of them;
        # right-aligned: the last ``keys`` columns and the last ``queries`` positions
        qs = slice(n_queries - queries, n_queries) if right else slice(0, queries)
        ks = slice(n_keys - keys, n_keys) if right else slice(0, keys)
        mask = None if attention_mask is None else attention_mask[b : b + 1, :, qs, ks]
        if mask is not None and _causal(mask[0], keys):
            mask = None
        if mask is None and 1 < queries < keys:  # sdpa's is_causal aligns a non-square mask top-left
            mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)[None, None]
        rows, _ = sdpa_attention_forward(
            module,
            query[b : b + 1, :, qs],
            key[b : b + 1, :, ks],
            value[b : b + 1, :, ks],
            mask,
            is_causal=mask is None and queries > 1,
            **kwargs,
        )
        out[b, qs] = rows[0]
    return out, None


def _causal(mask: torch.Tensor, keys: int) -> bool:
    """Whether ``mask`` (``[heads or 1, queries, keys]``, boolean or additive) is the plain causal mask of the last
    ``queries`` of ``keys`` positions: then the row takes sdpa's causal path, as it does alone."""
    queries = mask.shape[-2]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril(keys - queries)
    return bool((allowed == causal).all())


def register() -> None:
    """Register :data:`ATTENTION` (and sdpa's mask builder under the same name) in transformers' interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def why_not_alone(model: torch.nn.Module) -> str | None:
    """Why ``model``'s rows cannot attend alone under :data:`ATTENTION` (its attention is not transformers' sdpa),
    or None."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in ("sdpa", ATTENTION):
        return f"its attention implementation is {impl!r}, and rows attend alone through sdpa only"
    return None


def _configs(config: Any) -> Iterator[Any]:
    """``config`` and every sub-configuration under it."""
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


@contextlib.contextmanager
def attending_alone(
    model: torch.nn.Module, lengths: Sequence[int] | Sequence[tuple[int, int]], right: bool = False
) -> Iterator[None]:
    """Within the block, ``model``'s sdpa layers attend under :data:`ATTENTION` with each row's ``lengths``
    (:func:`row_lengths`, ``right`` as there); its configurations' attention implementations are back on leaving."""
    register()
    configs = [c for c in _configs(getattr(model, "config")) if c._attn_implementation == "sdpa"]  # noqa: B009 - torch types module attributes as tensors
    for config in configs:
        config._attn_implementation_internal = ATTENTION
    try:
        with row_lengths(lengths, right):
            yield
    finally:
        for config in configs:
            config._attn_implementation_internal = "sdpa"
