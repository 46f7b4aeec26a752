"""Context parallelism's attention (``cp_size=N``): N consecutive ranks compute one row together, each its own
columns, and every layer all-gathers the group's keys and values.

A row of ``L`` columns (padded to a multiple of ``2N``) is cut in ``2N`` equal chunks; member ``i`` takes chunks
``i`` and ``2N-1-i`` (:func:`zigzag`), so every member has the same share of causal work. Inside a context-parallel
forward (:func:`context_parallel`), the attention function registered under :data:`ATTENTION` gathers each layer's
key and value states from the group (one ``all_gather`` each, in member order), puts them back in the row's order
and runs transformers' sdpa attention of this member's queries over all keys, with this member's rows of the row's
4D mask (``[B, 1, L_local, L]``, given to the model as ``attention_mask``). Grouped-query heads, scaling and the
mask are sdpa's as for any forward; nothing of a model is forked. Outside a context-parallel forward the function
is transformers' sdpa attention itself, so the same model object also runs plain forwards (the probe, generation).

Models whose attention is not sdpa's (eager soft-caps, sinks; flex; flash) are refused for ``cp_size`` > 1
(:func:`check_attention`): their attention is more than a mask over gathered keys.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from distperp_harness.errors import InputError

ATTENTION = "distperp_cp"
"""The name the context-parallel attention function is registered under in transformers' attention interface."""


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp`` (the chunks are equal)."""
    step = 2 * cp
    return -(-length // step) * step


def zigzag(length: int, cp: int, member: int) -> torch.Tensor:
    """The columns member ``member`` of a group of ``cp`` computes in a row of ``length`` columns (a multiple of
    ``2 * cp``): chunks ``member`` and ``2 * cp - 1 - member`` of ``2 * cp`` equal chunks, in row order."""
    if length % (2 * cp):
        raise ValueError(f"internal error: a context-parallel row of {length} columns is not cut in {2 * cp} chunks")
    size = length // (2 * cp)
    first, second = member, 2 * cp - 1 - member
    return torch.cat([torch.arange(first * size, (first + 1) * size), torch.arange(second * size, (second + 1) * size)])


def natural_order(length: int, cp: int) -> torch.Tensor:
    """The permutation from the members' columns concatenated in member order to the row's order:
    ``gathered.index_select(dim, natural_order(...))`` is the row."""
    owned = torch.cat([zigzag(length, cp, m) for m in range(cp)])
    return torch.argsort(owned)


AUTO_TOKENS_PER_MEMBER = 2048
"""``cp_min_tokens=auto``: rows of at least this many tokens per member of the group go to the group. Below it a
member's matrices get narrow and its two gathers per layer a visible share of its work, while a data-parallel row
costs nothing extra; from it on each member computes two chunks of at least 1,024 tokens."""


def min_tokens(option: Any, cp_size: int) -> int:
    """The row length from which rows are computed by a group: ``cp_min_tokens`` (an integer, or ``auto``:
    :data:`AUTO_TOKENS_PER_MEMBER` per member); with ``cp_size`` 1 no row is (a huge number)."""
    if cp_size <= 1:
        return 1 << 62
    return option if isinstance(option, int) else AUTO_TOKENS_PER_MEMBER * cp_size


def received_bytes_per_token(config: Any, cp: int, element_bytes: int) -> float:
    """Bytes each member of a group of ``cp`` receives per token of a row in one scoring forward: every layer
    all-gathers the keys and values (``2 * kv_heads * head_dim`` elements of ``element_bytes`` per token; a ring
    brings each rank ``(cp-1)/cp`` of the gathered tensor), and the row's position scores are summed once
    (3 float64 per position; a ring all-reduce moves ``2 (cp-1)/cp`` of it)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    share = (cp - 1) / cp
    return config.num_hidden_layers * 2 * kv_heads * head_dim * element_bytes * share + 2 * share * 3 * 8


Gather = Callable[[torch.Tensor], list[torch.Tensor]]
"""Every member's tensor of this shape, in member order (an ``all_gather`` over the group)."""


