"""Run-time facts about the model and machine: the batching rule (``batch_size=auto``), plan cost coefficients,
peak memory.

``batch_size=auto`` (and ``auto:N``) becomes a *token budget*: each batch holds at most ``budget // padded_length``
rows (and at most ``max_batch_size``), so short units share a batch and long ones do not overflow it. The budget
is a power of two between ``max_length`` (one full-length row always fits) and ``max_batch_size * max_length``,
and depends only on the machine and the model — never on the requests or the world size:

* **CPU**: a memory budget. A quarter of the available memory (the smaller of the system's and the cgroup's) over a
  conservative estimate of the bytes one input token holds during a forward pass and scoring
  (:func:`activation_bytes_per_token`), after setting aside the fixed logits chunk of the scorer.
* **CUDA**: probing. Starting from the largest allowed budget, a real forward pass and scoring of
  ``budget // max_length`` full-length rows (every position scored, the reference model too when there is one)
  runs; on out-of-memory, or when the probe's peak exceeds ``_PROBE_FRACTION`` of the memory that was free, the
  budget halves. The first budget that passes is used: it has been run, at the worst padded length, with room to
  spare (a batch of shorter rows holds no more tokens, and attention memory grows with length).

Powers of two make the budget stable: machines of one kind, with slightly different free memory, pick the same
budget, hence the same batches and the same bits. lm.py takes rank 0's choice for every rank.

lm-eval's ``auto:N`` re-detects a row count N times while the sorted requests get shorter. A token budget already
gives shorter units more rows, so distperp detects once and treats ``auto:N`` as ``auto`` (logged).
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import Callable

import torch

from distperp_harness.options import Options
from distperp_harness.pipeline import Batching

log = logging.getLogger(__name__)

# Upper bound on the fraction of available memory that activations of one batch may take on CPU.
_MEMORY_FRACTION = 0.25
# On CUDA a probe passes only if its peak allocation stays below this fraction of the memory free before it.
_PROBE_FRACTION = 0.8

FreeMemory = Callable[[torch.device], int]
Probe = Callable[[int], int]
"""Runs a forward pass and scoring of ``token_budget`` tokens at full length; returns the peak bytes it allocated."""


def _matmul_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
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
    head_params = int(head.weight.numel()) if isinstance(getattr(head, "weight", None), torch.Tensor) else 0
    body = params - sum(embeddings.values())
    return max(body, 1), head_params, layers, hidden


def attention_coefficient(model: torch.nn.Module) -> float:
    """``n_layers * hidden / body_params``: weight of the quadratic attention term in a batch's cost.

    With it, ``padded_tokens * (1 + coef * padded_length)`` is proportional to the multiply-adds of the layers:
    ``body_params`` per position plus ``n_layers * hidden * length`` for the scores and the weighted sum.
    """
    body, _, layers, hidden = _matmul_params(model)
    return float(layers * hidden) / float(body)


def head_coefficient(model: torch.nn.Module) -> float:
    """``head_params / body_params``: the cost of one *scored* token (output head and log-softmax, which distperp
    computes only at scored positions) relative to one input position through the layers. For
    :func:`distperp_harness.plan.batch_cost`'s ``head_coef``."""
    body, head, _, _ = _matmul_params(model)
    return float(head) / float(body)


def activation_bytes_per_token(model: torch.nn.Module, max_length: int) -> int:
    """Conservative bytes of live activations per input token during one forward pass and scoring (no KV cache).

    One layer's transients at a time (residual stream, q/k/v and attention output, the MLP's three intermediates,
    and eager attention scores over ``max_length`` keys), in float32 whatever the model dtype, doubled for the
    residual stream, norms and allocator slack; plus scoring's per-position vectors (features, indices, float64
    log-probs).
    """
    config = model.config
    hidden = int(getattr(config, "hidden_size", 1024) or 1024)
    inter = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 16) or 16)
    width = 4
    per_layer = width * (6 * hidden + 3 * inter) + width * heads * max_length
    scoring = width * 2 * hidden + 8 * 4
    return int(per_layer * 2 + scoring)


def _cgroup_free_bytes() -> int | None:
    """Memory left under this process's cgroup (v2 ``memory.max - memory.current``, or v1), None when unlimited."""
    candidates = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")]
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on ``device``: CUDA's free memory, or on CPU the smaller of the
    system's available memory and what the cgroup limit leaves."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        available = 8 << 30
    cgroup = _cgroup_free_bytes()
    return available if cgroup is None else min(available, cgroup)


def _log_main(message: str, *args: object) -> None:
    """INFO on the main process only (every process when no Accelerate state exists yet, as in unit tests)."""
    from accelerate.state import PartialState

    if not PartialState._shared_state or PartialState().is_main_process:
        log.info(message, *args)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def budget_bounds(max_length: int, max_batch_size: int) -> tuple[int, int]:
    """``(smallest, largest)`` token budget: one full-length row, and ``max_batch_size`` of them."""
    return max_length, max(max_length, max_batch_size * max_length)


