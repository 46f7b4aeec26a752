"""The traffic probe of a loaded model: a few forwards at start, counted by
:func:`~distperp_harness.distributed.traffic.forward_traffic` (``config.distperp.traffic``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch

from distperp_harness.distributed.traffic import forward_traffic
from distperp_harness.model.cp_attention import Group

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def model_probes(
    model: PreTrainedModel, device: torch.device, pad_token_id: int | None, cp: Group | None = None
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """``(decode, score)`` probes of :func:`forward_traffic` for a loaded model (the real scoring path, no
    reference; with a context-parallel group of more than one, its members' forward of the row)."""
    from distperp_harness.planning.requests import Unit
    from distperp_harness.run.scoring.engine.cp_forward import score_batch_cp
    from distperp_harness.run.scoring.engine.forward import score_batch

    pad = pad_token_id if pad_token_id is not None else 0

    def decode(rows: int) -> None:
        with torch.no_grad():
            model(input_ids=torch.full((rows, 1), pad, device=device), use_cache=False, logits_to_keep=1)

    def score(tokens: int) -> None:
        row = [Unit(tuple([pad] * (tokens + 1)), tokens)]
        if cp is not None and cp.size > 1:
            score_batch_cp(model, row, device=device, pad_token_id=pad, group=cp)
        else:
            score_batch(model, row, device=device, pad_token_id=pad)

    return decode, score


def model_traffic(
    model: PreTrainedModel,
    device: torch.device,
    pad_token_id: int | None,
    *,
    sharded: bool,
    tensor_parallel: bool,
    cp: Group | None = None,
) -> dict | None:
    """:func:`forward_traffic` of a loaded model whose forwards are collective (``sharded``: FSDP2, its root
    gathered around each forward as scoring and generation do; ``tensor_parallel``; ``cp``: a context-parallel
    group of more than one, whose scoring forwards gather keys and values), else ``None`` (no collectives). Every
    rank calls this together."""
    grouped = cp is not None and cp.size > 1
    if not (sharded or tensor_parallel or grouped):
        return None
    from distperp_harness.model.sharding import gathered

    decode, score = model_probes(model, device, pad_token_id, cp)
    return forward_traffic(decode, score, (lambda: gathered(model)) if sharded else contextlib.nullcontext)