@dataclass(frozen=True)
class Group:
    """This rank's context-parallel group: ``size`` members, this rank's ``member`` index, the torch process
    group (``None`` only for a group of one)."""

    size: int
    member: int
    process_group: Any = None

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (the same shape on every member), in member order."""
        if self.size == 1:
            return [tensor]
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The members' ``tensor`` summed, on every member (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.process_group)
        return tensor


Masks = Callable[[torch.nn.Module, slice, int, torch.dtype], "torch.Tensor | None"]
"""``masks(attention module, member rows, keys, dtype)``: the additive mask (0 where a query sees a key, -inf
elsewhere) of this member's query rows ``rows`` (a slice of its own columns) over the row's first ``keys`` keys,
``[B, 1, rows, keys]`` in ``dtype``, for that module's layer type; ``None``: plain causal rows need none."""


@dataclass(frozen=True)
class _Forward:
    gather: Gather
    chunk: int
    """Columns per chunk (the row's length over ``2 * cp``)."""
    chunks: tuple[int, int]
    """The indices of this member's two chunks, in row order."""
    masks: Masks

    def whole(self, states: torch.Tensor) -> torch.Tensor:
        """``[B, H, L_local, D]`` states of every member → ``[B, H, L, D]`` in the row's order (each member's two
        chunks copied to their places: one copy of the row, none of the concatenation)."""
        parts = self.gather(states.contiguous())
        size, last = self.chunk, 2 * len(parts) - 1
        out = states.new_empty((*states.shape[:2], 2 * len(parts) * size, states.shape[3]))
        for j, part in enumerate(parts):
            out[:, :, j * size : (j + 1) * size] = part[:, :, :size]
            out[:, :, (last - j) * size : (last - j + 1) * size] = part[:, :, size:]
        return out


_ACTIVE: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("distperp_cp", default=None)


