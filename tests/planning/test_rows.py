"""Rows: trees of token runs; every unit reads exactly its own input back from its row, whatever shares the row."""

import random

import pytest

from distperp_harness.planning.plan import make_batches
from distperp_harness.planning.requests import Unit, UnitTable, continuation_unit
from distperp_harness.planning.rows import MIN_SHARED_PREFIX, build_rows, plan_rows, shared_prefix, unit_rows
from tests.helpers import check_row_reads as _check_reads


def _mc(context, answers, max_length=64):
    return [continuation_unit(context, answer, max_length) for answer in answers]


def test_one_token_answers_share_one_row():
    units = UnitTable(_mc([5, 6, 7, 8], [[20], [21], [22], [23]])).units
    rows = build_rows(units, "prefix")
    assert len(rows) == 1 and rows[0].runs == ((5, 6, 7, 8),) and rows[0].length == 4
    assert [list(rows[0].columns(k)) for k in range(4)] == [[3]] * 4
    _check_reads(rows, units)
    assert len(build_rows(units, "inputs")) == 1 and len(build_rows(units, "off")) == 4


def test_endings_after_one_context_share_a_tree_row():
    units = UnitTable(_mc([5, 6, 7], [[20, 21, 22], [30, 31], [40], [50, 51, 52, 53]])).units
    rows = build_rows(units, "prefix")
    assert len(rows) == 1 and rows[0].packed
    assert rows[0].root == (5, 6, 7) and rows[0].length == 3 + 2 + 1 + 3  # [40] reads the context itself
    assert rows[0].position_ids() == [0, 1, 2, 3, 4, 3, 3, 4, 5]
    assert rows[0].parents == (-1, 0, 0, 0)
    _check_reads(rows, units)
    inputs = build_rows(units, "inputs")
    assert all(len(r.runs) == 1 for r in inputs) and len(inputs) == 3
    _check_reads(inputs, units)


def test_same_input_with_different_splits_shares_a_row():
    units = UnitTable([Unit((1, 2, 3, 4), 2), Unit((1, 2, 3, 9), 1), Unit((1, 2, 3, 4, 5), 1)]).units
    rows = build_rows(units, "prefix")
    _check_reads(rows, units)
    assert len(rows) == 1 and rows[0].length == 4  # input (1, 2, 3) lies on the path of (1, 2, 3, 4)


