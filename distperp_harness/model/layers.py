"""Which modules are a model's decoder layers: one rule for sharding (FSDP units), the fit check (one layer's
unsharded bytes) and compiling (the layer compiled once); and which parameters every position multiplies through
(:func:`matmul_params`: the cost model of planning and of the probe)."""

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


def matmul_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(body params, head params, layers, hidden)``: parameters every input position multiplies through (all but
    the input and output embeddings), those of the output head alone, and the config's depth and width."""
    config = getattr(model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    params = sum(p.numel() for p in model.parameters())
    embeddings: dict[int, int] = {}  # by object identity: tied input/output weights are one parameter
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):  # quantized (tensor subclass) weights too; numel is the logical size
            embeddings[id(weight)] = weight.numel()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_weight = getattr(head, "weight", None)
    head_params = int(head_weight.numel()) if isinstance(head_weight, torch.Tensor) else 0
    body = params - sum(embeddings.values())
    return max(body, 1), head_params, layers, hidden
