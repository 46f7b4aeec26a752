"""``run/rules.py``: a generation lane keeps its slots under a length rule only where every length its rows reach
has one key; :func:`lane_slots` chooses a lane's slots and whether lanes share prompt prefixes."""

from distperp_harness.model.lengths import LengthRule
from distperp_harness.run.rules import lane_slots, one_slot, slots_within


def test_a_lane_keeps_its_slots_while_its_rows_stay_within_one_key():
    probe_cap = LengthRule(exact_above=2048)  # rows longer than the probe's longest share a forward only as long
    assert slots_within(probe_cap, lambda length: 8, 2048) == 8
    assert slots_within(probe_cap, lambda length: 8, 2049) == 1
    longrope = LengthRule(sides=(4096,))  # the factor switches past the original context
    assert slots_within(longrope, lambda length: 6, 700) == 6
    assert slots_within(longrope, lambda length: 6, 4097) == 1
    assert one_slot(10) == 1


def test_lane_slots_one_alone_the_rule_kept_apart_else_the_budget():
    def eight(length):
        return 8

    rows_for, share = lane_slots(eight, LengthRule(), alone=True)
    assert (rows_for(100), share) == (1, False)  # sequences decode alone: one slot, no shared prefix
    rows_for, share = lane_slots(eight, LengthRule(sides=(4096,)), alone=False)
    assert (rows_for(700), rows_for(4097), share) == (8, 1, False)  # lengths kept apart: slots within one key
    for uniform in (None, LengthRule()):
        rows_for, share = lane_slots(eight, uniform, alone=False)
        assert (rows_for(4097), share) == (8, True)
