"""Forward passes and exact log-probabilities for one batch of units.

For each unit the model reads ``tokens[:-1]`` (right-padded within the batch; causal attention keeps padding
from touching real positions) and only the last ``n_score`` positions are turned into logits — in chunks of
positions, through the output head, so no ``[batch, length, vocab]`` float32 log-softmax is ever held. Per
position: ``log p(target) = logit[target] - logsumexp(logits)`` with the log-sum-exp in float32 (or better)
and the subtraction and all sums in float64; the greedy flag is ``argmax == target``. With a reference model
the same positions also give KL(reference || model) (float64), the reference's log-prob and top-1 agreement.

Results depend only on the batch's content, never on which process computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from distperp_harness.requests import Unit

# Columns of the per-unit statistics table (float64), gathered across ranks as one tensor.
LL, GREEDY, N_TOKENS, REF_LL, TOP1 = range(5)
N_COLUMNS = 5

# Model types whose logits are exactly ``get_output_embeddings()(base_model(...).last_hidden_state)``; for
# them only scored positions go through the head. Others (soft-capping, logit scaling, ...) use full logits.
_PLAIN_HEAD_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "olmo",
    "olmo2", "gpt2", "gpt_neox", "gptj", "stablelm", "starcoder2", "smollm3", "ministral",
})
_CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in float32


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


def _features(model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
              ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Per-position features at ``(rows, cols)`` and the map from a chunk of features to float32+ logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if head is not None and model_type in _PLAIN_HEAD_TYPES:
        hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return hidden[rows, cols], lambda chunk: _at_least_float32(head(chunk))
    logits = model(input_ids=input_ids, use_cache=False).logits
    return logits[rows, cols], _at_least_float32


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _chunks(n: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


@torch.no_grad()
def score_batch(model: torch.nn.Module, units: Sequence[Unit], *, device: torch.device, pad_token_id: int,
                reference: torch.nn.Module | None = None) -> BatchScores:
    """Score ``units`` as one right-padded batch.

    Returns:
        ``BatchScores`` with ``stats[i] = (log-likelihood, greedy 0/1, n scored tokens, reference
        log-likelihood or 0, top-1 agreements or 0)`` and, with ``reference``, per-token KL arrays.

    Raises:
        NonFiniteLogitsError: if any scored position has NaN/inf logits.
    """
    lengths = [u.input_length for u in units]
    padded = max(lengths)
    ids = torch.full((len(units), padded), pad_token_id, dtype=torch.long)
    row_list, col_list, target_list = [], [], []
    for i, unit in enumerate(units):
        ids[i, : lengths[i]] = torch.tensor(unit.tokens[:-1], dtype=torch.long)
        first = lengths[i] - unit.n_score
        row_list.extend([i] * unit.n_score)
        col_list.extend(range(first, lengths[i]))
        target_list.extend(unit.tokens[first + 1:])
    ids = ids.to(device)
    rows = torch.tensor(row_list, device=device)
    cols = torch.tensor(col_list, device=device)
    targets = torch.tensor(target_list, device=device)

    feats, to_logits = _features(model, ids, rows, cols)
    ref_feats, ref_to_logits = _features(reference, ids, rows, cols) if reference is not None else (None, None)

    n = len(target_list)
    logprob = torch.empty(n, dtype=torch.float64, device=device)
    greedy = torch.empty(n, dtype=torch.bool, device=device)
    if reference is not None:
        ref_logprob = torch.empty(n, dtype=torch.float64, device=device)
        kl = torch.empty(n, dtype=torch.float64, device=device)
        top1 = torch.empty(n, dtype=torch.bool, device=device)
    for a, b in _chunks(n, _vocab_size(model)):
        logits = to_logits(feats[a:b])
        tgt = targets[a:b].unsqueeze(-1)
        lse = torch.logsumexp(logits, dim=-1)
        if not torch.isfinite(lse).all():
            bad = (~torch.isfinite(lse)).nonzero().flatten() + a
            raise NonFiniteLogitsError(sorted({int(r) for r in rows[bad].tolist()}))
        logprob[a:b] = logits.gather(-1, tgt).squeeze(-1).double() - lse.double()
        argmax = logits.argmax(dim=-1)
        greedy[a:b] = argmax == targets[a:b]
        if reference is not None:
            ref_logits = ref_to_logits(ref_feats[a:b])
            lp = torch.log_softmax(logits.double(), dim=-1)
            ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
            # Same recipe as the model's log-prob (float32 log-sum-exp, float64 difference): comparable sums.
            ref_logprob[a:b] = ref_logits.gather(-1, tgt).squeeze(-1).double() - torch.logsumexp(
                ref_logits, dim=-1).double()
            kl[a:b] = (ref_lp.exp() * (ref_lp - lp)).sum(dim=-1)
            top1[a:b] = ref_logits.argmax(dim=-1) == argmax

    counts = [u.n_score for u in units]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    stats = np.zeros((len(units), N_COLUMNS), dtype=np.float64)
    stats[:, LL] = np.add.reduceat(logprob.cpu().numpy(), offsets)
    greedy_np = greedy.cpu().numpy()
    stats[:, GREEDY] = [float(greedy_np[o:o + c].all()) for o, c in zip(offsets, counts)]
    stats[:, N_TOKENS] = counts
    kl_rows = None
    if reference is not None:
        stats[:, REF_LL] = np.add.reduceat(ref_logprob.cpu().numpy(), offsets)
        stats[:, TOP1] = np.add.reduceat(top1.cpu().numpy().astype(np.float64), offsets)
        kl_np = kl.cpu().numpy()
        kl_rows = [kl_np[o:o + c].copy() for o, c in zip(offsets, counts)]
    return BatchScores(stats, kl_rows)


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "out_features", None):
        return int(head.out_features)
    return int(getattr(getattr(model, "config", None), "vocab_size", 32000))
