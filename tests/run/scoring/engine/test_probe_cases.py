"""The probe's cases (:mod:`distperp_harness.run.scoring.engine.probe_cases`): what a run's forwards do, at its own
shapes, within every region of lengths that share a key, each unit reading its own input."""

import pytest
from helpers import check_row_reads

from distperp_harness.model.lengths import LengthRule
from distperp_harness.run.scoring.engine.probe_cases import MIN_REGION, Target, cases, regions


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (LengthRule(), [(1, 256)]),
        (LengthRule((32,)), [(1, 32), (33, 256)]),
        (LengthRule((32,), 100), [(1, 32), (33, 100)]),
        (LengthRule((5,)), [(6, 256)]),  # a region shorter than MIN_REGION is not probed on its own
    ],
)
def test_regions_follow_the_length_rule(rule, expected):
    assert regions(Target(256, 512, lengths=rule)) == expected
    assert all(high - low + 1 >= MIN_REGION for low, high in expected)


def _region_of(length, target):
    return next((low, high) for low, high in regions(target) if low <= length <= high)


@pytest.mark.parametrize("rule", [LengthRule(), LengthRule((40,)), LengthRule((40,), 90)])
def test_every_case_stays_in_one_region_and_its_units_read_their_inputs(rule):
    target = Target(128, 256, lengths=rule)
    built = cases(target, vocab=500)
    kinds = {case.kind for case in built}
    assert {"tree", "padded", "cached"} <= kinds
    assert ("same length" in kinds) == (rule.exact_above is not None)
    for case in built:
        units = case.units
        assert units
        lengths = [u.input_length for u in units]
        if case.kind == "same length":
            assert len(set(lengths)) == 1 and lengths[0] > rule.exact_above
            continue
        assert len({_region_of(n, target) for n in lengths}) == 1, (case.what, lengths)
        assert case.columns <= max(target.tree_tokens, target.max_length)
        for rows, shared in case.batches:
            check_row_reads(list(rows), [u for row in rows for u in row.units])
            assert all(row.tokens()[:shared] == rows[0].tokens()[:shared] for row in rows)


def test_trees_reach_past_their_paths_and_padded_batches_mix_lengths():
    """The wide tree's columns run far past its paths (a model reading columns shows it); the deep tree's paths reach
    the region's end within the width; the padded batch holds rows of several lengths, the longest the region's."""
    built = cases(Target(200, 512), vocab=500)
    trees = [c for c in built if c.kind == "tree"]
    wide, deep = trees[0], trees[1]
    ((rows, _),) = wide.batches
    assert rows[0].packed and wide.columns > 4 * max(u.input_length for u in wide.units)
    assert max(u.input_length for u in deep.units) == 200
    ((padded, _),) = next(c for c in built if c.kind == "padded").batches
    assert len({row.length for row in padded}) >= 3 and max(row.length for row in padded) == 200
    ((cached, shared),) = next(c for c in built if c.kind == "cached").batches
    assert len(cached) >= 2 and shared >= 2


def test_cases_are_the_same_on_every_call():
    first, second = cases(Target(128, 256), 300), cases(Target(128, 256), 300)
    assert [[u.tokens for u in c.units] for c in first] == [[u.tokens for u in c.units] for c in second]


def test_a_run_without_trees_batches_or_caches_probes_a_short_row_alone_only():
    """Every run pads a short row to 16 positions: that case is always probed (a model that is not causal fails it)."""
    assert [c.kind for c in cases(Target(128, 0, batched=False, cached=False), 300)] == ["alone"]
    assert {c.kind for c in cases(Target(128, 0, batched=True, cached=False), 300)} == {"alone", "padded"}
