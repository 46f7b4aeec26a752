"""Aggregations and standard errors of distperp_harness.report.metrics against hand-written float64 computations.

The expected values are computed here with plain loops and math.fsum, never with the helpers under test.
"""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest

from distperp_harness.report import metrics

# Five documents: (loglikelihood, tokens, words, bytes, ref_loglikelihood, top1_agree), and per-token KL values.
DOCS = [
    (-812.25, 301, 180, 1011, -790.5, 250),
    (-45.125, 17, 11, 60, -44.0, 15),
    (-2301.0, 998, 612, 3405, -2260.75, 801),
    (-377.5, 120, 90, 402, -371.25, 101),
    (-1200.0625, 455, 300, 1550, -1170.0, 390),
]
KL = [np.random.default_rng(i).exponential(0.04 * (i + 1), doc[1]) for i, doc in enumerate(DOCS)]


def hand_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """R = sum a / sum b and sqrt(n/(n-1) * sum (a_i - R b_i)^2 / (sum b)^2), by hand."""
    total_a = math.fsum(a)
    total_b = math.fsum(b)
    r = total_a / total_b
    squares = []
    for a_i, b_i in zip(a, b):
        squares.append((a_i - r * b_i) ** 2)
    n = len(a)
    return r, math.sqrt(n / (n - 1) * math.fsum(squares) / (total_b * total_b))


