"""``batch_size=auto``: the token budget rank 0 chooses and every rank checks, and the rows of a generation batch.

``batch_size=auto`` (and ``auto:N``) becomes a *token budget*: each batch holds at most ``budget // padded_length``
rows (and at most ``max_batch_size``), so short units share a batch and long ones do not overflow it. The budget
is a power of two between ``max_length`` (one full-length row always fits) and ``max_batch_size * max_length``,
and is a function of the model, the device type and the device's *total* memory only — never of momentary free
memory, the requests or the world size — so the plan, and hence the bits, are the same on 1 GPU or 64:

    budget = pow2_floor((fraction * (total - resident weights) - logits chunks) / activation bytes per token)

with ``resident weights`` the model's and the reference's stored bytes, the logits chunks
:func:`~distperp_harness.run.scoring.engine.forward.chunk_bytes`, the activation bytes
:func:`activation_bytes_per_token` (one layer's transients in the compute dtype; eager attention's scores only
with eager attention), and
``fraction`` 1/2 on CUDA (the allocator's fragmentation and the CUDA context take part of the rest) and 1/4 on CPU
(the other processes of the node share the memory). On CPU the budget is also capped at ``_CPU_MAX_TOKENS``:
beyond that a larger batch no longer computes faster (see :data:`_CPU_MAX_TOKENS`).

Rank 0 chooses; every rank then *checks* that it can hold that budget (:func:`check_budget`): on CUDA by running a
full-length worst-case batch (the probe) and comparing its peak with the memory free on that rank, on CPU and with
sharded weights by the estimate against available memory (a sharded probe that ran out of memory on one rank would leave
its group's other ranks waiting in a gather, so no verdict could be gathered). A rank that cannot hold it stops the run
at start, naming itself.

lm-eval's ``auto:N`` re-detects a row count N times while the sorted requests get shorter. A token budget already
gives shorter units more rows, so distperp detects once and treats ``auto:N`` as ``auto`` (logged).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from distperp_harness.errors import InputError
from distperp_harness.model.memory import (
    activation_bytes_per_token,
    first_float_dtype,
    is_out_of_memory,
    room_bytes,
    total_memory_bytes,
)
from distperp_harness.options import Options
from distperp_harness.run.rules import Batching

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from distperp_harness.distributed.protocol import Collective

log = logging.getLogger(__name__)

# Fraction of (total memory - resident weights) that one batch's activations may take.
_MEMORY_FRACTION = {"cuda": 0.5, "cpu": 0.25}
# On CPU, more tokens per batch than this stop paying off: the GEMMs are at full speed already, while larger
# activations cost fresh pages and memory traffic (`python -m benchmarks.bench_scoring --sweep` on wt2-llama-5m,
# max_length 1024: 4,096 tokens per batch fastest; 8,192 at 0.92x, 16,384 at 0.88x; see benchmarks/README.md).
_CPU_MAX_TOKENS = 4096

FreeMemory = Callable[[torch.device], int]
TotalMemory = Callable[[torch.device], int]
Probe = Callable[[int], int]
"""Runs a forward pass and scoring of ``token_budget`` tokens at full length; returns the peak bytes it allocated."""


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


def memory_budget(
    model: torch.nn.Module,
    max_length: int,
    max_batch_size: int,
    total_bytes: int,
    *,
    device_type: str = "cpu",
    resident_bytes: int = 0,
    reference: torch.nn.Module | None = None,
) -> int:
    """The token budget of ``batch_size=auto`` (module doc): a pure function of the model(s), ``device_type`` and
    ``total_bytes``; ``resident_bytes`` are the stored weights of the model and the reference."""
    from distperp_harness.run.scoring.engine.forward import chunk_bytes

    fraction = _MEMORY_FRACTION.get(device_type, _MEMORY_FRACTION["cpu"])
    per_token = max(activation_bytes_per_token(m, max_length) for m in (model, reference) if m is not None)
    logits = chunk_bytes(device_type, first_float_dtype(model), first_float_dtype(reference))
    usable = int(fraction * max(0, total_bytes - resident_bytes)) - logits
    tokens = usable // max(1, per_token)
    if device_type == "cpu":
        tokens = min(tokens, _CPU_MAX_TOKENS)
    return clamp_budget(tokens, max_length, max_batch_size)


def check_budget(
    budget: int,
    max_length: int,
    device: torch.device,
    *,
    free_bytes: int,
    probe: Probe | None = None,
    bytes_per_token: int = 0,
    fixed_bytes: int = 0,
) -> str | None:
    """``None`` when this rank can hold ``budget`` tokens per batch, else the reason it cannot.

    CUDA: ``probe(budget)`` (a full-length worst-case batch) must run without running out of memory and peak
    below ``free_bytes`` (free before it). CPU (and no probe): ``budget * bytes_per_token + fixed_bytes`` (the
    logits chunks) must fit ``free_bytes``.
    """
    if device.type != "cuda" or probe is None:
        need = budget * bytes_per_token + fixed_bytes
        if need > free_bytes:
            return f"a batch needs about {need / 2**30:.2f} GiB, {free_bytes / 2**30:.2f} GiB is available"
        return None
    try:
        peak = probe(budget)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        return f"a full-length batch ran out of memory ({str(exc).splitlines()[0][:160]})"
    finally:
        _release_cuda_cache()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # reported peaks are the run's, not the probe's
    if peak > free_bytes:
        return f"a full-length batch peaked at {peak / 2**30:.2f} GiB, {free_bytes / 2**30:.2f} GiB is free"
    return None


def _release_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def scoring_probe(
    model: PreTrainedModel,
    device: torch.device,
    max_length: int,
    *,
    reference: PreTrainedModel | None = None,
    pad_token_id: int = 0,
) -> Probe:
    """A :data:`Probe` that scores ``budget // max_length`` rows of ``max_length + 1`` tokens, every position
    scored (the worst case), with the real :func:`~distperp_harness.run.scoring.engine.forward.score_batch`."""
    from distperp_harness.model.sharding import gathered
    from distperp_harness.planning.requests import Unit
    from distperp_harness.run.scoring.engine.forward import score_batch

    vocab = int(getattr(model.config, "vocab_size", 2) or 2)

    def probe(budget: int) -> int:
        rows = max(1, budget // max_length)
        tokens = torch.randint(0, vocab, (rows, max_length + 1), generator=torch.Generator().manual_seed(0))
        units = [Unit(tuple(row), max_length) for row in tokens.tolist()]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with gathered(model, reference):  # sharded weights (shard_size): every rank of a group probes together
            score_batch(model, units, device=device, pad_token_id=pad_token_id, reference=reference)
        if device.type != "cuda":
            return 0
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)

    return probe


def batching_for(
    options: Options,
    model: torch.nn.Module,
    device: torch.device,
    max_length: int,
    *,
    reference: torch.nn.Module | None = None,
    resident_bytes: int = 0,
    total_memory: TotalMemory = total_memory_bytes,
) -> Batching:
    """Fixed rows per batch, or for ``batch_size=auto`` / ``auto:N`` the token budget of :func:`memory_budget`.

    Args:
        resident_bytes: stored weight bytes of the model and the reference.
        total_memory: the device's memory size (tests pass a fake).

    Returns:
        ``Batching(batch_size=N)`` for an integer batch size, else ``Batching(batch_size=None, token_budget=T)``
        with ``max_length <= T <= max_batch_size * max_length``, ``T`` a power of two (or ``max_length``).
    """
    if not options.auto_batch:
        return Batching(batch_size=int(options.batch_size), max_batch_size=options.max_batch_size)
    if options.auto_batch_schedule > 1:
        _log_main(
            "batch_size=%s: distperp detects one token budget at start (a batch of shorter units gets more "
            "rows), so it re-detects nothing; treated as batch_size=auto",
            options.batch_size,
        )
    total = total_memory(device)
    budget = memory_budget(
        model,
        max_length,
        options.max_batch_size,
        total,
        device_type=device.type,
        resident_bytes=resident_bytes,
        reference=reference,
    )
    fraction = _MEMORY_FRACTION.get(device.type, _MEMORY_FRACTION["cpu"])
    _log_main(
        "batch_size=auto: token budget %d (%d rows of max_length=%d; %.0f%% of %s's %.1f GiB less %.2f GiB "
        "of weights%s)",
        budget,
        budget // max_length,
        max_length,
        100 * fraction,
        device.type,
        total / 2**30,
        resident_bytes / 2**30,
        f", at most {_CPU_MAX_TOKENS} tokens on CPU" if device.type == "cpu" else "",
    )
    return Batching(batch_size=None, token_budget=budget, max_batch_size=options.max_batch_size)


def generation_rows(batching: Batching, length: int, *, activation_bytes: int, kv_bytes: int) -> int:
    """Rows of a generation batch whose rows grow to ``length`` tokens (prompt + ``max_gen_toks``).

    ``batch_size=N``: N rows, as asked. ``auto``: the rows the token budget allows, further capped so that the
    prefill's activations *and* the KV cache of every row (``kv_bytes`` per token, :func:`kv_cache_bytes_per_token`)
    fit in the room the budget was sized for (``token_budget * activation_bytes``). Depends only on the model
    and the budget, so generation batches are the same for every world size.
    """
    rows = batching.rows_for(length)
    if batching.token_budget is None:
        return rows
    room = batching.token_budget * activation_bytes
    return max(1, min(rows, room // max(1, length * (activation_bytes + kv_bytes))))


def agree_on_batching(  # noqa: PLR0913 - keyword-only, defaulted facts of the model
    collective: "Collective",
    options: Options,
    model: PreTrainedModel,
    device: torch.device,
    max_length: int,
    *,
    reference: PreTrainedModel | None = None,
    pad_token_id: int = 0,
    unsharded_bytes: int | None = None,
) -> Batching:
    """Rank 0's :func:`batching_for`, after every rank checked it can hold it (:func:`check_budget`).

    ``unsharded_bytes``: the stored bytes of whole copies of the model and the reference. With sharded weights
    (``shard_size``) the budget is still sized from them, as if one device held every weight, so a sharded run
    packs the same batches as an unsharded one and gives the same bits.

    Raises:
        ValueError: on every rank, naming the ranks that cannot hold the budget and what to do.
    """
    from distperp_harness.model.quantize import weight_bytes

    resident = (
        unsharded_bytes
        if unsharded_bytes is not None
        else weight_bytes(model) + (weight_bytes(reference) if reference is not None else 0)
    )
    batching: Batching = collective.all_gather_object(
        batching_for(options, model, device, max_length, reference=reference, resident_bytes=resident),
        "agree on batching",
    )[0]
    if batching.token_budget is None:
        return batching
    per_token = max(activation_bytes_per_token(m, max_length) for m in (model, reference) if m is not None)
    # With sharded or tensor-parallel weights a probe that runs out of memory on one rank mid-forward leaves the rest of
    # its group waiting in a gather or all-reduce that never comes: no verdict could be gathered. The estimate alone
    # decides there.
    from distperp_harness.model.sharding import is_sharded
    from distperp_harness.model.tensor_parallel import is_tensor_parallel

    probe = (
        scoring_probe(model, device, max_length, reference=reference, pad_token_id=pad_token_id)
        if device.type == "cuda" and not is_sharded(model) and not is_tensor_parallel(model)
        else None
    )
    from distperp_harness.run.scoring.engine.forward import chunk_bytes

    logits = chunk_bytes(device.type, first_float_dtype(model), first_float_dtype(reference))
    problem = check_budget(
        batching.token_budget,
        max_length,
        device,
        free_bytes=room_bytes(device),
        probe=probe,
        bytes_per_token=per_token,
        fixed_bytes=logits,
    )
    problems = collective.all_gather_object((problem, str(device)), "check the batch budget")
    bad = [f"rank {rank} ({where}): {why}" for rank, (why, where) in enumerate(problems) if why]
    if bad:
        raise InputError(
            f"batch_size=auto chose {batching.token_budget} tokens per batch (on rank 0, from the model and the "
            f"device's total memory, so that every rank computes the same batches), but not every rank can hold "
            f"it: {'; '.join(bad)}. Another process may be using that device's memory. Fix: free it, or pass "
            f"batch_size=N (rows per batch) or a smaller max_batch_size.",
            same_on_every_rank=True,
        )
    return batching
