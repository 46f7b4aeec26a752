"""Forward passes and exact log-probabilities for one batch of rows (each holding one or more units).

The model reads each row (:mod:`distperp_harness.planning.rows`; right-padded within the batch, causal attention keeps
padding from touching real positions; packed rows add a prefix-sharing mask and position ids, so each unit sees
exactly its own ``tokens[:-1]``), and only the last ``n_score`` positions of each unit are turned into logits — in
chunks of positions, through the output head, so no ``[batch, length, vocab]`` float32 log-softmax is held. Per
position: ``log p(target) = logit[target] - logsumexp(logits)`` with the log-sum-exp in float32 (or better)
and the subtraction and all sums in float64; the greedy flag is ``argmax == target``. With a reference model
the same positions also give KL(reference || model) (float64), the reference's log-prob and top-1 agreement.

Memory per chunk of logits (what :func:`chunk_bytes` counts and the memory estimate uses): the head's output in
the model dtype plus its float32 copy when that dtype is narrower; with a reference the same for the reference's
head, plus the KL's float64 work space, two buffers of half a chunk's rows each: one float64 per logit of the chunk
(:func:`~distperp_harness.run.scoring.engine.logprobs.kl_`). With a reference the chunk holds half the positions.

Results depend only on the batch's content, never on which process computes it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from distperp_harness.model.row_attention import attending_alone
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row, unit_rows
from distperp_harness.run.scoring.engine.kvcache import body_of, cache_argument, prefix_cache
from distperp_harness.run.scoring.engine.logprobs import (
    MIN_GEMM_ROWS,
    ReusedHead,
    at_least_float32,
    head_of_chunk,
    is_first_argmax,
    kl_,
    logsumexp_,
)
from distperp_harness.run.scoring.engine.masks import Packing as _Packing
from distperp_harness.run.scoring.engine.masks import flex_shapes
from distperp_harness.run.scoring.engine.support import ModelPaths, paths_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from typing_extensions import TypeIs

# Columns of the per-unit statistics table (float64), gathered across ranks as one tensor.
LL, GREEDY, N_TOKENS, REF_LL, TOP1 = range(5)
N_COLUMNS = 5

# Logits per chunk of scored positions. CPU: 64 MiB of float32, cache-friendly (measured, benchmarks/README.md).
# CUDA: 256 MiB, so a 128k vocabulary still gets ~500 positions per chunk (fewer, larger kernels).
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 26}


# Devices where reading a value back costs nothing (no queue to wait for): the greedy check may take shortcuts.
_HOST_DEVICE_TYPES = ("cpu",)


def chunk_elements(device_type: str, with_reference: bool = False) -> int:
    """Logits computed at once per chunk on a device of ``device_type`` (half as many with a reference: each
    position then also holds the reference's logits and the KL's float64 work space)."""
    return _CHUNK_ELEMENTS.get(device_type, _CHUNK_ELEMENTS["cpu"]) // (2 if with_reference else 1)


def _logit_bytes(dtype: torch.dtype) -> int:
    """Bytes per logit of a head computing in ``dtype``: its output, plus the float32 copy when narrower."""
    size = torch.empty(0, dtype=dtype).element_size()
    return size + (4 if size < 4 else 0)


def chunk_bytes(
    device_type: str,
    dtype: torch.dtype,
    reference_dtype: torch.dtype | None = None,
    *,
    positions: int | None = None,
    vocab: int | None = None,
) -> int:
    """Bytes the chunk loop of :func:`score_batch` holds at its peak, besides the features (module doc):
    ``elements * (logit bytes of the model [+ of the reference + 8 for the KL])``, with ``elements`` a whole
    chunk, or fewer when a batch scores only ``positions`` positions of a ``vocab``-sized vocabulary."""
    per_logit = _logit_bytes(dtype)
    if reference_dtype is not None:
        per_logit += _logit_bytes(reference_dtype) + 8
    elements = chunk_elements(device_type, reference_dtype is not None)
    if positions is not None and vocab:
        elements = min(elements, max(1, elements // vocab) * vocab, positions * vocab)
    return elements * per_logit


class NonFiniteLogitsError(ValueError):
    """Raised when a model produced NaN/inf logits; ``rows`` are the offending rows of the batch."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"non-finite (NaN or inf) logits in batch rows {rows}")
        self.rows = rows