def hand_percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), by hand."""
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def column(i: int) -> list[float]:
    return [float(doc[i]) for doc in DOCS]


@pytest.mark.parametrize("count_index", [1, 2, 3], ids=["tokens", "words", "bytes"])
def test_weighted_perplexity_and_stderr(count_index):
    items = [(doc[0], doc[count_index]) for doc in DOCS]
    r, se = hand_ratio([-x for x in column(0)], column(count_index))
    assert metrics.weighted_perplexity(items) == pytest.approx(math.exp(r), rel=1e-15)
    assert metrics.weighted_perplexity.distperp_stderr(items) == pytest.approx(math.exp(r) * se, rel=1e-12)


def test_bits_per_byte_and_stderr():
    items = [(doc[0], doc[3]) for doc in DOCS]
    r, se = hand_ratio([-x for x in column(0)], column(3))
    assert metrics.bits_per_byte(items) == pytest.approx(r / math.log(2), rel=1e-15)
    assert metrics.bits_per_byte.distperp_stderr(items) == pytest.approx(se / math.log(2), rel=1e-12)


def test_word_byte_values_equal_lm_eval_formulas():
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity

    words = [(doc[0], doc[2]) for doc in DOCS]
    n_bytes = [(doc[0], doc[3]) for doc in DOCS]
    assert metrics.weighted_perplexity(words) == pytest.approx(weighted_perplexity(words), rel=1e-14)
    assert metrics.weighted_perplexity(n_bytes) == pytest.approx(weighted_perplexity(n_bytes), rel=1e-14)
    assert metrics.bits_per_byte(n_bytes) == pytest.approx(bits_per_byte(n_bytes), rel=1e-14)


def test_kl_divergence_mean_and_stderr():
    items = [(math.fsum(kl), doc[1]) for kl, doc in zip(KL, DOCS)]
    sums = [math.fsum(float(x) for x in kl) for kl in KL]
    r, se = hand_ratio(sums, column(1))
    assert metrics.ratio_mean(items) == pytest.approx(r, rel=1e-15)
    assert metrics.ratio_mean.distperp_stderr(items) == pytest.approx(se, rel=1e-12)


def test_top1_agreement_and_stderr():
    items = [(doc[5], doc[1]) for doc in DOCS]
    r, se = hand_ratio(column(5), column(1))
    assert metrics.ratio_mean(items) == pytest.approx(r, rel=1e-15)
    assert metrics.ratio_mean.distperp_stderr(items) == pytest.approx(se, rel=1e-12)
    assert 0 < metrics.ratio_mean(items) < 1


def test_ref_perplexity_and_ln_ppl_ratio():
    ref_items = [(doc[4], doc[1]) for doc in DOCS]
    r_ref, se_ref = hand_ratio([-x for x in column(4)], column(1))
    assert metrics.weighted_perplexity(ref_items) == pytest.approx(math.exp(r_ref), rel=1e-15)
    assert metrics.weighted_perplexity.distperp_stderr(ref_items) == pytest.approx(math.exp(r_ref) * se_ref, rel=1e-12)

    items = [(doc[0], doc[4], doc[1]) for doc in DOCS]
    diffs = [doc[4] - doc[0] for doc in DOCS]
    r, se = hand_ratio(diffs, column(1))
    assert metrics.ln_ppl_ratio(items) == pytest.approx(r, rel=1e-14)
    assert metrics.ln_ppl_ratio.distperp_stderr(items) == pytest.approx(se, rel=1e-12)
    # ln(PPL / PPL_ref) from the two perplexities
    ppl = metrics.weighted_perplexity([(doc[0], doc[1]) for doc in DOCS])
    assert metrics.ln_ppl_ratio(items) == pytest.approx(math.log(ppl / math.exp(r_ref)), rel=1e-12)


def test_percentile_max_total():
    all_values = [float(x) for kl in KL for x in kl]
    assert metrics.percentile_99(KL) == pytest.approx(hand_percentile(all_values, 99), rel=1e-15)
    assert metrics.maximum([float(kl.max()) for kl in KL] + [None]) == max(all_values)
    assert metrics.total([doc[1] for doc in DOCS]) == sum(doc[1] for doc in DOCS)
    assert math.isnan(metrics.percentile_99([]))
    assert math.isnan(metrics.maximum([None]))


def test_ratio_stderr_with_unit_weights_is_the_standard_error_of_the_mean():
    from lm_eval.api.metrics import mean_stderr

    values = [0.3, 1.7, 2.2, 0.9, 1.1, 4.0]
    _, se = metrics.ratio_and_stderr(values, [1.0] * len(values))
    assert se == pytest.approx(mean_stderr(values), rel=1e-12)


def test_single_document_has_no_stderr():
    r, se = metrics.ratio_and_stderr([3.0], [2.0])
    assert r == 1.5 and math.isnan(se)


def test_order_independent_bit_for_bit():
    items = [(doc[0], doc[1]) for doc in DOCS] * 7
    shuffled = list(items)
    random.Random(0).shuffle(shuffled)
    for fn in (metrics.weighted_perplexity, metrics.weighted_perplexity.distperp_stderr, metrics.bits_per_byte):
        assert fn(items) == fn(shuffled)


def test_missing_token_counts_give_na_and_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(metrics, "_WARNED_NO_TOKENS", False)
    items = [(-10.0, None), (-20.0, None)]
    with caplog.at_level(logging.WARNING, logger="distperp_harness.report.metrics"):
        assert metrics.weighted_perplexity(items) == "N/A"
        assert metrics.weighted_perplexity.distperp_stderr(items) == "N/A"
        assert metrics.total([None, None]) == "N/A"
    assert sum("token_perplexity" in r.getMessage() for r in caplog.records) == 1


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="positive"):
        metrics.ratio_and_stderr([1.0], [0.0])
    with pytest.raises(ValueError, match="equally long"):
        metrics.ratio_and_stderr([1.0, 2.0], [1.0])


# ---------------------------------------------------------------------------------------------------------------
# lm-eval's stderr column
# ---------------------------------------------------------------------------------------------------------------


def test_stderr_hook_answers_for_our_aggregations_only():
    import lm_eval.api.metrics as lm_metrics
    import lm_eval.evaluator_utils as lm_evaluator_utils

    assert metrics.install_lm_eval_stderr_hook()
    assert metrics.install_lm_eval_stderr_hook()  # idempotent
    for module in (lm_metrics, lm_evaluator_utils):
        hooked = module.stderr_for_metric
        assert not getattr(hooked.__wrapped__, "_distperp_hook", False)  # wrapped once, not twice
        assert hooked(metrics.weighted_perplexity, 1000) is metrics.weighted_perplexity_stderr
        assert hooked(metrics.ln_ppl_ratio, 1000) is metrics.ln_ppl_ratio_stderr
        assert hooked(metrics.weighted_perplexity, 0) is None  # --bootstrap_iters 0: no stderr
        assert hooked(metrics.total, 1000) is None
        assert hooked(lm_metrics.mean, 1000) is lm_metrics.mean_stderr
        assert hooked(lm_metrics.weighted_perplexity, 1000) is None


class _FakeTask:
    task_name = "fake"

    def aggregation(self):
        return {"token_perplexity": metrics.weighted_perplexity, "n_tokens": metrics.total}


def test_lm_eval_aggregation_reports_our_stderr():
    from lm_eval.evaluator_utils import _compute_task_aggregations

    metrics.install_lm_eval_stderr_hook()
    items = [(doc[0], doc[1]) for doc in DOCS]
    raw = {("token_perplexity", "none"): items, ("n_tokens", "none"): [doc[1] for doc in DOCS]}
    agg, n = _compute_task_aggregations(_FakeTask(), raw, bootstrap_iters=100000)
    r, se = hand_ratio([-x for x in column(0)], column(1))
    assert n == len(DOCS)
    assert agg["token_perplexity,none"] == pytest.approx(math.exp(r), rel=1e-15)
    assert agg["token_perplexity_stderr,none"] == pytest.approx(math.exp(r) * se, rel=1e-12)
    assert agg["n_tokens,none"] == sum(doc[1] for doc in DOCS)
    assert agg["n_tokens_stderr,none"] == "N/A"