def clamp_budget(tokens: int, max_length: int, max_batch_size: int) -> int:
    """``tokens`` rounded down to a power of two, then kept within :func:`budget_bounds`.

    The result is never below ``max_length`` (one full row must fit) and never above ``max_batch_size * max_length``;
    when the upper bound is not a power of two, the largest power of two below it is used.
    """
    low, high = budget_bounds(max_length, max_batch_size)
    tokens = min(tokens, high)
    return max(low, _floor_pow2(tokens))


def memory_budget(model: torch.nn.Module, max_length: int, max_batch_size: int, free_bytes: int) -> int:
    """The CPU token budget: ``_MEMORY_FRACTION`` of ``free_bytes``, less the scorer's fixed logits chunk, over
    :func:`activation_bytes_per_token`, then :func:`clamp_budget`."""
    from distperp_harness.scoring import _CHUNK_ELEMENTS

    usable = int(_MEMORY_FRACTION * free_bytes) - 2 * 4 * _CHUNK_ELEMENTS
    tokens = usable // max(1, activation_bytes_per_token(model, max_length))
    return clamp_budget(tokens, max_length, max_batch_size)


def probe_budget(probe: Probe, start: int, max_length: int, free_bytes: int) -> int:
    """The largest budget from ``start`` down (halving, powers of two, at least ``max_length``) whose probe runs
    without running out of memory and peaks below ``_PROBE_FRACTION * free_bytes``.

    Raises:
        RuntimeError: when even one full-length row does not fit, naming what to lower.
    """
    budget = start
    while True:
        try:
            peak = probe(budget)
            if peak <= _PROBE_FRACTION * free_bytes:
                return budget
            reason = f"peak {peak / 2**30:.2f} GiB > {_PROBE_FRACTION:.0%} of {free_bytes / 2**30:.2f} GiB free"
        except torch.OutOfMemoryError:
            reason = "out of memory"
        _release_cuda_cache()
        log.debug("batch_size=auto: %d tokens: %s", budget, reason)
        if budget <= max_length:
            raise RuntimeError(f"batch_size=auto: even one row of max_length={max_length} tokens does not fit "
                               f"({reason}). Fix: lower max_length, use a smaller dtype or quantize=int4.")
        budget = max(max_length, budget // 2)


def _release_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def scoring_probe(model: torch.nn.Module, device: torch.device, max_length: int, *,
                  reference: torch.nn.Module | None = None, pad_token_id: int = 0) -> Probe:
    """A :data:`Probe` that scores ``budget // max_length`` rows of ``max_length + 1`` tokens, every position
    scored (the worst case), with the real :func:`~distperp_harness.scoring.score_batch`."""
    from distperp_harness.requests import Unit
    from distperp_harness.scoring import score_batch

    vocab = int(getattr(model.config, "vocab_size", 2) or 2)

    def probe(budget: int) -> int:
        rows = max(1, budget // max_length)
        tokens = torch.randint(0, vocab, (rows, max_length + 1), generator=torch.Generator().manual_seed(0))
        units = [Unit(tuple(row), max_length) for row in tokens.tolist()]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        score_batch(model, units, device=device, pad_token_id=pad_token_id, reference=reference)
        if device.type != "cuda":
            return 0
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)

    return probe


def batching_for(options: Options, model: torch.nn.Module, device: torch.device, max_length: int, *,
                 reference: torch.nn.Module | None = None, pad_token_id: int = 0,
                 free_memory: FreeMemory = free_memory_bytes, probe: Probe | None = None) -> Batching:
    """Fixed rows per batch, or for ``batch_size=auto`` / ``auto:N`` a token budget that fits (see module doc).

    Args:
        free_memory: bytes free on a device (tests pass a fake).
        probe: overrides the CUDA probe (tests); on CPU it is not used.

    Returns:
        ``Batching(batch_size=N)`` for an integer batch size, else ``Batching(batch_size=None, token_budget=T)``
        with ``max_length <= T <= max_batch_size * max_length``, ``T`` a power of two (or ``max_length``).
    """
    if not options.auto_batch:
        return Batching(batch_size=int(options.batch_size), max_batch_size=options.max_batch_size)
    if options.auto_batch_schedule > 1:
        _log_main("batch_size=%s: distperp detects one token budget at start (a batch of shorter units gets more "
                  "rows), so it re-detects nothing; treated as batch_size=auto", options.batch_size)
    free = free_memory(device)
    if device.type == "cuda":
        run = probe or scoring_probe(model, device, max_length, reference=reference, pad_token_id=pad_token_id)
        largest = clamp_budget(budget_bounds(max_length, options.max_batch_size)[1], max_length,
                               options.max_batch_size)
        budget = probe_budget(run, largest, max_length, free)
        how = f"probed: a full-length batch peaked below {_PROBE_FRACTION:.0%} of {free / 2**30:.1f} GiB free"
    else:
        budget = memory_budget(model, max_length, options.max_batch_size, free)
        how = f"memory budget: {_MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB available"
    _log_main("batch_size=auto: token budget %d (%d rows of max_length=%d; %s)", budget, budget // max_length,
              max_length, how)
    return Batching(batch_size=None, token_budget=budget, max_batch_size=options.max_batch_size)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)

