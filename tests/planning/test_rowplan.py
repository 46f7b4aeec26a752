"""Rows planned from records: every unit in one row, exact rows within the plan's lengths, shared prefixes found,
and one plan for any split of the units among ranks."""

import numpy as np
import pytest

from distperp_harness.planning.plan import make_batches
from distperp_harness.planning.records import FlatUnits, GlobalTable, decode, encode, local_records
from distperp_harness.planning.requests import Unit, continuation_unit, window_units
from distperp_harness.planning.rowplan import batch_shared, plan_from_records
from distperp_harness.planning.rows import build_rows, row_of, shared_prefix, unit_rows
from tests.helpers import check_row_reads as _check_reads
from tests.helpers import fewshot_units as _fewshot


def _rolling(seed=1):
    rng = np.random.default_rng(seed)
    return [u for n in (5, 40, 90) for u in window_units([int(t) for t in rng.integers(5, 900, n)], 1, 32, 16)]


def _table(parts):
    return GlobalTable([decode(encode(*local_records(FlatUnits.of(p)))) for p in parts])


def _built(table, planned, units, mode):
    by_key = {u.key(): u for u in units}
    keys = FlatUnits.of(units).keys()
    ids = table.ids(keys)
    unit_of = {int(i): units[k] for k, i in enumerate(ids)}
    rows = []
    for members in planned.members:
        us = [unit_of[int(i)] for i in members]
        rows.append(unit_rows(us, int(members[0]))[0] if mode == "off" else row_of(us, members))
    return rows, [unit_of[i] for i in range(len(units))], by_key


@pytest.mark.parametrize("mode", ["off", "inputs", "prefix"])
@pytest.mark.parametrize("make", [_fewshot, _rolling])
def test_every_unit_reads_its_input_and_rows_stay_within_the_plan(mode, make):
    units = make()
    table = _table([units])
    planned = plan_from_records(table, mode, max_row_length=512, attention_coef=1e-4)
    rows, canonical, _ = _built(table, planned, units, mode)
    _check_reads(rows, canonical)
    assert all(row.length <= planned.lengths[r] for r, row in enumerate(rows))
    assert planned.scored.tolist() == [row.scored for row in rows]
    if mode == "prefix":
        assert all(row.length <= 512 or not row.packed for row in rows)


def test_few_shot_questions_share_their_block_about_as_well_as_the_token_planner():
    units = _fewshot(questions=40)
    table = _table([units])
    planned = plan_from_records(table, "prefix", max_row_length=1024, attention_coef=1e-5)
    rows, _, _ = _built(table, planned, units, "prefix")
    exact = build_rows(units, "prefix", 1024, 1e-5)
    ours, theirs = sum(r.length for r in rows), sum(r.length for r in exact)
    assert len(rows) <= len(exact) + 2 and ours <= 1.1 * theirs
    assert ours < sum(u.input_length for u in units) / 4  # the block and each context are computed once per row


def _spilled(answers=24):
    """One 60-token question with many 10-token answers: its answers fill several rows that share the question."""
    rng = np.random.default_rng(5)
    context = [int(t) for t in rng.integers(5, 900, 60)]
    return [continuation_unit(context, [int(t) for t in rng.integers(5, 900, 10)], 256) for _ in range(answers)]


@pytest.mark.parametrize("units,row_length", [(_fewshot(questions=60, max_length=512), 200), (_spilled(), 110)])
def test_batches_share_at_most_what_their_rows_share(units, row_length):
    table = _table([units])
    planned = plan_from_records(table, "prefix", max_row_length=row_length, attention_coef=1e-5)
    rows, _, _ = _built(table, planned, units, "prefix")
    batches = make_batches(planned.lengths.tolist(), batch_size=3, group_starts=planned.group_starts)
    shared = [batch_shared(planned, b.start, b.stop) for b in batches]
    assert any(shared)
    for b, s in zip(batches, shared):
        if s:
            assert s <= shared_prefix(rows[b.start : b.stop])


@pytest.mark.parametrize("mode", ["off", "inputs", "prefix"])
def test_one_plan_for_any_split_among_ranks(mode):
    units = _fewshot(questions=25) + _rolling()
    whole = plan_from_records(_table([units]), mode, 300, 1e-4)
    rng = np.random.default_rng(3)
    for ranks in (2, 3, 5):
        parts = [[u for k, u in enumerate(units) if k % ranks == r or rng.random() < 0.1] for r in range(ranks)]
        split = plan_from_records(_table(parts), mode, 300, 1e-4)
        assert [m.tolist() for m in split.members] == [m.tolist() for m in whole.members]
        assert split.lengths.tolist() == whole.lengths.tolist() and split.group_starts == whole.group_starts


def test_an_input_that_is_the_context_of_a_longer_one_reads_along_it_without_masks():
    units = [Unit((1, 2, 3, 4, 7), 1), Unit((1, 2, 3, 4, 8, 9), 2)]  # a one-token answer after a two-token one
    table = _table([units])
    planned = plan_from_records(table, "inputs")
    assert len(planned.members) == 1
    rows, canonical, _ = _built(table, planned, units, "inputs")
    assert not rows[0].packed
    _check_reads(rows, canonical)


def _keyed(lengths, threshold=40, exact_above=None):
    keys = np.searchsorted([threshold], lengths, side="left").astype(np.int64)
    return keys if exact_above is None else np.where(lengths > exact_above, -lengths, keys)


@pytest.mark.parametrize("mode", ["off", "inputs", "prefix"])
@pytest.mark.parametrize("exact_above", [None, 60])
def test_units_of_different_length_keys_never_share_a_row_or_a_batch(mode, exact_above):
    """Keys by each unit's input length (a side of 40 tokens, and above 60 each length alone): every row and batch
    holds one key, negative keys one input per row, every unit still reads its input, and batches of equal keys
    still share where the mode allows."""
    units = _fewshot(questions=12) + _rolling()
    table = _table([units])
    keys = _keyed(table.units["length"].astype(np.int64) - 1, exact_above=exact_above)
    assert len(set(keys.tolist())) > 1
    planned = plan_from_records(table, mode, max_row_length=512, attention_coef=1e-4, keys=keys)
    assert sorted(np.concatenate(planned.members).tolist()) == list(range(len(table)))
    for members in planned.members:
        assert len(set(keys[members].tolist())) == 1
        assert keys[members[0]] >= 0 or len(set(table.unit_input[members].tolist())) == 1
    for batch in make_batches(planned.lengths.tolist(), batch_size=4, group_starts=planned.group_starts):
        assert len({int(keys[planned.members[r][0]]) for r in range(batch.start, batch.stop)}) == 1
        if batch_shared(planned, batch.start, batch.stop):
            assert keys[planned.members[batch.start][0]] >= 0
    rows, canonical, _ = _built(table, planned, units, mode)
    _check_reads(rows, canonical)
    if mode == "prefix":
        assert any(row.packed for row in rows)


def test_one_key_plans_as_without_keys():
    units = _fewshot(questions=8)
    table = _table([units])
    plain = plan_from_records(table, "prefix", 512, 1e-4)
    keyed = plan_from_records(table, "prefix", 512, 1e-4, keys=np.zeros(len(table), np.int64))
    assert [m.tolist() for m in plain.members] == [m.tolist() for m in keyed.members]
    assert plain.group_starts == keyed.group_starts
