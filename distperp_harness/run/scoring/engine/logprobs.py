"""Exact per-position log-probabilities from a chunk of logits: the head written into a reused buffer, an in-place
log-sum-exp equal bit for bit to ``torch.logsumexp``, the greedy check, and KL(reference || model) in float64.

Each function works on one chunk of ``[positions, vocab]`` logits and overwrites what its docstring says it
overwrites; none allocates a ``[positions, vocab]`` temporary beyond the buffers it is given.
"""

from __future__ import annotations

import torch

from distperp_harness.model.row_products import MIN_ROWS

MIN_GEMM_ROWS = MIN_ROWS
"""Fewest rows a scoring matrix product is given (:data:`~distperp_harness.model.row_products.MIN_ROWS`: below it,
CPU BLAS's sums depend on the number of rows and threads). Shorter inputs are padded with zero rows (or, for a
batch, pad tokens)."""


def head_of_chunk(to_logits, chunk: torch.Tensor) -> torch.Tensor:
    """``to_logits(chunk)``, with ``chunk`` padded to :data:`MIN_GEMM_ROWS` rows by zeros first when shorter (the
    padding's logits are dropped)."""
    n = chunk.shape[0]
    if n >= MIN_GEMM_ROWS:
        return to_logits(chunk)
    return to_logits(torch.cat([chunk, chunk.new_zeros(MIN_GEMM_ROWS - n, *chunk.shape[1:])]))[:n]


class ReusedHead:
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
        self.wide = (
            None
            if weight.dtype in (torch.float32, torch.float64)
            else torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device)
        )

    @staticmethod
    def applies(head: torch.nn.Module, feats: torch.Tensor) -> bool:
        """True for an exact ``nn.Linear`` with plain dense floating-point parameters of the features' dtype."""
        params = [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])
        return (
            type(head) is torch.nn.Linear
            and feats.dim() == 2
            and all(
                (type(p) is torch.Tensor or type(p) is torch.nn.Parameter)
                and p.layout == torch.strided
                and p.dtype == feats.dtype
                and p.device == feats.device
                and p.is_floating_point()
                for p in params
            )
        )

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        out = self.out[: chunk.shape[0]]
        if self.bias is None:
            torch.mm(chunk, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, chunk, self.weight_t, out=out)
        return out if self.wide is None else self.wide[: chunk.shape[0]].copy_(out)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def logsumexp_(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits, -1)`` (bit for bit, for rows with a finite max ``top``), computed in place.

    The same operations as ATen's composite ``logsumexp`` (``log(sum(exp(x - max))) + max``) with the
    subtraction and exponential done in ``logits``' own storage: no ``[positions, vocab]`` temporary, and ``top``
    (``logits.amax(-1)``) is shared with the greedy check. ``logits`` is overwritten.
    """
    return logits.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1).log_().add_(top)


def is_first_argmax(
    logits: torch.Tensor,
    target_logit: torch.Tensor,
    top: torch.Tensor,
    targets: torch.Tensor,
    argmax: torch.Tensor | None,
) -> torch.Tensor:
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


def lse64_(x: torch.Tensor) -> torch.Tensor:
    """Float64 log-sum-exp of each row of the float64 ``x``, computed in place (``x`` is overwritten)."""
    top = x.amax(dim=-1, keepdim=True)
    return x.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


def kl_(ref_logits: torch.Tensor, logits: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """KL(reference || model) per row, float64: ``E_ref[r - m] + lse(m) - lse(r)`` with ``r``, ``m`` the rows'
    logits, every step in float64. ``work``: two float64 buffers of ``[block, vocab]``; rows go through in blocks
    of ``block``, so the KL needs no memory beyond them (``work`` is overwritten)."""
    a_buf, b_buf = work
    n, step = ref_logits.shape[0], a_buf.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=ref_logits.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        a, b = a_buf[: j - i], b_buf[: j - i]
        lse_m = lse64_(b.copy_(logits[i:j]))
        top_r = a.copy_(ref_logits[i:j]).amax(dim=-1, keepdim=True)
        weights = a.sub_(top_r).exp_()  # exp(r - max r): the reference's probabilities times its partition sum
        total = weights.sum(dim=-1)
        lse_r = total.log() + top_r.squeeze(-1)  # as lse64_ does it: a model against itself gives exactly 0
        mean_r = torch.bmm(weights.unsqueeze(1), b.copy_(ref_logits[i:j]).unsqueeze(2)).view(-1)
        mean_m = torch.bmm(weights.unsqueeze(1), b.copy_(logits[i:j]).unsqueeze(2)).view(-1)
        out[i:j] = (mean_r - mean_m) / total + lse_m - lse_r
    return out