def test_few_shot_questions_form_a_three_level_tree():
    """A few-shot block, then questions, then multi-token answers: runs nest three deep, siblings share positions."""
    shots = list(range(100, 140))
    units = []
    for q in range(3):
        question = [200 + 10 * q + i for i in range(5)]
        units += _mc(shots + question, [[300 + q, 301], [310 + q, 311, 312]], max_length=64)
    units = UnitTable(units).units
    rows = build_rows(units, "prefix")
    assert len(rows) == 1
    row = rows[0]
    assert row.root == tuple(shots) and row.length == 40 + 3 * (5 + 1 + 2)
    assert sorted(len(row.path(r)) for r in range(len(row.runs))) == [1, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    _check_reads(rows, units, max_length=48)


def test_rows_may_exceed_max_length_while_paths_do_not():
    shots = list(range(100, 160))
    units = UnitTable([u for q in range(30) for u in _mc(shots + [200 + q] * 3, [[7], [8]], max_length=64)]).units
    rows = build_rows(units, "prefix", max_row_length=128)
    assert len(rows) == 2 and max(r.length for r in rows) > 64
    _check_reads(rows, units, max_row_length=128, max_length=64)


def test_rows_grow_only_while_sharing_pays():
    """With a costly dense attention, questions sharing one token stay apart; sharing a long block, they join."""
    short = UnitTable([u for q in range(4) for u in _mc([1, 10 + q] + [50 + q] * 60, [[7]], 128)]).units
    assert len(build_rows(short, "prefix", attention_coef=0.0)) == 1
    assert len(build_rows(short, "prefix", attention_coef=1e-3)) == 4
    long = UnitTable([u for q in range(4) for u in _mc(list(range(100, 160)) + [50 + q] * 5, [[7]], 128)]).units
    assert len(build_rows(long, "prefix", attention_coef=1e-3)) == 1


def test_long_groups_split_deterministically():
    context = list(range(10, 30))
    units = UnitTable(_mc(context, [[100 + i] * (3 + i % 4) for i in range(12)])).units
    rows = build_rows(units, "prefix", max_row_length=32)
    assert len(rows) > 1 and all(r.root == tuple(context) for r in rows)
    _check_reads(rows, units, max_row_length=32)
    assert [r.length for r in rows] == sorted((r.length for r in rows), reverse=True)


def test_rows_sharing_a_long_prefix_form_a_group_batches_never_mix():
    shots = list(range(1000, 1000 + MIN_SHARED_PREFIX + 8))
    grouped = [u for q in range(10) for u in _mc(shots + [200 + q] * 6, [[7], [8]], 256)]
    loose = [u for q in range(5) for u in _mc([300 + q] * (4 + q), [[7, 9]], 256)]
    units = UnitTable(grouped + loose).units
    plan = plan_rows(units, "prefix", max_row_length=len(shots) + 20)
    _check_reads(plan.rows, units)
    assert len(plan.group_starts) == 2 and plan.group_starts[0] == 0
    first = plan.group_starts[1]
    assert all(r.root[: len(shots)] == tuple(shots) for r in plan.rows[first:])
    assert not any(r.root[:1] == (1000,) for r in plan.rows[:first])
    batches = make_batches([r.length for r in plan.rows], batch_size=4, group_starts=plan.group_starts)
    assert all(not (b.start < first < b.stop) for b in batches)
    for b in batches:
        rows = plan.rows[b.start : b.stop]
        expected = len(shots) if b.start >= first and len(rows) > 1 else 0
        assert shared_prefix(rows) == expected


def test_shared_prefix_stops_before_the_first_scored_position():
    block = list(range(100, 100 + MIN_SHARED_PREFIX + 10))
    a = build_rows([Unit(tuple(block + [1, 2]), 1)])[0]
    b = build_rows([Unit(tuple(block + [3, 4, 5]), 1)])[0]
    assert shared_prefix([a, b]) == len(block)
    early = build_rows([Unit(tuple(block + [6, 7]), 5)])[0]  # its first scored position is inside the block
    assert shared_prefix([a, b, early]) == len(block) - 4
    too_early = build_rows([Unit(tuple(block + [6, 7]), 20)])[0]  # leaves less than MIN_SHARED_PREFIX
    assert shared_prefix([a, too_early]) == 0
    assert shared_prefix([a]) == 0


@pytest.mark.parametrize("mode", ["prefix", "inputs", "off"])
def test_rows_depend_only_on_the_unit_set(mode):
    rng = random.Random(0)
    units = []
    for _q in range(30):
        context = [rng.randrange(4, 50) for _ in range(rng.randrange(1, 12))]
        units += _mc(context, [[rng.randrange(4, 50) for _ in range(rng.randrange(1, 5))] for _ in range(4)], 16)
    table = UnitTable(units)
    plan = plan_rows(table.units, mode, max_row_length=16)
    _check_reads(plan.rows, table.units, max_row_length=16)
    shuffled = units + units[:7]
    rng.shuffle(shuffled)
    again = plan_rows(UnitTable(shuffled).units, mode, max_row_length=16)
    assert [r.key() for r in again.rows] == [r.key() for r in plan.rows]
    assert [r.unit_ids for r in again.rows] == [r.unit_ids for r in plan.rows]
    assert again.group_starts == plan.group_starts
    if mode != "off":
        assert sum(r.length for r in plan.rows) < sum(u.input_length for u in table.units)


def test_unit_rows_and_bad_mode():
    units = [Unit((1, 2, 3), 2), Unit((4, 5), 1)]
    rows = unit_rows(units)
    assert [r.unit_ids for r in rows] == [(0,), (1,)] and not any(r.packed for r in rows)
    _check_reads(rows, units)
    with pytest.raises(ValueError, match="share mode"):
        build_rows(units, "sometimes")
