"""lanes.py: the generation plan is a pure function of the global jobs; slots follow each task's max_gen_toks; a
lane's shared prefix is the block most of its prompts start with."""

from __future__ import annotations

from distperp_harness.run.generation.lanes import LANE_ROUNDS, common_prefix, lane_prefix, plan_lanes


def _slots_for(budget: int):
    return lambda length: max(1, min(16, budget // length))


def _plan(prompts, groups, max_new, slots_for, min_shared):
    """Lanes planned with the exact shared prefix of each lane's prompts."""
    return plan_lanes(
        [len(p) for p in prompts], groups, max_new, slots_for, lambda a, b: lane_prefix(prompts[a:b], min_shared)
    )


def test_lanes_hold_rounds_of_slots_never_mix_arguments_and_cover_every_job():
    prompts = [[1, 2, 3, i] for i in range(40)] + [[7, i] for i in range(10)]
    groups = ["a"] * 40 + ["b"] * 10
    lanes = _plan(prompts, groups, [16] * 50, lambda length: 4, min_shared=2)
    assert [(lane.start, lane.stop) for lane in lanes] == [(0, 16), (16, 32), (32, 40), (40, 50)]
    assert all(lane.jobs <= LANE_ROUNDS * lane.slots for lane in lanes)
    assert all(len({groups[i] for i in range(lane.start, lane.stop)}) == 1 for lane in lanes)
    assert [lane.shared for lane in lanes] == [3, 3, 3, 0]  # the last group's common prefix is under 2 tokens


def test_slots_are_sized_for_the_prompt_and_the_tasks_new_tokens():
    prompts = [[5] * 100 for _ in range(8)]
    short = _plan(prompts, ["x"] * 8, [32] * 8, _slots_for(4096), min_shared=32)
    long = _plan(prompts, ["y"] * 8, [1280] * 8, _slots_for(4096), min_shared=32)
    assert short[0].slots == 8 and long[0].slots == 2  # 4096 // (100 + 1280)
    assert long[0].as_batch().padded_length == 100 + 1280  # the lane is costed with its new tokens


def test_the_shared_prefix_is_what_most_prompts_start_with():
    block = list(range(50))
    prompts = [[99] + block[1:] + [1]] + [block + [i, i] for i in range(6)]  # one prompt with other shots
    length, donor = lane_prefix(prompts, 32)
    assert length == 50 and prompts[donor][:50] == block
    assert lane_prefix(prompts, 51) == (0, 0)
    assert lane_prefix([block + [1]], 1) == (0, 0)  # one prompt: nothing to share
    assert lane_prefix([block, block + [3]], 1) == (49, 1)  # every prompt keeps a token of its own
    assert common_prefix(prompts, 1) == 0 and common_prefix(prompts[1:], 32) == 50
