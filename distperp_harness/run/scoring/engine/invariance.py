"""How ``batch_invariant=true`` scores a batch: its rows together, each attending alone, where this run's kernels make
a row's bits independent of its batch-mates; else each row in a forward of its own.

A row attending over its own keys alone (:mod:`~distperp_harness.model.row_attention`) gets its batch-mates'
influence out of attention; what is left is the matrix products and the per-position reductions, whose bits depend
on the batch only where a kernel splits its work by the number of rows (measured on this CPU: float32 products are
row-invariant from 16 rows, and every forward of the engine has at least 16 positions). That is a fact of the local
kernels (MKL, cuBLAS, the dtype), not a law, so :func:`rows_check` tries it once per run on the loaded model, its
dtype and device: rows of several lengths (a tree row among them), and rows continuing one cached prefix (as a row
group's, :attr:`~distperp_harness.run.rules.CachedPrefix.GROUP`), scored alone and in two batches, every bit of
every unit compared. Every rank checks and the ranks merge (:func:`merged`): one rank whose kernels differ sends every
rank to a forward per row, so that all ranks compute alike.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from distperp_harness.model.parts import embedding_rows
from distperp_harness.model.row_attention import why_not_alone
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row, ShareMode, build_rows, unit_rows
from distperp_harness.run.scoring.engine.forward import NonFiniteLogitsError, score_batch
from distperp_harness.run.scoring.engine.probe_checks import dtype_of
from distperp_harness.run.scoring.engine.support import paths_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHECK_SEED = 4321
"""Seed of the check's token ids (the same rows on every rank)."""
CHECK_LENGTHS = (5, 23, 70, 150)
"""Input lengths of the check's plain rows (capped by ``max_length``)."""
CHECK_PREFIX = 40
"""Tokens of the prefix the check's cached rows continue (a row group's prefix, computed once per batch)."""


class Invariance(enum.Enum):
    """How a run's scoring forwards hold its rows."""

    OFF = "batches as the kernels compute them (the bits follow the batch plan)"
    BATCHED = "rows in batches, each attending over its own keys alone"
    EACH_ROW = "each row in a forward of its own"

    @property
    def rows_alone(self) -> bool:
        """Whether each row's attention runs over its own keys alone."""
        return self is not Invariance.OFF

    @property
    def row_at_a_time(self) -> bool:
        """Whether each row is a forward of its own."""
        return self is Invariance.EACH_ROW


def _seeded_ids(vocab: int, seed: int) -> Callable[[int], list[int]]:
    """``ids(n)``: ``n`` token ids from 3 on (below ``vocab``), drawn in turn from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    low = min(3, max(0, vocab - 1))
    return lambda n: torch.randint(low, max(low + 1, vocab), (n,), generator=g).tolist()


def check_rows(vocab: int, max_length: int) -> list[Row]:
    """The check's rows: plain rows of :data:`CHECK_LENGTHS` input tokens and one tree row (two answers after one
    context), each unit scoring its last 4 tokens; ids from 3 on, seeded."""
    ids = _seeded_ids(vocab, CHECK_SEED)

    lengths = sorted({min(n, max_length - 1) for n in CHECK_LENGTHS if n < max_length} or {max(1, max_length - 1)})
    units = [Unit(tuple(ids(n + 1)), min(4, n)) for n in lengths]
    context = ids(min(30, max(2, max_length // 2)))
    branches = [Unit(tuple(context + ids(k)), k) for k in (3, 5) if len(context) + k <= max_length]
    rows = list(unit_rows(units))
    if len(branches) == 2:
        rows += build_rows(branches, ShareMode.PREFIX, max_row_length=max_length)
    return rows


def cached_rows(vocab: int, max_length: int) -> list[Row]:
    """Rows continuing one prefix of :data:`CHECK_PREFIX` tokens (computed once, as a row group's): plain rows of 3,
    9 and 40 more tokens and a tree row (two answers after 12 more), each unit scoring every position after the
    prefix; none where ``max_length`` is too short for them."""
    ids = _seeded_ids(vocab, CHECK_SEED + 1)

    if max_length < CHECK_PREFIX + 60:
        return []
    prefix = ids(CHECK_PREFIX)
    rows = list(unit_rows([Unit(tuple(prefix + ids(k)), k - 1) for k in (3, 9, 40)]))
    context = prefix + ids(12)
    return rows + build_rows([Unit(tuple(context + ids(k)), k) for k in (3, 5)], ShareMode.PREFIX, max_length)


def rows_check(
    model: PreTrainedModel,
    device: torch.device,
    pad_token_id: int,
    max_length: int,
    reference: PreTrainedModel | None = None,
) -> str | None:
    """Why batched rows attending alone do not give each row its bits alone on this model, dtype and device (module
    doc), or None. A model whose logits are not finite on the check's rows is not checked (said): the run's own rows
    then meet that error where it names their documents."""
    try:
        return _rows_check(model, device, pad_token_id, max_length, reference)
    except NonFiniteLogitsError:
        return "the check's rows gave non-finite logits, so row invariance could not be checked"


def _rows_check(
    model: PreTrainedModel,
    device: torch.device,
    pad_token_id: int,
    max_length: int,
    reference: PreTrainedModel | None,
) -> str | None:
    for which in (model, reference):
        why = None if which is None else why_not_alone(which)
        if why is not None:
            return why
    vocab = embedding_rows(model)
    cached = all(paths_of(m).cached_prefix is None for m in (model, reference) if m is not None)
    checks = [(check_rows(vocab, max_length), 0)]
    if cached:  # the run's batches continue their row group's cached prefix
        checks.append((cached_rows(vocab, max_length), CHECK_PREFIX))
    for rows, shared in checks:

        def scores(batch: Sequence, shared: int = shared) -> np.ndarray:
            out = score_batch(
                model,
                list(batch),
                device=device,
                pad_token_id=pad_token_id,
                reference=reference,
                shared=shared,
                rows_alone=True,
            )
            return out.stats

        if not rows:
            continue
        alone = np.concatenate([scores([r]) for r in rows])
        for order in (rows, rows[::-1][:3]):
            together = scores(order)
            expected = np.concatenate([alone[_unit_slice(rows, r)] for r in order])
            if together.shape != expected.shape or not np.array_equal(together, expected):
                moved = np.nanmax(np.abs(together - expected)) if together.shape == expected.shape else np.nan
                where = "the check's rows" if not shared else f"rows continuing a cached prefix of {shared} tokens"
                return (
                    f"on this device and dtype ({dtype_of(model)}) a row's scores move with its batch-mates even when "
                    f"it attends alone (by up to {float(moved):.3g} nats on {where})"
                )
    return None


def _unit_slice(rows: list[Row], row: Row) -> slice:
    """The units of ``row`` within the units of ``rows`` (in row order)."""
    start = 0
    for r in rows:
        if r is row:
            return slice(start, start + len(r.units))
        start += len(r.units)
    raise ValueError("internal error: a row outside the check's rows")


def merged(reasons: Sequence[str | None]) -> tuple[Invariance, str | None]:
    """Every rank's :func:`rows_check` answer (rank order) as the run's :class:`Invariance` and why rows go one at a
    time (the first rank's reason, named), the same on every rank."""
    for rank, why in enumerate(reasons):
        if why is not None:
            return Invariance.EACH_ROW, why if len(reasons) == 1 else f"{why} (rank {rank})"
    return Invariance.BATCHED, None
