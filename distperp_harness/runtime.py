"""Run-time facts about the model and machine: batching rule, attention cost coefficient, peak memory."""

from __future__ import annotations

import resource
import sys

import torch

from distperp_harness.options import Options
from distperp_harness.pipeline import Batching

# Upper bound on the fraction of free memory that activations of one batch may take (batch_size=auto).
_MEMORY_FRACTION = 0.25


def attention_coefficient(model: torch.nn.Module) -> float:
    """``n_layers * hidden / n_params``: weight of the quadratic attention term in a batch's cost."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    params = sum(p.numel() for p in model.parameters()) or 1
    return float(layers * hidden) / float(params)


def activation_bytes_per_token(model: torch.nn.Module, max_length: int) -> int:
    """Conservative bytes of live activations per input token during one forward pass (no KV cache)."""
    config = model.config
    hidden = getattr(config, "hidden_size", 1024)
    inter = getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden
    heads = getattr(config, "num_attention_heads", 16)
    width = 4  # float32 upper bound, whatever the model dtype
    per_layer = width * (6 * hidden + 3 * inter) + width * heads * max_length  # MLP + attention scores (eager)
    return int(per_layer * 2)  # residual stream, norms and allocator slack


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        return 8 << 30


def batching_for(options: Options, model: torch.nn.Module, device: torch.device, max_length: int) -> Batching:
    """Fixed rows per batch, or for ``batch_size=auto`` a token budget that fits in memory.

    The auto budget is a power of two between ``max_length`` and ``max_batch_size * max_length`` tokens.
    """
    if not options.auto_batch:
        return Batching(batch_size=int(options.batch_size), max_batch_size=options.max_batch_size)
    per_token = activation_bytes_per_token(model, max_length)
    budget = int(_MEMORY_FRACTION * free_memory_bytes(device)) // max(1, per_token)
    budget = max(max_length, min(budget, options.max_batch_size * max_length))
    budget = 1 << (budget.bit_length() - 1)
    return Batching(batch_size=None, token_budget=max(budget, max_length), max_batch_size=options.max_batch_size)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
