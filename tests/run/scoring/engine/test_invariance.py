"""How ``batch_invariant=true`` holds rows (:mod:`distperp_harness.run.scoring.engine.invariance`): the once-per-run
check passes where rows attend alone (and fails where they do not, so it can), a model whose attention is not sdpa
goes a row per forward, the ranks merge to one answer, and a batch attending alone gives each unit its bits
alone."""

import contextlib

import numpy as np
import pytest
import torch
from helpers import family_model

from distperp_harness.run.scoring.engine import forward
from distperp_harness.run.scoring.engine.forward import score_batch
from distperp_harness.run.scoring.engine.invariance import Invariance, check_rows, merged, rows_check
from distperp_harness.run.scoring.engine.support import declared_paths, record_paths

CPU = torch.device("cpu")


def _model(name="llama", impl="sdpa"):
    model = family_model(name)
    model.set_attn_implementation(impl)
    record_paths(model, declared_paths(model, 256))
    return model


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_the_check_passes_where_rows_attend_alone_and_fails_where_they_do_not(monkeypatch, name):
    model = _model(name)
    assert rows_check(model, CPU, 0, 256) is None
    monkeypatch.setattr(forward, "attending_alone", lambda model, lengths: contextlib.nullcontext())
    why = rows_check(model, CPU, 0, 256)
    assert why is not None and "move with its batch-mates" in why


def test_a_model_that_does_not_attend_through_sdpa_goes_a_row_per_forward():
    why = rows_check(_model(impl="eager"), CPU, 0, 256)
    assert "'eager'" in why and "sdpa" in why
    assert merged([None, why]) == (Invariance.EACH_ROW, f"{why} (rank 1)")
    assert merged([None, None]) == (Invariance.BATCHED, None) and merged([why]) == (Invariance.EACH_ROW, why)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_attending_alone_gives_every_unit_its_bits_alone(threads):
    """Plain rows of many lengths and a tree row, in batches of every size from 1 to all, in two orders."""
    model = _model()
    rows = check_rows(500, 256)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [score_batch(model, [r], device=CPU, pad_token_id=0, rows_alone=True).stats for r in rows]
        for order in (list(range(len(rows))), list(range(len(rows)))[::-1]):
            for size in range(2, len(rows) + 1):
                batch = [rows[i] for i in order[:size]]
                got = score_batch(model, batch, device=CPU, pad_token_id=0, rows_alone=True).stats
                assert np.array_equal(got, np.concatenate([alone[i] for i in order[:size]])), (order, size)
    finally:
        torch.set_num_threads(before)


def test_the_check_rows_fit_max_length():
    for max_length in (8, 40, 256):
        rows = check_rows(500, max_length)
        assert rows and all(r.length <= max_length for r in rows)
