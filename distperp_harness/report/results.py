"""The value distperp returns for a scored request: a ``float`` that carries its scoring statistics.

lm-eval treats a log-likelihood as a plain float: filters pass it through, the cache and ``gather_object``
pickle it, the JSON logger writes its float value. :class:`Score` *is* that float (the log-likelihood in
nats, summed in float64) and also carries what perplexity and quantization metrics need, so one task YAML
works with ``--model distperp`` (full statistics) and ``--model hf`` (a plain float: statistics absent).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Score(float):
    """Log-likelihood (nats, float64) of one request, plus scoring statistics.

    Attributes:
        n_tokens: number of scored (predicted) tokens.
        ref_loglikelihood: log-likelihood of the same tokens under the reference model, or ``None``.
        kl: per-token KL divergence KL(reference || model) in nats, float64 array of length ``n_tokens``,
            in token order; ``None`` without a reference model.
        top1_agree: number of scored positions where the model's and the reference's argmax agree, or ``None``.
    """

    n_tokens: int
    ref_loglikelihood: float | None
    kl: np.ndarray | None
    top1_agree: int | None

    def __new__(
        cls,
        value: float,
        n_tokens: int,
        ref_loglikelihood: float | None = None,
        kl: np.ndarray | None = None,
        top1_agree: int | None = None,
    ) -> "Score":
        self = super().__new__(cls, value)
        self.n_tokens = int(n_tokens)
        self.ref_loglikelihood = None if ref_loglikelihood is None else float(ref_loglikelihood)
        self.kl = None if kl is None else np.asarray(kl, dtype=np.float64)
        self.top1_agree = None if top1_agree is None else int(top1_agree)
        return self

    @classmethod
    def of(cls, result: Any) -> "Score":
        """The score of one request's result (``loglikelihood``, ``n_tokens``, ``ref_loglikelihood``, ``kl``,
        ``top1_agree``: :class:`~distperp_harness.run.scoring.pipeline.RequestResult`'s fields)."""
        return cls(result.loglikelihood, result.n_tokens, result.ref_loglikelihood, result.kl, result.top1_agree)

    @property
    def has_reference(self) -> bool:
        return self.kl is not None

    def __reduce__(self) -> tuple[Any, ...]:
        return (Score, (float(self), self.n_tokens, self.ref_loglikelihood, self.kl, self.top1_agree))

    # repr/str stay float's, so logged samples show the plain number at full precision.
    __repr__ = float.__repr__
    __str__ = float.__repr__


def n_tokens_of(value: Any) -> int | None:
    """Scored-token count carried by ``value`` (a :class:`Score`), or ``None`` for a plain float (``hf``)."""
    return getattr(value, "n_tokens", None)
