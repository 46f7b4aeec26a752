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
from distperp_harness.run.scoring.engine.invariance import (
    CHECK_PREFIX,
    Invariance,
    cached_rows,
    check_rows,
    merged,
    rows_check,
)
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
@pytest.mark.parametrize("cached", [False, True], ids=["whole", "cached-prefix"])
def test_a_batch_attending_alone_gives_every_unit_its_bits_alone(threads, cached):
    """Plain rows of many lengths and a tree row, in batches of every size from 1 to all, in two orders; or rows
    continuing one cached prefix (a row group's: every batch, one row included, computes it once)."""
    model = _model()
    rows, shared = (cached_rows(500, 256), CHECK_PREFIX) if cached else (check_rows(500, 256), 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)

    def scores(batch):
        return score_batch(model, batch, device=CPU, pad_token_id=0, shared=shared, rows_alone=True).stats

    try:
        alone = [scores([r]) for r in rows]
        for order in (list(range(len(rows))), list(range(len(rows)))[::-1]):
            for size in range(2, len(rows) + 1):
                got = scores([rows[i] for i in order[:size]])
                assert np.array_equal(got, np.concatenate([alone[i] for i in order[:size]])), (order, size)
    finally:
        torch.set_num_threads(before)
    if cached:  # a cached prefix is another computation than the row whole: the same prefix must be used every time
        whole = score_batch(model, rows, device=CPU, pad_token_id=0, rows_alone=True).stats
        assert not np.array_equal(whole[:, 0], np.concatenate(alone)[:, 0])


def test_the_check_rows_fit_max_length():
    for max_length in (8, 40, 256):
        rows = check_rows(500, max_length)
        assert rows and all(r.length <= max_length for r in rows)
    for max_length in (8, 99, 100, 256):
        rows = cached_rows(500, max_length)
        assert (rows != []) == (max_length >= 100) and all(r.length <= max_length for r in rows)