@contextlib.contextmanager
def context_parallel(gather: Gather, cp: int, length: int, member: int, masks: Masks) -> Iterator[None]:
    """Within the block (this thread), forwards of a model whose attention is :data:`ATTENTION` gather each layer's
    keys and values through ``gather`` (every member of a group of ``cp`` in the same forward) for rows of
    ``length`` columns, this rank being member ``member``, each block of queries masked by ``masks`` (the model
    makes no mask of its own there: :func:`register`)."""
    chunks = (member, 2 * cp - 1 - member)
    token = _ACTIVE.set(_Forward(gather, length // (2 * cp), chunks, masks))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function contract: sdpa over the group's gathered keys and values inside
    :func:`context_parallel`, plain sdpa outside it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from distperp_harness.model.split_attention import active_step, step_attention

    step = active_step()
    if step is not None:  # a decode step over a cache split across the group
        return step_attention(step, module, query, key, value, kwargs.get("scaling")), None
    active = _ACTIVE.get()
    if active is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        raise ValueError("internal error: a context-parallel forward was given a mask; its masks come by block")
    key, value = active.whole(key), active.whole(value)
    groups = query.shape[1] // key.shape[1]
    scale = kwargs.get("scaling")
    # Each of this member's chunks attends to the keys up to its own end only: a causal row's keys after a chunk
    # are masked for all of its queries, so the work is that chunk's share of the causal attention, not L_local x L.
    # Its queries go in blocks, each with its own mask, and each key-value head with its query heads: a query row's
    # result depends on neither (query-subset and head invariant on CPU, tested), so no L_local x L mask and no
    # copy of the keys per query head is ever whole.
    size, outputs = active.chunk, []
    for k, c in enumerate(active.chunks):
        end = (c + 1) * size
        for block in query_blocks(size, end):
            rows = slice(k * size + block.start, k * size + block.stop)
            mask = active.masks(module, rows, end, query.dtype)
            heads = [
                torch.nn.functional.scaled_dot_product_attention(
                    query[:, h * groups : (h + 1) * groups, rows],
                    key[:, h : h + 1, :end].expand(-1, groups, -1, -1),
                    value[:, h : h + 1, :end].expand(-1, groups, -1, -1),
                    attn_mask=mask,
                    scale=scale,
                )
                for h in range(key.shape[1])
            ]
            outputs.append(torch.cat(heads, dim=1))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def query_blocks(rows: int, keys: int) -> list[slice]:
    """The sdpa calls of a chunk of ``rows`` queries over ``keys`` keys: blocks of sizes that differ by at most one
    (no short remainder), each of at most :data:`MASK_BLOCK` mask entries unless that is under
    :data:`MIN_QUERY_BLOCK` rows."""
    most = max(MIN_QUERY_BLOCK, MASK_BLOCK // max(1, keys))
    count = max(1, -(-rows // most))
    bounds = [i * rows // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


MASK_BLOCK = 1 << 20
"""Mask entries (query rows x keys) one sdpa call of a context-parallel member takes: 4 MiB as float32 (128 query
rows of an 8k-token row)."""
MIN_QUERY_BLOCK = 64
"""The fewest query rows of such a call (matrix products of fewer rows may round otherwise)."""


def register() -> None:
    """Register :func:`cp_attention` under :data:`ATTENTION`, with sdpa's mask form outside a context-parallel
    forward and none inside it (its masks come by block); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, cp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask)


def _mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' mask-function contract: sdpa's mask, or ``None`` inside a context-parallel forward."""
    from transformers.masking_utils import sdpa_mask

    from distperp_harness.model.split_attention import active_step

    inside = _ACTIVE.get() is not None or active_step() is not None
    return None if inside else sdpa_mask(*args, **kwargs)


def check_attention(model: Any, cp_size: int, source: str) -> None:
    """:class:`InputError` unless ``model`` attends through sdpa (what the gathered keys feed) and every RoPE it
    chooses by length can be made to choose from the whole row (:func:`~.lengths.unsteerable_ropes`), for
    ``cp_size`` > 1."""
    if cp_size <= 1:
        return
    from distperp_harness.model.lengths import unsteerable_ropes

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    unsteerable = unsteerable_ropes(model)
    if unsteerable:
        raise InputError(
            f"cp_size={cp_size}: {source!r} chooses its RoPE frequencies by the longest position a forward is given, "
            f"inside its own code ({', '.join(unsteerable)}, not transformers' dynamic_rope_update), and a member of "
            "a context-parallel group is given only its own columns: its rows would take other frequencies than "
            "one device's. Fix: cp_size=1, or a transformers version whose rotary embeddings choose through "
            "dynamic_rope_update (4.48 or later).",
            same_on_every_rank=True,
        )
    if impl in ("sdpa", ATTENTION):
        return
    raise InputError(
        f"cp_size={cp_size}: {source!r} attends with {impl!r}, and context parallelism gathers keys and values "
        "into transformers' sdpa attention (eager soft-caps and attention sinks, flex and flash attention are "
        "more than a mask over the keys). Fix: cp_size=1 (with shard_size or tp_size for a model bigger than "
        "one device), or a model that runs with attn_implementation='sdpa'.",
        same_on_every_rank=True,
    )


def _longest_position(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Inside :func:`context_parallel`: the longest position of the whole forward (every member's, gathered in
    member order); ``None`` outside it."""
    active = _ACTIVE.get()
    if active is None:
        return None
    return torch.stack(active.gather(position_ids.max().reshape(1).contiguous())).max()


def use(model: Any) -> None:
    """Make ``model`` (sdpa, :func:`check_attention`) attend through :func:`cp_attention`; a rotary embedding that
    chooses its frequencies by length chooses them from the whole row inside a group's forward
    (:func:`~distperp_harness.model.lengths.rope_choice_from`)."""
    from distperp_harness.model.lengths import rope_choice_from

    register()
    model.set_attn_implementation(ATTENTION)
    rope_choice_from(model, _longest_position)


def make_group(device: torch.device, world_size: int, rank: int, cp_size: int, timeout_s: float) -> Group:
    """This rank's :class:`Group` of ``cp_size`` consecutive ranks: a ``(dp, cp)`` DeviceMesh on the default
    group's backend, its groups bounded by ``timeout_s``. Every rank must call this together."""
    if cp_size <= 1:
        return Group(1, 0)
    from torch.distributed.device_mesh import init_device_mesh

    from distperp_harness.model.sharding import mesh_backend

    override = mesh_backend(timeout_s)
    mesh = init_device_mesh(
        device.type,
        (world_size // cp_size, cp_size),
        mesh_dim_names=("dp", "cp"),
        backend_override={"dp": override, "cp": override},
    )
    return Group(cp_size, rank % cp_size, mesh.get_group("cp"))
