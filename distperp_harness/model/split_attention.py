"""Attention over a key/value cache split across the members of a context-parallel group (issue 65's decode step).

A long prompt's cache stays where its prefill computed it: each member keeps its own positions' keys and values. A
decode step's query then attends over every member's part: each member computes its part's attention output and the
log-sum-exp of its scores (:func:`partial_attention`), the members exchange the two, and every member combines them
in member order (:func:`combine_partials`), exactly as one softmax over all keys up to float32 rounding: with
``m = max_i lse_i`` and ``w_i = exp(lse_i - m)``, ``out = sum_i w_i out_i / sum_i w_i``. A member with no key in
reach (an empty part, or every key outside a sliding window) contributes ``lse = -inf`` and weight 0. The combine's
order is fixed (member order), so at a fixed group size every member and every run gets the same bits.

Which member stores a new position's keys and values is a fixed rule of the position (:func:`owner_of`): blocks of
:data:`APPEND_BLOCK` positions in turn, so the parts grow evenly and no member's cache outgrows the others' by more
than a block.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

APPEND_BLOCK = 256
"""Positions per block that one member stores during decoding before the next member's turn (:func:`owner_of`)."""


def owner_of(position: int, group_size: int, first: int, block: int = APPEND_BLOCK) -> int:
    """The member that stores the keys and values of generated position ``position`` (``first``: the prompt's length,
    the first generated position): blocks of ``block`` positions, member 0 first, in turn."""
    if position < first:
        raise ValueError(f"internal error: position {position} is in the prompt ({first} tokens), not generated")
    return ((position - first) // block) % group_size


def partial_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    reach: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One member's part of a decode step's attention: ``(out, lse)`` in float32, ``out`` ``[B, H, Q, D]`` (the
    softmax over this part's keys times its values) and ``lse`` ``[B, H, Q]`` (the log-sum-exp of its scaled scores;
    ``-inf`` where no key is in reach, ``out`` 0 there).

    ``query`` ``[B, H, Q, D]``; ``keys``/``values`` ``[B, H_kv, K, D]`` (grouped-query heads: ``H`` a multiple of
    ``H_kv``; ``K`` may be 0); ``reach`` ``[B, 1 or H, Q, K]`` booleans, True where a query may attend a key (a
    sliding window, padding), None: every key."""
    b, heads, q_len, dim = query.shape
    kv_heads, k_len = keys.shape[1], keys.shape[2]
    if heads % max(1, kv_heads):
        raise ValueError(f"internal error: {heads} query heads over {kv_heads} key/value heads")
    if k_len == 0:
        return query.new_zeros(b, heads, q_len, values.shape[-1], dtype=torch.float32), query.new_full(
            (b, heads, q_len), float("-inf"), dtype=torch.float32
        )
    groups = heads // kv_heads
    # each key-value head with its query heads (h = j * groups + g): no copy of the keys per query head
    q = query.float().reshape(b, kv_heads, groups * q_len, dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2)) * scale  # [B, H_kv, groups * Q, K]
    if reach is not None:
        if reach.shape[1] == 1:  # one mask for every head: the same for each query head of a key-value head
            grouped = reach.expand(b, 1, q_len, k_len)[:, :, None].expand(b, 1, groups, q_len, k_len)
        else:
            grouped = reach.expand(b, heads, q_len, k_len).reshape(b, kv_heads, groups, q_len, k_len)
        scores = scores.masked_fill(~grouped.reshape(b, -1, groups * q_len, k_len), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.matmul(weights, values.float()).masked_fill(~finite.unsqueeze(-1), 0.0)
    return out.reshape(b, heads, q_len, -1), lse.reshape(b, heads, q_len)


def combine_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention output over every part's keys from the members' :func:`partial_attention` results, in member
    order (module doc): float32 ``[B, H, Q, D]``; 0 where no member had a key in reach."""
    if not parts:
        raise ValueError("internal error: no part to combine")
    lses = torch.stack([lse for _, lse in parts])  # [members, B, H, Q]
    top = lses.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.zeros_like(parts[0][0])
    norm = torch.zeros_like(top)
    for out, lse in parts:  # member order: the same sums on every member
        weight = torch.exp(lse - top)
        total = total + weight.unsqueeze(-1) * out
        norm = norm + weight
    return torch.where(norm.unsqueeze(-1) > 0, total / norm.clamp_min(torch.finfo(norm.dtype).tiny).unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class SplitStep:
    """One decode step of a group over its split cache, as this member sees it, for ``R`` rows: ``gather`` (every
    member's tensor in member order), ``key_positions`` ``[R, K]`` (the positions of this member's stored keys in
    cache order, after this step's append), ``valid`` ``[R, K]`` (which of them count: real prompt positions and
    generated positions this member stores; pads and other members' positions do not), ``positions`` ``[R]`` (each
    row's query position) and each attention module's rule (``rule(module)``: a window or chunk,
    :class:`LayerAttention`)."""

    gather: Callable[[torch.Tensor], list[torch.Tensor]]
    key_positions: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    rule: Callable[[torch.nn.Module], Any]

    def reach(self, module: torch.nn.Module) -> torch.Tensor:
        """``[R, 1, 1, K]``: the stored keys each row's query attends to in ``module``'s layer."""
        keys, query = self.key_positions, self.positions[:, None]
        ok = self.valid.bool() & (keys <= query)
        extra = self.rule(module).allows(query, keys)
        return (ok if extra is None else ok & extra)[:, None, None]


_STEP: contextvars.ContextVar[SplitStep | None] = contextvars.ContextVar("distperp_split_step", default=None)


@contextlib.contextmanager
def split_step(step: SplitStep) -> Iterator[None]:
    """Within the block (this thread), attention under the context-parallel function is :func:`step_attention`."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def active_step() -> SplitStep | None:
    """The decode step in progress in this thread (:func:`split_step`), or None."""
    return _STEP.get()


def step_attention(
    step: SplitStep, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Any
) -> torch.Tensor:
    """transformers' attention output (``[B, Q, H, D]`` in the query's dtype) of a decode step over the group's
    split cache: this member's part (``key``/``value``: its stored keys, the step's own appended where it stores
    it), every member's part gathered and combined in member order."""
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    out, lse = partial_attention(query, key, value, scale, step.reach(module).to(key.device))
    parts = step.gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1))  # one all-gather per layer: output and lse
    combined = combine_partials([(p[..., :-1], p[..., -1]) for p in parts])
    return combined.to(query.dtype).transpose(1, 2).contiguous()
