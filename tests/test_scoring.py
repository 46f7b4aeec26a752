"""Scoring: chunked float64 log-probs, greedy flags and KL equal an independent float64 computation."""

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from distperp_harness import scoring
from distperp_harness.requests import Unit
from distperp_harness.scoring import GREEDY, LL, N_TOKENS, REF_LL, TOP1, NonFiniteLogitsError, score_batch


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference_scores(model, unit, ref=None):
    """Hand-written float64: full logits of the unpadded sequence, explicit log-softmax, fsum."""
    with torch.no_grad():
        logits = model(torch.tensor([unit.tokens[:-1]])).logits[0].double()
        ref_logits = ref(torch.tensor([unit.tokens[:-1]])).logits[0].double() if ref is not None else None
    first = unit.input_length - unit.n_score
    lps, greedy, kls, ref_lps, agree = [], True, [], [], 0
    for pos in range(first, unit.input_length):
        row = logits[pos].tolist()
        top = max(row)
        log_z = top + math.log(math.fsum(math.exp(x - top) for x in row))
        target = unit.tokens[pos + 1]
        lps.append(row[target] - log_z)
        greedy &= row.index(top) == target
        if ref_logits is not None:
            rrow = ref_logits[pos].tolist()
            rtop = max(rrow)
            r_log_z = rtop + math.log(math.fsum(math.exp(x - rtop) for x in rrow))
            ref_lps.append(rrow[target] - r_log_z)
            kls.append(math.fsum(math.exp(r - r_log_z) * ((r - r_log_z) - (m - log_z)) for r, m in zip(rrow, row)))
            agree += rrow.index(rtop) == row.index(top)
    return math.fsum(lps), greedy, kls, math.fsum(ref_lps), agree


def _units(seed=0):
    rng = np.random.default_rng(seed)
    return [Unit(tuple(int(t) for t in rng.integers(4, 400, size=n)), k)
            for n, k in [(40, 39), (33, 5), (12, 1), (64, 20), (7, 6)]]


def test_log_likelihoods_match_float64_reference(model):
    units = _units()
    out = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    assert out.stats.dtype == np.float64 and out.kl is None
    for unit, row in zip(units, out.stats):
        ll, greedy, _, _, _ = _reference_scores(model, unit)
        assert row[LL] == pytest.approx(ll, rel=1e-6, abs=1e-5)
        assert bool(row[GREEDY]) == greedy and row[N_TOKENS] == unit.n_score


def test_chunking_changes_nothing_but_rounding(model, monkeypatch):
    units = _units(1)
    whole = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    monkeypatch.setitem(scoring._CHUNK_ELEMENTS, "cpu", 7 * model.config.vocab_size)  # 7 positions per chunk
    chunked = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    again = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    assert np.array_equal(chunked, again)  # same batch, same chunks: same bits


def test_no_device_to_host_sync_per_chunk_on_accelerators(model, monkeypatch):
    """On a GPU every read of a value (``bool``, ``item``, ``nonzero``, ``tolist``) waits for the queue; the chunk
    loop must not do one per chunk. The accelerator path runs here on the CPU with the reads counted."""
    monkeypatch.setattr(scoring, "_HOST_DEVICE_TYPES", ())
    reads = []
    for name in ("__bool__", "item", "nonzero", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    units = _units(1)
    whole = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    one_chunk = len(reads)
    monkeypatch.setitem(scoring._CHUNK_ELEMENTS, "cpu", 3 * model.config.vocab_size)
    reads.clear()
    chunked = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    assert sum(u.n_score for u in units) > 9  # several chunks
    assert len(reads) == one_chunk, reads
    np.testing.assert_allclose(chunked.stats, whole.stats, rtol=1e-6)


def test_greedy_flag_on_the_models_own_argmax(model):
    tokens = [5]
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    out = score_batch(model, [Unit(tuple(tokens), 6)], device=torch.device("cpu"), pad_token_id=3)
    assert out.stats[0, GREEDY] == 1.0


def test_kl_against_reference_matches_float64(model):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    units = _units(2)
    out = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3, reference=ref)
    for unit, row, kl in zip(units, out.stats, out.kl):
        ll, _, kls, ref_ll, agree = _reference_scores(model, unit, ref)
        assert row[LL] == pytest.approx(ll, rel=1e-6, abs=1e-5)
        assert row[REF_LL] == pytest.approx(ref_ll, rel=1e-6, abs=1e-5)
        assert row[TOP1] == agree
        assert len(kl) == unit.n_score and (kl > 0).all()
        np.testing.assert_allclose(kl, kls, rtol=1e-4, atol=1e-7)


def test_self_reference_has_zero_kl(model):
    out = score_batch(model, _units(3), device=torch.device("cpu"), pad_token_id=3, reference=model)
    for row, kl in zip(out.stats, out.kl):
        assert np.all(np.abs(kl) < 1e-12) and row[TOP1] == row[N_TOKENS] and row[REF_LL] == row[LL]


def test_non_finite_logits_are_reported(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError) as info:
        score_batch(broken, _units(4), device=torch.device("cpu"), pad_token_id=3)
    assert info.value.rows
