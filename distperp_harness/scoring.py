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
# Logits per chunk of scored positions. CPU: 64 MiB of float32, cache-friendly (measured, benchmarks/README.md).
# CUDA: 256 MiB, so a 128k vocabulary still gets ~500 positions per chunk (fewer, larger kernels).
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 26}


# Devices where reading a value back costs nothing (no queue to wait for): the greedy check may take shortcuts.
_HOST_DEVICE_TYPES = ("cpu",)


def chunk_elements(device_type: str) -> int:
    """Logits computed at once per chunk on a device of ``device_type``."""
    return _CHUNK_ELEMENTS.get(device_type, _CHUNK_ELEMENTS["cpu"])


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


def _features(model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              chunk_rows: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Per-position features at ``(rows, cols)`` and the map from a chunk of at most ``chunk_rows`` features to
    float32+ logits. The logits a call returns may be overwritten by the next call (see :class:`_ReusedHead`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if head is not None and model_type in _PLAIN_HEAD_TYPES:
        hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        feats = hidden[rows, cols]
        if _ReusedHead.applies(head, feats):
            return feats, _ReusedHead(head, min(chunk_rows, max(1, feats.shape[0])))
        return feats, lambda chunk: _at_least_float32(head(chunk))
    logits = model(input_ids=input_ids, use_cache=False).logits
    return logits[rows, cols], _at_least_float32


class _ReusedHead:
    """``head(chunk)`` for a plain ``nn.Linear`` head, written into one logits buffer that every chunk of a batch
    reuses (as float32 when the model computes in a narrower dtype).

    Same kernels and bits as ``nn.Linear`` (``mm`` / ``addmm`` with the transposed weight), without allocating
    fresh ``[chunk, vocab]`` memory per chunk: on CPU a new chunk-sized allocation is fresh pages from the kernel,
    and faulting them in costs about a third of the head's matmul (measured; see ``benchmarks/README.md``).
    """

    def __init__(self, head: torch.nn.Linear, rows: int) -> None:
        weight = head.weight
        self.weight_t = weight.t()
        self.bias = head.bias
        self.out = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        self.wide = (None if weight.dtype in (torch.float32, torch.float64)
                     else torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device))

    @staticmethod
    def applies(head: torch.nn.Module, feats: torch.Tensor) -> bool:
        """True for an exact ``nn.Linear`` with plain dense floating-point parameters of the features' dtype."""
        params = [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])
        return (type(head) is torch.nn.Linear and feats.dim() == 2
                and all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.layout == torch.strided
                        and p.dtype == feats.dtype and p.device == feats.device and p.is_floating_point()
                        for p in params))

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        out = self.out[: chunk.shape[0]]
        if self.bias is None:
            torch.mm(chunk, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, chunk, self.weight_t, out=out)
        return out if self.wide is None else self.wide[: chunk.shape[0]].copy_(out)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _logsumexp_(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits, -1)`` (bit for bit, for rows with a finite max ``top``), computed in place.

    The same operations as ATen's composite ``logsumexp`` (``log(sum(exp(x - max))) + max``) with the
    subtraction and exponential done in ``logits``' own storage: no ``[positions, vocab]`` temporary, and ``top``
    (``logits.amax(-1)``) is shared with the greedy check. ``logits`` is overwritten.
    """
    return logits.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1).log_().add_(top)


def _is_first_argmax(logits: torch.Tensor, target_logit: torch.Tensor, top: torch.Tensor, targets: torch.Tensor,
                     argmax: torch.Tensor | None) -> torch.Tensor:
    """``logits.argmax(-1) == targets`` (first index of the maximum, as lm-eval's greedy check), per row.

    Without a precomputed ``argmax``, only rows whose target logit equals the row maximum ``top`` can be greedy;
    the argmax runs on those rows alone (a max-with-index pass costs about four plain max passes on CPU).
    """
    if argmax is not None:
        return argmax == targets
    greedy = torch.zeros_like(targets, dtype=torch.bool)
    hit = (target_logit == top).nonzero().flatten()
    if hit.numel():
        greedy[hit] = logits.index_select(0, hit).argmax(dim=-1) == targets[hit]
    return greedy


def _chunks(n: int, vocab: int, device_type: str = "cpu") -> list[tuple[int, int]]:
    step = max(1, chunk_elements(device_type) // max(1, vocab))
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

    n = len(target_list)
    chunks = _chunks(n, _vocab_size(model), device.type)
    chunk_rows = max(b - a for a, b in chunks) if chunks else 1
    feats, to_logits = _features(model, ids, rows, cols, chunk_rows)
    ref_feats, ref_to_logits = (_features(reference, ids, rows, cols, chunk_rows) if reference is not None
                                else (None, None))

    logprob = torch.empty(n, dtype=torch.float64, device=device)
    greedy = torch.empty(n, dtype=torch.bool, device=device)
    finite = torch.empty(n, dtype=torch.bool, device=device)
    # On CUDA nothing in the loop waits for the GPU: the non-finite check is read once after it, and the greedy
    # check takes a plain argmax (the CPU's shortcut needs a data-dependent index, i.e. a sync per chunk).
    full_argmax = reference is not None or device.type not in _HOST_DEVICE_TYPES
    if reference is not None:
        ref_logprob = torch.empty(n, dtype=torch.float64, device=device)
        kl = torch.empty(n, dtype=torch.float64, device=device)
        top1 = torch.empty(n, dtype=torch.bool, device=device)
    for a, b in chunks:
        logits = to_logits(feats[a:b])  # this loop owns it until the next chunk: _logsumexp_ overwrites it
        tgt = targets[a:b].unsqueeze(-1)
        top = logits.amax(dim=-1)
        finite[a:b] = torch.isfinite(top)  # NaN propagates to the max; +-inf maxima make the lse non-finite
        target_logit = logits.gather(-1, tgt).squeeze(-1)
        argmax = logits.argmax(dim=-1) if full_argmax else None
        greedy[a:b] = _is_first_argmax(logits, target_logit, top, targets[a:b], argmax)
        if reference is not None:
            ref_logits = ref_to_logits(ref_feats[a:b])
            lp = torch.log_softmax(logits.double(), dim=-1)
            ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
            # Same recipe as the model's log-prob (float32 log-sum-exp, float64 difference): comparable sums.
            ref_logprob[a:b] = ref_logits.gather(-1, tgt).squeeze(-1).double() - torch.logsumexp(
                ref_logits, dim=-1).double()
            kl[a:b] = (ref_lp.exp() * (ref_lp - lp)).sum(dim=-1)
            top1[a:b] = ref_logits.argmax(dim=-1) == argmax
        logprob[a:b] = target_logit.double() - _logsumexp_(logits, top).double()
    if n and not bool(finite.all()):
        bad = (~finite).nonzero().flatten()
        raise NonFiniteLogitsError(sorted({int(r) for r in rows[bad].tolist()}))

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
