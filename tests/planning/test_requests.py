"""Requests → units: lm-eval's rolling windows reproduced, the strided rule, canonical deduplication."""

import random

import pytest
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from distperp_harness.planning.requests import Unit, UnitTable, continuation_unit, window_units


def _hf_rolling(tokens, prefix, max_length):
    """What lm-eval's hf model feeds and scores: (input, scored targets) per window."""
    out = []
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, prefix, max_length, 1)):
        whole = (ctx + cont)[-(max_length + 1) :]
        out.append((whole[:-1], cont))
    return out


def _direct_strided(tokens, prefix, max_length, stride):
    """The issue's rule written out: block k scores seq[s+1..e] from seq[max(0, e-L):e]."""
    seq = [prefix] + list(tokens)
    n, blocks, k = len(tokens), [], 0
    while k * stride < n:
        s = k * stride
        e = min(s + stride, n)
        blocks.append((seq[max(0, e - max_length) : e], seq[s + 1 : e + 1]))
        k += 1
    return blocks


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 40, 100])
@pytest.mark.parametrize("max_length", [4, 16])
def test_default_windows_equal_lm_eval_rolling(n, max_length):
    tokens = list(range(10, 10 + n))
    ours = [(list(u.tokens[:-1]), list(u.tokens[-u.n_score :])) for u in window_units(tokens, 1, max_length)]
    assert ours == _hf_rolling(tokens, 1, max_length)


@pytest.mark.parametrize("stride", [1, 3, 8, 16])
def test_strided_windows_follow_the_rule(stride):
    rng = random.Random(stride)
    tokens = [rng.randrange(2, 50) for _ in range(57)]
    units = window_units(tokens, 0, 16, stride)
    direct = _direct_strided(tokens, 0, 16, stride)
    assert [(list(u.tokens[:-1]), list(u.tokens[-u.n_score :])) for u in units] == direct
    assert sum(u.n_score for u in units) == len(tokens)  # every token scored exactly once
    for k, u in enumerate(units):  # scored tokens see max_length - stride tokens of context (or all before them)
        context_of_first = u.input_length - u.n_score + 1
        assert context_of_first >= min(16 - stride + 1, k * stride + 1)


def test_stride_is_validated():
    with pytest.raises(ValueError, match="0 < stride <= max_length"):
        window_units([1, 2, 3], 0, 4, 5)


def test_continuation_unit_left_truncates_like_hf():
    unit = continuation_unit(list(range(100)), [7, 8, 9], max_length=10)
    assert unit.tokens == tuple(list(range(100)) + [7, 8, 9])[-11:] and unit.n_score == 3
    with pytest.raises(ValueError, match="max_length=2"):
        continuation_unit([1], [2, 3, 4], max_length=2)


def test_table_order_depends_only_on_the_set():
    rng = random.Random(0)
    units = [Unit(tuple(rng.randrange(9) for _ in range(rng.randrange(2, 9))), 1) for _ in range(40)]
    shuffled = units[:] + units[:5]
    rng.shuffle(shuffled)
    a, b = UnitTable(units), UnitTable(shuffled)
    assert a.units == b.units and len(a) == len(set(units))
    assert a.lengths == sorted(a.lengths, reverse=True)
    assert [a.units[i] for i in a.ids(units)] == units


def test_flat_units_round_trip():
    from distperp_harness.planning.records import FlatUnits

    units = [Unit((1, 2, 3), 2), Unit((4, 5), 1)]
    flat = FlatUnits.of(units)
    assert [flat.unit(i) for i in range(len(flat))] == units and flat.tokens.dtype.name == "int32"
