"""Rows: units of one input or one context share a row; every unit reads exactly its own input back from it."""

import random

import pytest

from distperp_harness.requests import Unit, UnitTable, continuation_unit
from distperp_harness.rows import build_rows, unit_rows


def _mc(context, answers, max_length=64):
    return [continuation_unit(context, answer, max_length) for answer in answers]


def _check_reads(rows, units, max_row_length=None):
    """Each unit is in one row, and the row gives back its input tokens at its positions and ids."""
    seen = sorted(i for r in rows for i in r.unit_ids)
    assert seen == list(range(len(units)))
    for row in rows:
        tokens, positions = row.tokens(), row.position_ids()
        assert len(tokens) == len(positions) == len(row.segment_ids()) == row.length
        if max_row_length is not None and row.packed:
            assert row.length <= max_row_length
        for k, (uid, unit) in enumerate(zip(row.unit_ids, row.units)):
            assert units[uid] is unit
            cols = list(row.columns(k))
            assert len(cols) == unit.n_score
            first = unit.input_length - unit.n_score
            assert [tokens[c] for c in cols] == list(unit.tokens[first:-1])
            assert [positions[c] for c in cols] == list(range(first, unit.input_length))
            # the unit's whole input is visible to its last scored column: prefix, then its own segment
            seg = row.segment_ids()
            visible = [tokens[c] for c in range(cols[-1] + 1) if seg[c] in (0, seg[cols[-1]])]
            assert visible == list(unit.tokens[:-1])


def test_one_token_answers_share_one_row():
    units = UnitTable(_mc([5, 6, 7, 8], [[20], [21], [22], [23]])).units
    rows = build_rows(units, "prefix")
    assert len(rows) == 1 and rows[0].segments == () and rows[0].length == 4
    assert [list(rows[0].columns(k)) for k in range(4)] == [[3]] * 4
    _check_reads(rows, units)
    assert len(build_rows(units, "inputs")) == 1 and len(build_rows(units, "off")) == 4


def test_endings_after_one_context_share_a_packed_row():
    units = UnitTable(_mc([5, 6, 7], [[20, 21, 22], [30, 31], [40], [50, 51, 52, 53]])).units
    rows = build_rows(units, "prefix")
    assert len(rows) == 1 and rows[0].packed
    assert rows[0].prefix == (5, 6, 7) and rows[0].length == 3 + 3 + 2 + 1  # [40] needs no segment
    assert rows[0].position_ids() == [0, 1, 2, 3, 4, 5, 3, 4, 3]
    _check_reads(rows, units)
    inputs = build_rows(units, "inputs")
    assert all(len(r.segments) <= 1 for r in inputs) and len(inputs) == 3
    _check_reads(inputs, units)


def test_same_input_with_different_splits_shares_a_row():
    units = UnitTable([Unit((1, 2, 3, 4), 2), Unit((1, 2, 3, 9), 1), Unit((1, 2, 3, 4, 5), 1)]).units
    rows = build_rows(units, "prefix")
    _check_reads(rows, units)
    assert len(rows) == 2  # input (1, 2, 3) once for both of its units; (1, 2, 3, 4) has another context


def test_long_groups_split_deterministically():
    context = list(range(10, 30))
    units = UnitTable(_mc(context, [[100 + i] * (3 + i % 4) for i in range(12)])).units
    rows = build_rows(units, "prefix", max_row_length=32)
    assert len(rows) > 1 and all(r.prefix == tuple(context) for r in rows)
    _check_reads(rows, units, max_row_length=32)
    assert [r.length for r in rows] == sorted((r.length for r in rows), reverse=True)


@pytest.mark.parametrize("mode", ["prefix", "inputs", "off"])
def test_rows_depend_only_on_the_unit_set(mode):
    rng = random.Random(0)
    units = []
    for q in range(30):
        context = [rng.randrange(4, 50) for _ in range(rng.randrange(1, 12))]
        units += _mc(context, [[rng.randrange(4, 50) for _ in range(rng.randrange(1, 5))] for _ in range(4)], 16)
    table = UnitTable(units)
    rows = build_rows(table.units, mode, max_row_length=16)
    _check_reads(rows, table.units, max_row_length=16)
    shuffled = units + units[:7]
    rng.shuffle(shuffled)
    again = build_rows(UnitTable(shuffled).units, mode, max_row_length=16)
    assert [r.key() for r in again] == [r.key() for r in rows]
    assert [r.unit_ids for r in again] == [r.unit_ids for r in rows]
    if mode != "off":
        assert sum(r.length for r in rows) < sum(u.input_length for u in table.units)


def test_unit_rows_and_bad_mode():
    units = [Unit((1, 2, 3), 2), Unit((4, 5), 1)]
    rows = unit_rows(units)
    assert [r.unit_ids for r in rows] == [(0,), (1,)] and not any(r.packed for r in rows)
    _check_reads(rows, units)
    with pytest.raises(ValueError, match="share mode"):
        build_rows(units, "sometimes")
