"""One batch scored by a context-parallel group (``cp_size=N``): every member holds the batch, computes its own
columns of every row (:func:`~distperp_harness.model.cp_attention.zigzag`) through a forward whose attention
gathers the group's keys and values, and the log-probabilities of the scored positions it owns; the positions'
scores are then summed over the group (each position is computed by one member, the others add exact zeros), so
every member holds every position's score and builds the same unit table as
:func:`~distperp_harness.run.scoring.engine.forward.score_batch` does from one forward.

Rows are right-padded to a multiple of ``2N`` columns. Every row runs with its tree tables and position ids
(:class:`~distperp_harness.run.scoring.engine.masks.Packing`; a plain row is a tree of one run): the attention asks
for the mask of each block of this member's queries under its layer type's rule. A shared prefix is not computed
once here (its cache would be split across the group): the caller gives batches without one. A reference model runs
the same split forward after the model's, and its log-probabilities, KL and top-1 agreement are summed like the
model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch

from distperp_harness.model.attention import FULL, AttentionLayout, LayerAttention
from distperp_harness.model.cp_attention import Gather, Group, context_parallel, padded_length, zigzag
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row, unit_rows
from distperp_harness.run.scoring.engine.forward import (
    BatchScores,
    NonFiniteLogitsError,
    PositionScores,
    _are_rows,
    _chunks,
    _features,
    _layout,
    _vocab_size,
    position_scores,
    unit_table,
)
from distperp_harness.run.scoring.engine.masks import Packing
from distperp_harness.run.scoring.engine.support import paths_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class MemberRows:
    """This member's query columns of a batch: its position ids (what ``_features`` passes the model; no mask, the
    attention asks :meth:`masks` for each block of its queries)."""

    packing: Packing
    columns: torch.Tensor
    layout: AttentionLayout | None
    layer_types: Sequence[str] | None

    def kwargs(self, model: PreTrainedModel, layout: AttentionLayout | None = None) -> dict:
        return {"position_ids": self.packing.position_ids[:, self.columns]}

    def masks(self, module: torch.nn.Module, rows: slice, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """:data:`~distperp_harness.model.cp_attention.Masks` of the batch's tree rows under the module's layer
        type's rule (window or chunk), additive in ``dtype``."""
        allowed = self.packing.allowed_block(self.rule(module), self.columns[rows], keys)
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))

    def rule(self, module: torch.nn.Module) -> LayerAttention:
        return layer_rule(self.layout, self.layer_types, module)


def layer_rule(
    layout: AttentionLayout | None, layer_types: Sequence[str] | None, module: torch.nn.Module
) -> LayerAttention:
    """The rule (window, chunk or full) of the attention ``module``'s layer under a model's decided ``layout``."""
    if layout is None:
        return FULL
    if not layout.keyed:
        return layout.rules[0]
    index = getattr(module, "layer_idx", None)
    if layer_types is None or index is None:
        raise ValueError("internal error: a keyed attention layout without the layers' types")
    return dict(layout.kinds)[layer_types[int(index)]]


@torch.no_grad()
def score_batch_cp(  # noqa: PLR0913 - score_batch's keywords, the group and its two collectives
    model: PreTrainedModel,
    batch: Sequence[Row] | Sequence[Unit],
    *,
    device: torch.device,
    pad_token_id: int,
    group: Group,
    reference: PreTrainedModel | None = None,
    gather: Gather | None = None,
    reduce: Any = None,
) -> BatchScores:
    """:func:`~distperp_harness.run.scoring.engine.forward.score_batch`'s result for ``batch``, computed by the
    members of ``group`` together (module doc); every member calls it with the same batch. ``reference``: split the
    same way (its own forward, after the model's; KL and top-1 at the member's positions). ``gather``/``reduce``: the
    group's all-gather and sum (tests simulate a group in one process); by default ``group``'s own."""
    gather = gather or group.gather
    reduce = reduce or group.all_reduce
    batch_rows = list(batch) if _are_rows(batch) else unit_rows(batch)
    units = [u for r in batch_rows for u in r.units]
    ids, rows, cols, targets, _ = _layout(batch_rows, pad_token_id, device, 0)
    length = padded_length(ids.shape[1], group.size)
    ids = torch.nn.functional.pad(ids, (0, length - ids.shape[1]), value=pad_token_id)
    packing = Packing.of(batch_rows, length, device)
    mine = zigzag(length, group.size, group.member).to(device)
    local = torch.full((length,), -1, dtype=torch.long, device=device)
    local[mine] = torch.arange(len(mine), device=device)
    where = local[cols]
    owned = (where >= 0).nonzero().flatten()
    mine_targets = targets[owned]
    chunks = _chunks(len(owned), _vocab_size(model), device.type, reference is not None)
    chunk_rows = max((b - a for a, b in chunks), default=1)

    def features(which: PreTrainedModel) -> tuple[torch.Tensor, Any]:
        paths = paths_of(which)
        member = MemberRows(packing, mine, paths.layout, getattr(which.config, "layer_types", None))
        with context_parallel(gather, group.size, length, group.member, member.masks):
            return _features(which, paths, ids[:, mine], (rows[owned], where[owned]), chunk_rows, cast(Packing, member))

    feats, to_logits = features(model)
    ref_features = features(reference) if reference is not None else None
    scores = position_scores(feats, to_logits, ref_features, mine_targets, chunks, chunk_rows, reference, device)
    merged = _summed(scores, owned, len(targets), reduce, device)
    if len(targets) and not bool(merged.finite.all()):
        bad = (~merged.finite).nonzero().flatten()
        raise NonFiniteLogitsError(sorted({int(r) for r in rows[bad].tolist()}))
    return unit_table(units, merged)


def _summed(scores: PositionScores, owned: torch.Tensor, n: int, reduce: Any, device: torch.device) -> PositionScores:
    """Every position's scores on every member: each member's own positions in one float64 table (zeros
    elsewhere), summed over the group (each position is computed by one member: the sum is its value exactly)."""
    columns = [scores.logprob, scores.greedy, scores.finite]
    if scores.ref_logprob is not None and scores.kl is not None and scores.top1 is not None:
        columns += [scores.ref_logprob, scores.kl, scores.top1]
    table = torch.zeros(len(columns), n, dtype=torch.float64, device=device)
    for i, column in enumerate(columns):
        table[i, owned] = column.double()
    table = reduce(table)
    if len(columns) == 3:
        return PositionScores(table[0], table[1] > 0.5, table[2] > 0.5)
    return PositionScores(table[0], table[1] > 0.5, table[2] > 0.5, table[3], table[4], table[5] > 0.5)
