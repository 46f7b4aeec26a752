"""Records: identities and prefix hashes are functions of the tokens; merging any split gives one table; collisions
are loud."""

import numpy as np
import pytest

from distperp_harness.planning.records import (
    BLOCK,
    FlatUnits,
    GlobalTable,
    HashCollision,
    decode,
    encode,
    local_records,
)
from distperp_harness.planning.requests import Unit


def _units(seed=0, questions=12):
    rng = np.random.default_rng(seed)
    shots = [int(t) for t in rng.integers(5, 900, 70)]
    out = []
    for q in range(questions):
        question = [int(t) for t in rng.integers(5, 900, 5 + q)]
        for a in range(3):
            out.append(Unit(tuple(shots + question + [1000 + a] * (1 + a % 2)), 1 + a % 2))
    return out


def _table(parts):
    return GlobalTable([decode(encode(*local_records(FlatUnits.of(p)))) for p in parts])


def test_prefix_hashes_depend_on_the_prefix_only():
    a = FlatUnits.of([Unit((5, 6, 7, 8, 9), 1), Unit((1, 5, 6, 7, 8, 9), 1), Unit((5, 6, 7, 1, 1), 1)])
    h = a.prefix_hashes(np.asarray([0, 2, 0, 2, 0]), np.asarray([3, 3, 4, 4, 5]))
    assert h[0] == h[1] and h[2] != h[3] and len(set(h.tolist())) == 4
    assert (a.prefix_hashes(np.asarray([1]), np.asarray([3])) != h[0]).all()  # positions count: a shifted copy differs
    assert (h != 0).all()


def test_records_round_trip_and_ladders_cover_full_blocks():
    units = _units()
    records = local_records(FlatUnits.of(units))
    again = decode(encode(*records))
    assert all(np.array_equal(x, y) for x, y in zip(records, again))
    assert (again[1]["blocks"] == again[1]["length"] // BLOCK).all()
    assert len(again[2]) == int(again[1]["blocks"].sum())


@pytest.mark.parametrize("cut", [1, 7, 20, 35])
def test_any_split_with_duplicates_merges_into_the_same_table(cut):
    units = _units()
    whole = _table([units])
    split = _table([units[:cut] + units[:3], units[cut - 1 :]])  # duplicates across and within ranks
    assert np.array_equal(whole.units, split.units) and np.array_equal(whole.ladder, split.ladder)
    assert np.array_equal(whole.inputs, split.inputs)
    holders = [tuple(split.holders[split.holder_ptr[i] : split.holder_ptr[i + 1]]) for i in range(len(split))]
    keys = FlatUnits.of(units).keys()
    ids = split.ids(keys)
    assert sorted(ids.tolist()) == list(range(len(units)))
    for k, i in enumerate(ids):
        expect = tuple(r for r, part in enumerate([units[:cut] + units[:3], units[cut - 1 :]]) if units[k] in part)
        assert holders[i] == expect


def test_one_key_with_two_different_records_is_a_collision():
    units = _units(questions=2)
    good = local_records(FlatUnits.of(units))
    bad = tuple(x.copy() for x in good)
    bad[0]["length"][0] += 1  # same key, other content: what a collision looks like
    with pytest.raises(HashCollision):
        GlobalTable([good, bad])


def test_prefix_hashes_do_not_depend_on_the_chunk_size(monkeypatch):
    import distperp_harness.planning.records as records

    rng = np.random.default_rng(0)
    flat = FlatUnits.of(
        [Unit(tuple(int(t) for t in rng.integers(5, 900, int(rng.integers(2, 120)))), 1) for _ in range(200)]
    )
    unit = rng.integers(0, 200, 1000)
    length = np.asarray([rng.integers(1, flat.lengths[i] + 1) for i in unit])
    whole = flat.prefix_hashes(unit, length)
    for chunk in (1, 7, 1000):
        monkeypatch.setattr(records, "CHUNK", chunk)
        assert np.array_equal(flat.prefix_hashes(unit, length), whole)
