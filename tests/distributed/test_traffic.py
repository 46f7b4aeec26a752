"""Counting collectives: both doors (eager ``torch.distributed`` calls and DTensor's functional collectives) on a
real two-rank gloo group, with ring receive factors; the fit of fixed and per-unit bytes."""

import pytest

from distperp_harness.distributed.traffic import CollectiveBytes, _fit, forward_traffic


def test_ring_factors_and_groups_of_one():
    c = CollectiveBytes()
    c.add("all_reduce", "reduce", 1000, 4)
    c.add("all_gather_single", "gather", 1000, 4)
    c.add("broadcast", "broadcast", 10, 2)
    c.add("all_reduce", "reduce", 1000, 1)  # a group of one moves nothing
    assert c.calls == 3 and c.payload == 2010 and c.received == pytest.approx(1500 + 750 + 10)
    assert c.by_op == {"all_reduce": 1000, "all_gather_single": 1000, "broadcast": 10}


def test_the_fit_separates_fixed_and_per_unit_bytes():
    assert _fit({8: 900.0, 1: 200.0}) == (100.0, 100.0)


def test_forward_traffic_fits_what_the_probes_moved():
    import contextlib

    seen = []

    def decode(rows):
        seen.append(("decode", rows))

    def score(tokens):
        seen.append(("score", tokens))

    out = forward_traffic(decode, score, contextlib.nullcontext)  # no collectives: zero, at every size
    assert seen == [("decode", 1), ("decode", 8), ("score", 32), ("score", 64)]
    assert out["decode_step_received_bytes"] == {"fixed": 0, "per_row": 0}
    assert out["scoring_received_bytes"] == {"fixed": 0, "per_token": 0}
