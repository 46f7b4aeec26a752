"""Perplexity and KL-divergence aggregations over documents, with standard errors.

Pure float64 math on per-document items (what a task's ``process_results`` returns for one document) plus
one small, isolated hook that lets lm-eval print our standard errors (:func:`install_lm_eval_stderr_hook`).

**Estimator.** Every mean-per-unit metric here is a *ratio of sums over documents*, R = Σaᵢ / Σbᵢ — e.g. the
mean negative log-likelihood per token, aᵢ = −llᵢ and bᵢ = tokensᵢ. Documents are the sampling unit; tokens
inside a document are not independent. The standard error is the linearization (delta-method) estimator of a
ratio (Cochran, *Sampling Techniques*, §6.4, with the n/(n−1) small-sample factor):

    var(R) ≈ n/(n−1) · Σ (aᵢ − R·bᵢ)² / (Σbᵢ)²

and is propagated through the final transform with the delta method: se(exp R) = exp(R)·se(R) for a perplexity,
se(R/ln 2) = se(R)/ln 2 for bits per byte. Sums use :func:`math.fsum` (exactly rounded), so every value is
independent of the order in which documents arrive — i.e. of how many processes scored them.

**Items** (one per document) and values:

- :func:`weighted_perplexity` — ``(loglikelihood, count)`` → exp(−Σll / Σcount): token, word, byte perplexity.
- :func:`bits_per_byte` — ``(loglikelihood, n_bytes)`` → −Σll / Σbytes / ln 2.
- :func:`ratio_mean` — ``(numerator, n_tokens)`` → Σnum / Σn: mean KL per token, top-1 agreement rate.
- :func:`ln_ppl_ratio` — ``(ll, ref_ll, n_tokens)`` → Σ(ref_ll − ll) / Σn = ln(PPL / PPL_ref).
- :func:`percentile_99` — 1-d array of per-token values → 99th percentile of all of them (linear interpolation).
- :func:`maximum` — float or ``None`` → the largest.
- :func:`total` — int → the sum (scored tokens).

A count of ``None`` means the model returned a plain float (``--model hf``): token-level values are unknown,
and the aggregation returns the string ``"N/A"`` (what lm-eval prints for a missing standard error) after one
warning per process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

NOT_AVAILABLE = "N/A"
LN2 = math.log(2.0)

_WARNED_NO_TOKENS = False
_NO_TOKENS_MESSAGE = (
    "distperp: the model returned plain floats without token counts (e.g. `--model hf`), so token_perplexity "
    "and n_tokens are reported as N/A; word_perplexity, byte_perplexity and bits_per_byte are unaffected. "
    "Use `--model distperp` for token-level metrics."
)


def _warn_no_tokens() -> None:
    global _WARNED_NO_TOKENS
    if not _WARNED_NO_TOKENS:
        _WARNED_NO_TOKENS = True
        logger.warning(_NO_TOKENS_MESSAGE)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------------------------------------------
# The ratio estimator
# ---------------------------------------------------------------------------------------------------------------


def ratio_and_stderr(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float]:
    """R = Σaᵢ / Σbᵢ over documents and its delta-method standard error.

    Args:
        numerators: aᵢ, one per document.
        denominators: bᵢ, one per document (token, word or byte counts); Σbᵢ must be positive.

    Returns:
        ``(R, se)`` with se = sqrt(n/(n−1) · Σ(aᵢ − R·bᵢ)² / (Σbᵢ)²); se is NaN for fewer than two documents.
    """
    a = np.asarray(numerators, dtype=np.float64)
    b = np.asarray(denominators, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"numerators and denominators must be 1-d and equally long, got {a.shape} and {b.shape}")
    total_b = math.fsum(b)
    if not total_b > 0:
        raise ValueError(f"the denominators must sum to a positive number, got {total_b}")
    ratio = math.fsum(a) / total_b
    n = a.size
    if n < 2:
        return ratio, math.nan
    residuals = a - ratio * b
    variance = n / (n - 1) * math.fsum(residuals * residuals) / (total_b * total_b)
    return ratio, math.sqrt(variance)


def _columns(items: Sequence[Sequence[Any]], width: int) -> list[list[Any]] | None:
    """Transpose ``items`` (tuples of ``width``); ``None`` when any count (last field) is ``None``."""
    columns: list[list[Any]] = [[] for _ in range(width)]
    for item in items:
        if len(item) != width:
            raise ValueError(f"expected items of {width} fields, got {item!r}")
        if item[-1] is None:
            return None
        for column, value in zip(columns, item):
            column.append(value)
    return columns


def with_stderr(stderr_fn: Callable[[Sequence[Any]], Any]) -> Callable[[Callable], Callable]:
    """Attach ``stderr_fn`` to an aggregation as ``.distperp_stderr`` (read by :func:`install_lm_eval_stderr_hook`)."""

    def attach(aggregation: Callable) -> Callable:
        setattr(aggregation, "distperp_stderr", stderr_fn)  # noqa: B010 - an attribute of a function object
        return aggregation

    return attach


# ---------------------------------------------------------------------------------------------------------------
# Perplexities
# ---------------------------------------------------------------------------------------------------------------


def _nll_ratio(items: Sequence[tuple[float, int | None]]) -> tuple[float, float] | None:
    columns = _columns(items, 2)
    if columns is None:
        _warn_no_tokens()
        return None
    lls, counts = columns
    return ratio_and_stderr([-float(x) for x in lls], counts)


def weighted_perplexity_stderr(items: Sequence[tuple[float, int | None]]) -> float | str:
    """Delta-method stderr of :func:`weighted_perplexity`: exp(R)·se(R)."""
    estimate = _nll_ratio(items)
    if estimate is None:
        return NOT_AVAILABLE
    ratio, se = estimate
    return _exp(ratio) * se


@with_stderr(weighted_perplexity_stderr)
def weighted_perplexity(items: Sequence[tuple[float, int | None]]) -> float | str:
    """exp(−Σllᵢ / Σcountᵢ) over items ``(loglikelihood, count)``; ``"N/A"`` when a count is ``None``."""
    estimate = _nll_ratio(items)
    return NOT_AVAILABLE if estimate is None else _exp(estimate[0])


def bits_per_byte_stderr(items: Sequence[tuple[float, int]]) -> float | str:
    """Stderr of :func:`bits_per_byte`: se(R) / ln 2."""
    estimate = _nll_ratio(items)
    return NOT_AVAILABLE if estimate is None else estimate[1] / LN2


@with_stderr(bits_per_byte_stderr)
def bits_per_byte(items: Sequence[tuple[float, int]]) -> float | str:
    """−Σllᵢ / Σbytesᵢ / ln 2 over items ``(loglikelihood, n_bytes)``."""
    estimate = _nll_ratio(items)
    return NOT_AVAILABLE if estimate is None else estimate[0] / LN2


# ---------------------------------------------------------------------------------------------------------------
# Per-token means (KL divergence, top-1 agreement) and ln(PPL / PPL_ref)
# ---------------------------------------------------------------------------------------------------------------


def _plain_ratio(items: Sequence[tuple[float, int]]) -> tuple[float, float]:
    columns = _columns(items, 2)
    if columns is None:
        raise ValueError("ratio_mean items need a token count, got None")
    return ratio_and_stderr(*columns)


def ratio_mean_stderr(items: Sequence[tuple[float, int]]) -> float:
    """Delta-method stderr of :func:`ratio_mean`."""
    return _plain_ratio(items)[1]


@with_stderr(ratio_mean_stderr)
def ratio_mean(items: Sequence[tuple[float, int]]) -> float:
    """Σnumᵢ / Σnᵢ over items ``(numerator, n_tokens)``: a per-token mean pooled over documents."""
    return _plain_ratio(items)[0]


def _log_ratio(items: Sequence[tuple[float, float, int]]) -> tuple[float, float]:
    columns = _columns(items, 3)
    if columns is None:
        raise ValueError("ln_ppl_ratio items need a token count, got None")
    lls, ref_lls, counts = columns
    return ratio_and_stderr([float(r) - float(x) for x, r in zip(lls, ref_lls)], counts)


def ln_ppl_ratio_stderr(items: Sequence[tuple[float, float, int]]) -> float:
    """Paired delta-method stderr of :func:`ln_ppl_ratio` (aᵢ = ref_llᵢ − llᵢ, bᵢ = nᵢ)."""
    return _log_ratio(items)[1]


@with_stderr(ln_ppl_ratio_stderr)
def ln_ppl_ratio(items: Sequence[tuple[float, float, int]]) -> float:
    """ln(PPL / PPL_ref) = Σ(ref_llᵢ − llᵢ) / Σnᵢ over items ``(ll, ref_ll, n_tokens)``."""
    return _log_ratio(items)[0]


# ---------------------------------------------------------------------------------------------------------------
# Order statistics and counts (no standard error: lm-eval prints "N/A")
# ---------------------------------------------------------------------------------------------------------------


def percentile_99(items: Sequence[np.ndarray]) -> float:
    """99th percentile (numpy's default linear interpolation) of all values of all items; NaN if none."""
    arrays = [np.asarray(x, dtype=np.float64).ravel() for x in items]
    values = np.concatenate(arrays) if arrays else np.empty(0)
    return float(np.percentile(values, 99)) if values.size else math.nan


def maximum(items: Sequence[float | None]) -> float:
    """Largest non-``None`` item; NaN if none."""
    values = [float(x) for x in items if x is not None]
    return max(values) if values else math.nan


def total(items: Sequence[int | None]) -> int | str:
    """Sum of integer items (scored tokens); ``"N/A"`` when any is ``None``."""
    if any(x is None for x in items):
        _warn_no_tokens()
        return NOT_AVAILABLE
    return sum(int(x) for x in items if x is not None)


# ---------------------------------------------------------------------------------------------------------------
# lm-eval integration: the stderr column
# ---------------------------------------------------------------------------------------------------------------


def install_lm_eval_stderr_hook() -> bool:
    """Make lm-eval compute the standard error of an aggregation that carries a ``.distperp_stderr`` function.

    lm-eval 0.4 finds the stderr of a metric with ``stderr_for_metric(aggregation, bootstrap_iters)``, which knows
    only its own built-in aggregations (a fixed list inside the function) and gives ``"N/A"`` for anything else;
    there is no registry or task option for it. This wraps that function, in ``lm_eval.api.metrics`` and where
    ``lm_eval.evaluator_utils`` imported it, so that an aggregation with a ``.distperp_stderr`` attribute gets that
    function (unless ``--bootstrap_iters 0`` switched stderrs off); every other aggregation is answered by the
    original, unchanged. Idempotent. Called when ``tasks/distperp/utils.py`` is imported, i.e. whenever lm-eval
    loads one of our task YAMLs.

    Returns:
        True when the hook is in place, False (with a warning) when this lm-eval has no such function.
    """
    import lm_eval.api.metrics as lm_metrics

    try:
        import lm_eval.evaluator_utils as lm_evaluator_utils
    except ImportError:  # pragma: no cover - layout of other lm-eval versions
        lm_evaluator_utils = None

    installed = False
    for module in (lm_metrics, lm_evaluator_utils):
        original = getattr(module, "stderr_for_metric", None) if module is not None else None
        if original is None:
            continue
        if not getattr(original, "_distperp_hook", False):
            module.stderr_for_metric = _wrap_stderr_for_metric(original)
        installed = True
    if not installed:
        logger.warning("distperp: lm-eval has no stderr_for_metric; standard errors will show as N/A")
    return installed


def _wrap_stderr_for_metric(original: Callable) -> Callable:
    def stderr_for_metric(metric: Callable, bootstrap_iters: int) -> Callable | None:
        stderr_fn = getattr(metric, "distperp_stderr", None)
        if callable(stderr_fn):
            return stderr_fn if (bootstrap_iters or 0) > 0 else None
        return original(metric, bootstrap_iters)

    setattr(stderr_for_metric, "_distperp_hook", True)  # noqa: B010 - attributes of a function object
    setattr(stderr_for_metric, "__wrapped__", original)  # noqa: B010
    stderr_for_metric.__doc__ = original.__doc__
    return stderr_for_metric
