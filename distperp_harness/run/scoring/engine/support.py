"""What a model must support for rows that share a prefix: a tree attention mask with position ids (packed rows)
and continuing a batch's common prefix from its key/value cache. Each check returns why not, or None."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSupport:
    """What scoring relies on in a model type's transformers implementation.

    ``plain_head``: its logits are exactly ``get_output_embeddings()(base_model(...).last_hidden_state)``, so only
    scored positions go through the head (others: soft-capping, logit scaling, ... use full logits).
    ``takes_4d_mask``: it passes a 4D attention mask through unchanged and takes position ids (each checked against
    unshared rows, with sdpa and eager, in tests/run/scoring/engine/test_forward.py)."""

    plain_head: bool
    takes_4d_mask: bool


_BOTH = ModelSupport(plain_head=True, takes_4d_mask=True)
MODEL_TYPES: dict[str, ModelSupport] = {
    **dict.fromkeys(
        ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "olmo"), _BOTH
    ),
    **dict.fromkeys(("olmo2", "gpt2", "gpt_neox", "gptj", "stablelm", "starcoder2", "smollm3"), _BOTH),
    "ministral": ModelSupport(plain_head=True, takes_4d_mask=False),
}
"""The one table of model types scoring knows (``config.model_type``); any other type: neither."""

_NEITHER = ModelSupport(plain_head=False, takes_4d_mask=False)


def model_support(model: torch.nn.Module) -> ModelSupport:
    """:data:`MODEL_TYPES`' entry of ``model``'s ``config.model_type``."""
    return MODEL_TYPES.get(getattr(getattr(model, "config", None), "model_type", None) or "", _NEITHER)


def takes_4d_mask(model: torch.nn.Module) -> bool:
    """Whether ``model``'s type is one whose transformers implementation passes a 4D attention mask through."""
    return model_support(model).takes_4d_mask


def cached_prefix_unsupported(model: torch.nn.Module) -> str | None:
    """Why a batch of tree rows on ``model`` computes its rows' common prefix in every row instead of once from a
    key/value cache (None: from the cache). flex_attention: its block mask over queries that continue a cached
    prefix gave non-finite logits (transformers 5.24, torch 2.13, CPU), so those rows carry the prefix themselves
    (same results, more tokens computed)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "flex_attention":
        return "flex_attention: each tree row computes the batch's common prefix itself (not from a cached prefix)"
    return None


def packed_rows_unsupported(model: torch.nn.Module, max_length: int) -> str | None:
    """Why ``model`` cannot compute packed rows (prefix-sharing mask and position ids), or None when it can.

    Needs a model type whose :data:`MODEL_TYPES` entry takes a 4D mask, ``sdpa`` or ``eager`` attention (a dense
    mask), or ``flex_attention`` where transformers implements it for the model (``_supports_flex_attn``; a block mask,
    :mod:`distperp_harness.run.scoring.engine.masks`) and not on CUDA (tree rows there disagreed with sdpa's,
    unresolved) — flash attention takes no custom mask —, no attention-logit soft capping, and
    no sliding window shorter than ``max_length`` (a custom mask replaces the window; rows are at most
    ``max_length`` tokens, so a longer window never applies).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not takes_4d_mask(model):
        return f"model type {model_type!r} is not known to take a prefix-sharing attention mask"
    impl = getattr(config, "_attn_implementation", None)
    if impl == "flex_attention" and getattr(getattr(model, "device", None), "type", None) == "cuda":
        return (
            "flex_attention on CUDA: its tree rows chose other answers than sdpa's there (log-likelihoods up to "
            "0.084 apart, one H200), so each answer gets a row of its own; attn_implementation=sdpa shares prefixes"
        )
    if impl == "flex_attention" and not getattr(model, "_supports_flex_attn", False):
        return (
            f"transformers has no flex_attention for {type(model).__name__} (attn_implementation=sdpa takes the mask)"
        )
    if impl not in ("sdpa", "eager", "flex_attention"):
        return (
            f"attention implementation {impl!r} does not take a custom attention mask (sdpa and eager take a "
            f"dense one, flex_attention a block mask)"
        )
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logits are soft-capped"
    window = getattr(config, "sliding_window", None)
    if window and window < max_length:  # None or 0: no window (configs that do not use theirs clear it)
        return f"sliding-window attention (window {window} < max_length {max_length})"
    return None