@dataclass(frozen=True)
class BatchScores:
    """Scores of one batch: ``stats`` float64 ``[rows, N_COLUMNS]``; ``kl`` per-row float64 arrays or None."""

    stats: np.ndarray
    kl: list[np.ndarray] | None

    def kl_rows(self) -> list[np.ndarray]:
        """:attr:`kl` of scores computed with a reference, which always carry it."""
        if self.kl is None:
            raise ValueError("internal error: scores computed with a reference carry no KL arrays")
        return self.kl


def _features(  # noqa: PLR0913 - one forward's facts: model, paths, ids, scored places, chunking, masks, cache, rows
    model: PreTrainedModel,
    paths: ModelPaths,
    input_ids: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    chunk_rows: int,
    packing: "_Packing | None" = None,
    cache=None,
    alone: Sequence[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Per-position features at ``where`` (rows, columns) and the map from a chunk of at most ``chunk_rows`` features
    to float32+ logits. The logits a call returns may be overwritten by the next call (see :class:`ReusedHead`).
    ``paths``: what the model allows (:mod:`~distperp_harness.run.scoring.engine.support`): the head only at scored
    positions, with its output map, or the model's full logits; ``packing``: the attention masks and position ids of
    a batch with tree rows (None: plain causal rows); ``cache``: the key/value cache of the batch's shared prefix
    (:func:`~distperp_harness.run.scoring.engine.kvcache.prefix_cache`), which ``input_ids`` follow; ``alone``: each
    row's (queries, keys), its attention computed over its own keys alone
    (:func:`~distperp_harness.model.row_attention.attending_alone`; None: the batch's attention as the model does
    it)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    extra = packing.kwargs(model, paths.layout) if packing is not None else {}
    if cache is not None:
        extra[cache_argument(model)] = cache
        extra["use_cache"] = True
    else:
        extra["use_cache"] = False
    attending = contextlib.nullcontext() if alone is None else attending_alone(model, alone)
    if head is not None and paths.head_only is None:
        with attending:
            hidden = body_of(model)(input_ids=input_ids, **extra).last_hidden_state
        feats = hidden[where]
        mapping = paths.output_map
        if ReusedHead.applies(head, feats):
            reused = ReusedHead(head, max(MIN_GEMM_ROWS, min(chunk_rows, feats.shape[0])))
            return feats, reused if mapping.identity else (lambda chunk: mapping.apply_(reused(chunk)))
        return feats, lambda chunk: mapping.apply_(at_least_float32(head(chunk)))
    with attending:
        logits = model(input_ids=input_ids, **extra).logits
    return logits[where], at_least_float32


def _chunks(n: int, vocab: int, device_type: str = "cpu", with_reference: bool = False) -> list[tuple[int, int]]:
    step = max(1, chunk_elements(device_type, with_reference) // max(1, vocab))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _are_rows(batch: Sequence[Row] | Sequence[Unit]) -> TypeIs[Sequence[Row]]:
    """Whether ``batch`` holds rows (else units): a batch holds one kind, so its first item tells."""
    return bool(batch) and isinstance(batch[0], Row)


@torch.no_grad()
def score_batch(  # noqa: PLR0913 - keyword-only facts of one batch (reference, prefix, gathers, attention)
    model: PreTrainedModel,
    batch: Sequence[Row] | Sequence[Unit],
    *,
    device: torch.device,
    pad_token_id: int,
    reference: PreTrainedModel | None = None,
    shared: int = 0,
    between_forwards: Callable[[], None] | None = None,
    rows_alone: bool = False,
) -> BatchScores:
    """Score ``batch`` — rows (:mod:`distperp_harness.planning.rows`), or units (one row each) — as one right-padded
    batch; with ``rows_alone`` each row's attention runs over its own keys alone
    (:mod:`~distperp_harness.model.row_attention`: its scores then do not depend on its batch-mates where the matrix
    products are row-invariant, :mod:`~distperp_harness.run.scoring.engine.invariance`).

    Tree rows (two or more runs) run with the tree attention mask and explicit position ids
    (:mod:`~distperp_harness.run.scoring.engine.masks`; the caller makes sure the model takes them,
    :func:`~distperp_harness.run.scoring.engine.support.packed_rows_unsupported`); a batch of plain rows runs with no
    mask. ``shared`` > 0 (:func:`distperp_harness.planning.rows.shared_prefix` of the batch, or its row group's):
    the first ``shared`` tokens, equal in every row (one row or several), are computed once and every row continues
    from their key/value cache (:func:`forward_calls`: two forward calls, model then reference each time);
    ``between_forwards`` runs between the two (sharded weights re-gather there, so the batch makes the gathers of two
    plain batches). What each model allows is its recorded
    :class:`~distperp_harness.run.scoring.engine.support.ModelPaths` (:func:`~.support.paths_of`).

    Returns:
        ``BatchScores`` over the batch's units in row order, with ``stats[i] = (log-likelihood, greedy 0/1, n scored
        tokens, reference log-likelihood or 0, top-1 agreements or 0)`` and, with ``reference``, per-token KL arrays.

    Raises:
        NonFiniteLogitsError: if any scored position has NaN/inf logits (``rows`` index the batch's rows).
    """
    batch_rows = list(batch) if _are_rows(batch) else unit_rows(batch)
    units = [u for r in batch_rows for u in r.units]
    ids, rows, cols, targets, packing = _layout(batch_rows, pad_token_id, device, shared)

    n = len(targets)
    chunks = _chunks(n, _vocab_size(model), device.type, reference is not None)
    chunk_rows = max(b - a for a, b in chunks) if chunks else 1
    models = [m for m in (model, reference) if m is not None]
    model_paths = paths_of(model)
    alone = [(r.length - shared, r.length) for r in batch_rows] if rows_alone else None
    # Prefix forwards first (model, reference), then the rows (model, reference): the order of an idle rank's two
    # plain forwards, so the sharded weights' gathers match across a shard group.
    with flex_shapes(device, models):
        caches = (
            [prefix_cache(m, packing.prefix_ids, len(batch_rows)) for m in models]
            if packing is not None and packing.prefix_ids is not None
            else [None] * len(models)
        )
        if caches[0] is not None and between_forwards is not None:
            between_forwards()
        feats, to_logits = _features(model, model_paths, ids, (rows, cols), chunk_rows, packing, caches[0], alone)
        ref_features = (
            _features(reference, paths_of(reference), ids, (rows, cols), chunk_rows, packing, caches[1], alone)
            if reference is not None
            else None
        )
    del caches

    scores = position_scores(feats, to_logits, ref_features, targets, chunks, chunk_rows, reference, device)
    if n and not bool(scores.finite.all()):
        bad = (~scores.finite).nonzero().flatten()
        raise NonFiniteLogitsError(sorted({int(r) for r in rows[bad].tolist()}))
    return unit_table(units, scores)


@dataclass
class PositionScores:
    """Per scored position (float64 unless said): the log-probability of the target, whether it is the first
    argmax (bool), whether the logits were finite (bool); with a reference, its log-probability, KL(reference ||
    model) and top-1 agreement (bool), else None."""

    logprob: torch.Tensor
    greedy: torch.Tensor
    finite: torch.Tensor
    ref_logprob: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    top1: torch.Tensor | None = None


def position_scores(  # noqa: PLR0913 - the features of both models and how they are chunked
    feats: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor],
    ref_features: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None,
    targets: torch.Tensor,
    chunks: list[tuple[int, int]],
    chunk_rows: int,
    reference: PreTrainedModel | None,
    device: torch.device,
) -> PositionScores:
    """The scores of every position of ``feats`` (module doc), a chunk of logits at a time."""
    n = len(targets)
    logprob = torch.empty(n, dtype=torch.float64, device=device)
    greedy = torch.empty(n, dtype=torch.bool, device=device)
    finite = torch.empty(n, dtype=torch.bool, device=device)
    # On CUDA nothing in the loop waits for the GPU: the non-finite check is read once after it, and the greedy
    # check takes a plain argmax (the CPU's shortcut needs a data-dependent index, i.e. a sync per chunk).
    full_argmax = reference is not None or device.type not in _HOST_DEVICE_TYPES
    ref_logprob = kl = top1 = None
    if reference is not None:
        ref_logprob = torch.empty(n, dtype=torch.float64, device=device)
        kl = torch.empty(n, dtype=torch.float64, device=device)
        top1 = torch.empty(n, dtype=torch.bool, device=device)
        block = (chunk_rows + 1) // 2  # two float64 buffers of half a chunk: one float64 per logit
        work_shape = (block, _vocab_size(reference))
        work = (
            torch.empty(work_shape, dtype=torch.float64, device=device),
            torch.empty(work_shape, dtype=torch.float64, device=device),
        )
    for a, b in chunks:
        logits = head_of_chunk(
            to_logits, feats[a:b]
        )  # this loop owns it until the next chunk: logsumexp_ overwrites it
        tgt = targets[a:b].unsqueeze(-1)
        top = logits.amax(dim=-1)
        finite[a:b] = torch.isfinite(top)  # NaN propagates to the max; +-inf maxima make the lse non-finite
        target_logit = logits.gather(-1, tgt).squeeze(-1)
        argmax = logits.argmax(dim=-1) if full_argmax else None
        greedy[a:b] = is_first_argmax(logits, target_logit, top, targets[a:b], argmax)
        if ref_features is not None and kl is not None and top1 is not None and ref_logprob is not None:
            ref_feats, ref_to_logits = ref_features
            ref_logits = head_of_chunk(ref_to_logits, ref_feats[a:b])
            kl[a:b] = kl_(ref_logits, logits, work)
            top1[a:b] = ref_logits.argmax(dim=-1) == argmax
            # Same recipe as the model's log-prob (float32 log-sum-exp, float64 difference): comparable sums.
            # In place, last: it overwrites ref_logits (bit for bit torch.logsumexp, see logsumexp_).
            ref_target = ref_logits.gather(-1, tgt).squeeze(-1).double()
            ref_logprob[a:b] = ref_target - logsumexp_(ref_logits, ref_logits.amax(dim=-1)).double()
        logprob[a:b] = target_logit.double() - logsumexp_(logits, top).double()
    return PositionScores(logprob, greedy, finite, ref_logprob, kl, top1)


def unit_table(units: Sequence[Unit], scores: PositionScores) -> BatchScores:
    """The units' statistics from their positions' scores (the units' scored positions, in order)."""
    counts = [u.n_score for u in units]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    stats = np.zeros((len(units), N_COLUMNS), dtype=np.float64)
    stats[:, LL] = np.add.reduceat(scores.logprob.cpu().numpy(), offsets)
    greedy_np = scores.greedy.cpu().numpy()
    stats[:, GREEDY] = [float(greedy_np[o : o + c].all()) for o, c in zip(offsets, counts)]
    stats[:, N_TOKENS] = counts
    kl_rows = None
    if scores.ref_logprob is not None and scores.top1 is not None and scores.kl is not None:
        stats[:, REF_LL] = np.add.reduceat(scores.ref_logprob.cpu().numpy(), offsets)
        stats[:, TOP1] = np.add.reduceat(scores.top1.cpu().numpy().astype(np.float64), offsets)
        kl_np = scores.kl.cpu().numpy()
        kl_rows = [kl_np[o : o + c].copy() for o, c in zip(offsets, counts)]
    return BatchScores(stats, kl_rows)


def _vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "out_features", None):
        return int(head.out_features)
    return int(getattr(getattr(model, "config", None), "vocab_size", 32000))


def _layout(batch_rows: Sequence[Row], pad_token_id: int, device: torch.device, shared: int = 0):
    """``(input ids [rows, padded - shared], row and column of every scored position, its target, packing or
    None)``; with ``shared`` > 0 the first ``shared`` columns (equal in every row) go to ``packing.prefix_ids``."""
    # at least MIN_GEMM_ROWS positions per forward (right padding; causal attention keeps it from real positions)
    padded = max(max(r.length for r in batch_rows), shared - (-MIN_GEMM_ROWS // len(batch_rows)))
    ids = torch.full((len(batch_rows), padded), pad_token_id, dtype=torch.long)
    row_list: list[int] = []
    col_list: list[int] = []
    target_list: list[int] = []
    for i, row in enumerate(batch_rows):
        ids[i, : row.length] = torch.tensor(row.tokens(), dtype=torch.long)
        for k, unit in enumerate(row.units):
            row_list.extend([i] * unit.n_score)
            col_list.extend(row.columns(k))
            target_list.extend(unit.tokens[-unit.n_score :])
    if shared:
        if (ids[:, :shared] != ids[:1, :shared]).any() or min(col_list) < shared:
            raise ValueError(f"internal error: these rows do not share their first {shared} tokens unscored")
        col_list = [c - shared for c in col_list]
    packing = _Packing.of(batch_rows, padded, device, shared) if shared or any(r.packed for r in batch_rows) else None
    return (
        ids[:, shared:].to(device),
        torch.tensor(row_list, device=device),
        torch.tensor(col_list, device=device),
        torch.tensor(target_list, device=device),
        packing,
    )


def forward_calls(shared: int, rows: int = 1, row_at_a_time: bool = False) -> int:
    """Forward calls of each model for a batch of ``rows`` rows: one per row when they go one at a time
    (:func:`score_each_row`), else two when they share ``shared`` tokens computed once, else one."""
    if row_at_a_time:
        return rows
    return 2 if shared else 1


def score_each_row(
    model: PreTrainedModel,
    batch: Sequence[Row] | Sequence[Unit],
    *,
    device: torch.device,
    pad_token_id: int,
    reference: PreTrainedModel | None = None,
    between_forwards: Callable[[], None] | None = None,
    rows_alone: bool = False,
) -> BatchScores:
    """:func:`score_batch` of each row of ``batch`` alone, in row order: every forward, head chunk and reduction then
    has shapes set by the row itself, so a row's scores do not depend on the batch it was planned in (its size,
    its neighbours' lengths, the device's memory). ``between_forwards`` runs between two rows' forwards;
    ``rows_alone`` as :func:`score_batch`'s (the same attention calls as a batch of rows attending alone).

    Returns the :class:`BatchScores` of :func:`score_batch` over the same rows; a row with non-finite logits raises
    :class:`NonFiniteLogitsError` with its index in ``batch``."""
    batch_rows = list(batch) if _are_rows(batch) else unit_rows(batch)
    parts: list[BatchScores] = []
    for i, row in enumerate(batch_rows):
        if i and between_forwards is not None:
            between_forwards()
        try:
            parts.append(
                score_batch(
                    model, [row], device=device, pad_token_id=pad_token_id, reference=reference, rows_alone=rows_alone
                )
            )
        except NonFiniteLogitsError as exc:
            raise NonFiniteLogitsError([i]) from exc
    if not parts:
        return BatchScores(np.zeros((0, N_COLUMNS), dtype=np.float64), None if reference is None else [])
    stats = np.concatenate([p.stats for p in parts])
    return BatchScores(stats, None if reference is None else [k for p in parts for k in p.kl_rows()])
