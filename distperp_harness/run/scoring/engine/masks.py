"""The tree attention mask of a batch of rows (:mod:`distperp_harness.planning.rows`), for each attention
implementation and each layer type.

One rule, three forms. Query ``q`` of row ``b`` sees key ``k`` when ``k <= q`` and ``k``'s run is ``q``'s run or
one of its ancestors (:meth:`Row.ancestors`); a padding query sees every earlier column of its row (padding comes
last, so no real position sees it). With a shared prefix of ``p`` tokens (computed once, its key/value cache reused
by every row) the queries are the columns from ``p`` on and the keys every column: query ``q`` is column ``q + p``.
A layer type with a sliding window or chunks (:class:`~distperp_harness.model.attention.LayerAttention`) adds its rule
on the two columns' *positions* (a run continues its parent's positions, so along a root path they are the
positions an unshared row would give): a model whose layers differ gets one mask per layer type, as a mapping
(:class:`~distperp_harness.model.attention.AttentionLayout`). Every query still sees at least itself.

* ``sdpa``: a dense boolean ``[rows, 1, length - p, length]`` mask (True: attend); ``eager``: the same as an additive
  float mask (0 or the dtype's minimum). Both cost a mask element per (query, key): the memory estimate counts it
  (:func:`distperp_harness.model.memory.tree_mask_bytes_per_token`), and a dense mask keeps sdpa off the flash kernels.
* ``flex_attention``: a ``BlockMask`` from :func:`torch.nn.attention.flex_attention.create_block_mask` over a
  ``mask_mod`` that evaluates the same rule from two small tables (each column's run, the runs' ancestor matrix):
  per 128 x 128 block of (queries, keys) only whether it is empty, full or partial is stored, and the kernel skips
  empty blocks. Built with ``torch.compile`` on CUDA (no dense intermediate); on other devices uncompiled (it
  evaluates the rule densely once per batch, as ``sdpa``'s mask does).

transformers (5.x ``masking_utils``) passes any 4D mask, a ``BlockMask`` included, through unchanged
(``_preprocess_mask_arguments``); positions come from ``position_ids`` (each run continues its parent's).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch

from distperp_harness.model.attention import FULL, AttentionLayout, LayerAttention
from distperp_harness.model.cp_attention import ATTENTION as CP_ATTENTION
from distperp_harness.model.row_attention import ATTENTION as ROW_ATTENTION
from distperp_harness.planning.rows import Row

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FLEX_BLOCK = 128
"""Block size of flex attention's sparse block mask (torch's default); the run table is padded past it."""


@dataclass(frozen=True)
class Packing:
    """Tree mask tables and position ids of a batch holding tree rows, and the prefix it computes once.

    ``run[b, c]``: the batch-wide run id of column ``c`` of row ``b`` (each row's padding is a run of its own, and
    the table continues past the row with that padding run up to a multiple of :data:`FLEX_BLOCK` plus one block, so
    a ``mask_mod`` never indexes out of it); ``ancestors[r, s]``: run ``s`` is ``r`` or one of its ancestors (block
    diagonal over the rows; a padding run sees all of its row). ``positions[b, c]``: the position of column ``c``
    (the same width as ``run``); a padding column takes position 0, so that no padding shows the model a position
    its row does not reach (a learned position table ends at the model's context, and RoPE variants that pick their
    factor from the largest position id would read the batch's padded width); ``position_ids``: the queries'
    positions (columns from ``shared`` on). ``shared``: tokens of the prefix in ``prefix_ids`` (``[1, shared]``, or
    None); ``length``: the padded row length, prefix included.
    """

    run: torch.Tensor
    ancestors: torch.Tensor
    positions: torch.Tensor
    length: int
    shared: int = 0
    prefix_ids: torch.Tensor | None = None

    @property
    def position_ids(self) -> torch.Tensor:
        """``[rows, length - shared]``: the queries' position ids."""
        return self.positions[:, self.shared : self.length]

    @classmethod
    def of(cls, batch_rows: Sequence[Row], padded: int, device: torch.device, shared: int = 0) -> "Packing":
        n = len(batch_rows)
        width = -(-padded // FLEX_BLOCK) * FLEX_BLOCK + FLEX_BLOCK
        run = torch.zeros(n, width, dtype=torch.long)
        pos = torch.zeros(n, width, dtype=torch.long)
        blocks = []
        base = 0
        for i, row in enumerate(batch_rows):
            run[i, : row.length] = torch.tensor(row.run_ids()) + base
            run[i, row.length :] = base + len(row.runs)  # this row's padding: a run that sees all of the row
            pos[i, : row.length] = torch.tensor(row.position_ids())
            anc = torch.ones(len(row.runs) + 1, len(row.runs) + 1, dtype=torch.bool)
            anc[: len(row.runs), : len(row.runs)] = torch.from_numpy(row.ancestors())
            anc[: len(row.runs), len(row.runs)] = False
            blocks.append(anc)
            base += len(row.runs) + 1
        prefix = batch_rows[0].tokens()[:shared] if shared else None
        return cls(
            run.to(device),
            torch.block_diag(*blocks).to(device),
            pos.to(device),
            padded,
            shared,
            None if prefix is None else torch.tensor([prefix], dtype=torch.long, device=device),
        )

    @classmethod
    def causal(cls, rows: int, length: int, device: torch.device) -> "Packing":
        """``rows`` rows of one ``length``-token run each: plain causal rows in tree form (the shapes, dtypes and
        mask form of a tree-row batch, for compile warm-ups)."""
        width = -(-length // FLEX_BLOCK) * FLEX_BLOCK + FLEX_BLOCK
        run = (2 * torch.arange(rows)).repeat_interleave(width).view(rows, width)
        run[:, length:] += 1  # each row's padding run
        block = torch.ones(2, 2, dtype=torch.bool).tril()
        positions = torch.arange(width).repeat(rows, 1)
        positions[:, length:] = 0  # padding, as in :meth:`of`
        return cls(run.to(device), torch.block_diag(*[block] * rows).to(device), positions.to(device), length)

    @functools.cached_property
    def causal_only(self) -> bool:
        """Whether every row is one run at positions 0, 1, ... followed by its padding (plain rows: the tree mask is
        the causal one, and each real column's position is its index)."""
        n = self.run.shape[1]
        real = self.run == self.run[:, :1]
        columns = torch.arange(n, device=self.positions.device).expand_as(self.positions)
        return bool(real.logical_or(self.run == self.run[:, -1:]).all() and (self.positions == columns)[real].all())

    @functools.cached_property
    def allowed(self) -> torch.Tensor:
        """Dense ``bool [rows, 1, length - shared, length]``: True where the query sees the key (full attention)."""
        run = self.run[:, : self.length]
        q = run[:, self.shared :]
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=run.device).tril()[self.shared :]
        return (self.ancestors[q[:, :, None], run[:, None, :]] & causal)[:, None]

    def allowed_block(self, rule: LayerAttention, columns: torch.Tensor, keys: int) -> torch.Tensor:
        """``allowed_under(rule)[:, :, columns, :keys]`` (no shared prefix), computed for those query columns and
        keys alone: ``bool [rows, 1, len(columns), keys]`` (a block of a context-parallel member's queries), or
        ``[1, 1, len(columns), keys]`` when it is the same for every row (:attr:`causal_only`)."""
        if self.shared:
            raise ValueError("internal error: a member's mask blocks are for batches without a shared prefix")
        run, pos = self.run[:, :keys], self.positions[:, :keys]
        at = torch.arange(keys, device=run.device)
        if self.causal_only:  # every row one run from position 0: the mask is causal, the same for every row
            causal = at[None, :] <= columns[:, None]
            window = rule.allows(columns[:, None], at[None, :])
            return (causal if window is None else causal & window)[None, None]
        queries = self.run[:, columns]
        seen = self.ancestors[queries[:, :, None], run[:, None, :]] & (at[None, None, :] <= columns[:, None])
        extra = rule.allows(self.positions[:, columns][:, :, None], pos[:, None, :])
        return (seen if extra is None else seen & extra)[:, None]

    def allowed_under(self, rule: LayerAttention) -> torch.Tensor:
        """:attr:`allowed` under a layer type's ``rule`` (a window or chunk on the columns' positions)."""
        pos = self.positions[:, : self.length]
        extra = rule.allows(pos[:, self.shared :, None], pos[:, None, :])
        return self.allowed if extra is None else self.allowed & extra[:, None]

    def mask_mod(
        self, rule: LayerAttention = FULL
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Flex attention's form of :meth:`allowed_under`: ``mask_mod(b, h, q, k) == allowed_under(rule)[b, 0, q,
        k]``, from the run, ancestor and position tables alone."""
        run, ancestors, positions = self.run, self.ancestors, self.positions
        # A tensor, not a Python int: a compiled flex kernel then reads it as data (inductor's CPU template, torch
        # 2.13, generates C++ that does not compile when the offset becomes a symbolic int on a recompile).
        shared = torch.tensor(self.shared, device=run.device)

        def tree_mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            column = q + shared
            seen = (k <= column) & ancestors[run[b, column], run[b, k]]
            extra = rule.allows(positions[b, column], positions[b, k])
            return seen if extra is None else seen & extra

        return tree_mask

    def block_mask(self, rule: LayerAttention = FULL):
        """The ``BlockMask`` of :meth:`mask_mod` over ``length - shared`` queries and ``length`` keys (through
        ``torch.compile`` on CUDA, so no dense ``[rows, queries, keys]`` intermediate exists there); one per rule."""
        if rule not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            device = self.run.device
            build = torch.compile(create_block_mask) if device.type == "cuda" else create_block_mask
            self._block_masks[rule] = build(
                self.mask_mod(rule), self.run.shape[0], None, self.length - self.shared, self.length, device, FLEX_BLOCK
            )
        return self._block_masks[rule]

    @functools.cached_property
    def _block_masks(self) -> dict[LayerAttention, Any]:
        return {}

    def kwargs(self, model: PreTrainedModel, layout: AttentionLayout | None = None) -> dict:
        """``attention_mask`` (in the form ``model``'s attention implementation takes; a mapping from layer type to
        mask for a keyed ``layout``) and ``position_ids``. ``layout`` None: one full-attention mask."""
        impl = getattr(model.config, "_attn_implementation", None)
        forms: dict[LayerAttention, Any] = {}

        def form(rule: LayerAttention) -> Any:
            if rule not in forms:
                if impl == "flex_attention":
                    forms[rule] = self.block_mask(rule)
                else:
                    forms[rule] = attention_form(model, self.allowed_under(rule))
            return forms[rule]

        return {"attention_mask": by_layout(layout, form), "position_ids": self.position_ids}


def by_layout(layout: AttentionLayout | None, form: Callable[[LayerAttention], Any]) -> Any:
    """The ``attention_mask`` argument for ``layout``: ``form(rule)`` of its one rule (``None``: full attention), or
    a mapping from layer type to its rule's form for a keyed layout (as transformers takes it)."""
    if layout is None:
        return form(FULL)
    if layout.keyed:
        return {name: form(rule) for name, rule in layout.kinds}
    return form(layout.rules[0])


def attention_form(model: PreTrainedModel, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` (``bool [rows, 1, queries, keys]``) as the dense 4D mask ``model``'s attention takes: as is for
    sdpa (and context parallelism's sdpa over gathered keys), additive (0 or the dtype's minimum, in the
    embeddings' dtype) for eager and any other dense form."""
    if getattr(model.config, "_attn_implementation", None) in ("sdpa", CP_ATTENTION, ROW_ATTENTION):
        return allowed
    dtype = embedding_dtype(model)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def embedding_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype of ``model``'s input embedding weights, which an additive (eager) attention mask is built in."""
    # torch types a submodule's attributes Tensor | Module; an embedding's weight is a tensor
    return cast(torch.Tensor, model.get_input_embeddings().weight).dtype


def flex_shapes(device: torch.device, models: Sequence[torch.nn.Module]) -> contextlib.AbstractContextManager:
    """Where forwards of ``models`` run: on CPU with flex attention, compiled for static shapes only.

    transformers compiles ``flex_attention`` once and torch recompiles it for each new shape; from the second shape
    on, torch 2.13 makes sizes symbolic, and inductor's CPU flex template then emits C++ that does not compile
    (``'cur_kvSplitSize0' was not declared``) when a mask reads a symbolic size (transformers' own causal mask and
    offsets do). Static shapes recompile per shape instead (then, past torch's recompile limit, run uncompiled:
    slower, same rule). CUDA keeps torch's defaults.
    """
    if device.type == "cpu" and any(
        getattr(getattr(m, "config", None), "_attn_implementation", None) == "flex_attention" for m in models
    ):
        return torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()
