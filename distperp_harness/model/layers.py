"""Which modules are a model's decoder layers: one rule for sharding (FSDP units), the fit check (one layer's
unsharded bytes) and compiling (the layer compiled once)."""

from __future__ import annotations

from typing import Any

import torch


def _length(stack: torch.nn.ModuleList) -> int:
    return len(stack)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of decoder layers: a ``ModuleList`` of modules of one type under the base model, the first
    (in module order) whose length is the (text) config's ``num_hidden_layers`` (``model.layers`` of Llama-like
    models, ``transformer.h`` of GPT-2, ``language_model.layers`` of a vision-language model); without that count,
    the longest such list; [] when there is none."""
    base = getattr(model, "base_model", model)
    config: Any = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(config, "num_hidden_layers", None)
    stacks: list[torch.nn.ModuleList] = [
        m
        for m in base.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(layer) for layer in m}) == 1
    ]
    exact = [m for m in stacks if depth is not None and len(m) == depth]
    if exact:
        return list(exact[0])
    if not stacks or depth is not None:
        return []
    longest = stacks[0]
    for stack in stacks[1:]:  # the first of the longest, as max() would
        if _length(stack) > _length(longest):
            longest = stack
    return list(longest)
