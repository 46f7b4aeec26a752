"""The family matrix (:data:`helpers.FAMILIES`): each family's scoring paths decided by probing its weights (no list
of model types), its packed rows and cached prefixes equal to its unshared rows, and its log-likelihoods closer to a
float64 forward of the same weights than lm-eval's ``hf`` (never further)."""

import copy
import math

import numpy as np
import pytest
import torch
from helpers import FAMILIES, UNMASKED_FAMILIES, family_model, fewshot_units

from distperp_harness.planning.rows import ShareMode, plan_rows, shared_prefix, unit_rows
from distperp_harness.run.scoring.engine.forward import LL, score_batch
from distperp_harness.run.scoring.engine.probe import probe
from distperp_harness.run.scoring.engine.support import declared_paths, record_paths

CPU = torch.device("cpu")
MAX_LENGTH = 128
WINDOWED = {
    name for name, (_, _, extra) in FAMILIES.items() if "sliding_window" in extra or "attention_chunk_size" in extra
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """``(name, model, verdict)``: the family's tiny model, probed and recorded as a run records it."""
    model = family_model(request.param)
    verdict = probe(model, CPU, 0, MAX_LENGTH)
    record_paths(model, verdict)
    return request.param, model, verdict


def test_the_probe_decides_each_family(family):
    """Packed rows, a cached prefix and the head only where scored for every family whose layers take a mask; a
    window or chunk is probed on paths longer than it; the config's logit maps are applied; linear-attention and
    state-space layers get unshared rows, the head still only where scored."""
    name, model, verdict = family
    assert verdict.probed and verdict.head_only is None, verdict.line()
    if name in UNMASKED_FAMILIES:
        assert "attend by more than a mask" in verdict.packed_rows and verdict.cached_prefix == verdict.packed_rows
        return
    assert verdict.packed_rows is None and verdict.cached_prefix is None, verdict.line()
    evidence = verdict.evidence
    assert set(evidence["largest_difference"]) == {"alone", "tree", "padded", "cached"}
    assert max(evidence["largest_difference"].values()) <= evidence["tolerance"] <= 1e-6
    assert evidence["probed"] == {"longest_path": MAX_LENGTH, "widest_tree": MAX_LENGTH}
    if name in WINDOWED:
        assert verdict.layout.span == 16 < evidence["probed"]["longest_path"]
    maps = {"gemma2-softcaps": {"softcap": 2.0}, "granite-scaled": {"divide": 4.0}, "cohere2-window": {"multiply": 0.5}}
    assert verdict.output_map.to_dict() == maps.get(name, {})
    assert verdict.output_map == declared_paths(model, MAX_LENGTH).output_map  # what the config declares, confirmed


def _float64_scores(model, units):
    """Independent float64: the same weights in float64 (experts computed one by one), full logits of each unit's
    unshared input, explicit log-softmax, ``math.fsum``."""
    wide = copy.deepcopy(model).double()
    if getattr(wide.config, "_experts_implementation", None) not in (None, "eager"):
        wide.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    out = []
    with torch.no_grad():
        for unit in units:
            logits = wide(torch.tensor([unit.tokens[:-1]]), use_cache=False).logits[0]
            logp = torch.log_softmax(logits, -1)[-unit.n_score :]
            targets = torch.tensor(unit.tokens[-unit.n_score :])
            out.append(math.fsum(logp.gather(-1, targets[:, None])[:, 0].tolist()))
    return np.array(out)


def _hf_scores(model, units, tokenizer):
    """lm-eval's ``hf`` on the same model object, token by token (its float32 log-softmax and sum)."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu", max_length=MAX_LENGTH)
    requests = [(("", ""), list(u.tokens[: -u.n_score]), list(u.tokens[-u.n_score :])) for u in units]
    return np.array([score for score, _ in hf._loglikelihood_tokens(requests, disable_tqdm=True)])


def _planned_scores(model, units, verdict):
    """Each unit's log-likelihood as a run computes it: units of one length key together (the verdict's length
    rule), rows by the verdict's share mode, batches of four rows, a batch's shared prefix computed once where the
    verdict allows it (and keys alike)."""
    mode = ShareMode.PREFIX if verdict.packed_rows is None else ShareMode.INPUTS
    keys = [verdict.lengths.key(u.input_length) for u in units]
    out, packed = np.empty(len(units)), False
    for key in sorted(set(keys)):
        ids = [i for i, k in enumerate(keys) if k == key]
        rows = plan_rows([units[i] for i in ids], mode, max_row_length=2 * MAX_LENGTH).rows
        packed = packed or any(r.packed for r in rows)
        for start in range(0, len(rows), 4):
            batch = rows[start : start + 4]
            shared = shared_prefix(batch) if mode == ShareMode.PREFIX and verdict.cached_prefix is None else 0
            shared = shared if verdict.lengths.key(shared) == key else 0
            stats = score_batch(model, batch, device=CPU, pad_token_id=0, shared=shared).stats
            out[[ids[i] for row in batch for i in row.unit_ids]] = stats[:, LL]
    return out, packed


def test_rows_as_planned_equal_unshared_rows_and_are_closer_to_float64_than_hf(family, tiny_tokenizer):
    """Few-shot questions (a 40-token block, answers of one to three tokens, paths longer than every window): the
    planned rows give the unshared rows' log-likelihoods to float32 rounding, and no unit is further from the float64
    forward than lm-eval's hf is (beyond float32 rounding of the forward itself); the worst unit is no further."""
    name, model, verdict = family
    units = fewshot_units(questions=4, shots=40, max_length=MAX_LENGTH)
    planned, packed = _planned_scores(model, units, verdict)
    assert packed == (name not in UNMASKED_FAMILIES)
    alone = score_batch(model, unit_rows(units), device=CPU, pad_token_id=0).stats[:, LL]
    np.testing.assert_allclose(planned, alone, rtol=0, atol=2e-4)
    exact = _float64_scores(model, units)
    hf = _hf_scores(model, units, tiny_tokenizer)
    ours_error, hf_error = np.abs(planned - exact), np.abs(hf - exact)
    assert ours_error.max() <= hf_error.max() + 1e-6, (name, ours_error.max(), hf_error.max())
    assert (ours_error <= hf_error + 2e-5).all(), (name, (ours_error - hf_error).max())
