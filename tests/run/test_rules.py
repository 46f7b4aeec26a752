"""``run/rules.py``: a generation lane keeps its slots under a length rule only where every length its rows reach
has one key."""

from distperp_harness.model.lengths import LengthRule
from distperp_harness.run.rules import one_slot, slots_within


def test_a_lane_keeps_its_slots_while_its_rows_stay_within_one_key():
    probe_cap = LengthRule(exact_above=2048)  # rows longer than the probe's longest share a forward only as long
    assert slots_within(probe_cap, lambda length: 8, 2048) == 8
    assert slots_within(probe_cap, lambda length: 8, 2049) == 1
    longrope = LengthRule(sides=(4096,))  # the factor switches past the original context
    assert slots_within(longrope, lambda length: 6, 700) == 6
    assert slots_within(longrope, lambda length: 6, 4097) == 1
    assert one_slot(10) == 1
