"""Lost peers, in real ``accelerate launch`` runs on gloo: a process that is killed or stopped says nothing, and
outside a collective nothing else would notice; the survivors' watches (``liveness``) name it within the bound, and
every survivor exits non-zero with no results written. The rules themselves are in ``test_liveness.py``."""

import os
import signal
import socket
import subprocess
import time

import pytest
from helpers import LOAD_CHECKS, LaunchOutputs, distperp_args, launch_one_node, start_two_nodes

from distperp_harness.distributed.failfast import SETTLE_QUIET_S
from distperp_harness.distributed.liveness import PROBE_REPLY_S, SUSPECT_S, silence_bound

pytestmark = pytest.mark.distributed

HOST = socket.gethostname()
POLL_SLACK_S = 2.0  # a poll of the watcher, one of every survivor, and the store's answers
SETTLE_S = SETTLE_QUIET_S + 0.5  # the acknowledgements settle, then the exit


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_survivor_named(text, survivor, lost, words, lost_stage, own_stage):
    line = f"distperp: rank {survivor} stops because rank {lost} ({HOST}) {words}"
    assert line in text, text[-4000:]
    said = text[text.index(line) :].split("\n", 1)[0]
    assert f"it was {lost_stage}" in said and f"(rank {survivor} was {own_stage}" in said, said
    assert "no results were written" in said


@pytest.mark.parametrize("layout", ["", ",tp_plan=auto"], ids=["data-parallel", "tensor-parallel"])
def test_node_1_killed_during_generation_is_named_gone_by_node_0_within_seconds(
    tiny_model_dir, tasks_dir, tmp_path, layout
):
    """Two loopback nodes of two processes. Data-parallel: every rank stalls in its first generation lane (a long
    decode step, longer than the bound: slow, not lost, and nobody is named). Tensor-parallel (one TP group a node):
    each group's leader stalls there while its member waits on it (for the leader's next decision or inside the
    forward's all-reduce). Then node 1 (its launcher and both workers) is SIGKILLed. Rank 1 watches rank 2: it names
    it gone, and rank 0 stops too, while both still sit where they were (no collective would have noticed before
    their ten-minute step ended), well within ``timeout=60``."""
    out = tmp_path / "out"
    args = distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=60" + layout, "dptest_chain", batch_size=1)
    holds = (
        [{"DISTPERP_TEST_HOLD_LANE": "0:1,1:1"}, {"DISTPERP_TEST_HOLD_LANE": "2:1,3:1"}]
        if not layout
        else [{"DISTPERP_TEST_HOLD_LANE": "0:1"}, {"DISTPERP_TEST_HOLD_LANE": "2:1"}]
    )
    run = LaunchOutputs(
        start_two_nodes(args, cwd=tmp_path, per_node=2, envs=holds, outputs=[subprocess.PIPE, subprocess.PIPE])
    )
    run.wait_for("distperp generate_until", timeout=240)
    time.sleep(silence_bound(60) + 2)  # every rank holds or waits, silent in the main thread, past the bound
    assert "stops because" not in run.texts[0] + run.texts[1], run.texts[0][-3000:]
    killed_at = time.monotonic()
    run.kill_node(1)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    for survivor in (0, 1):  # a TP member waiting on its leader is in the leader's lane too
        _assert_survivor_named(text, survivor, 2, "is gone: no heartbeat for", "generating (lane", "generating (lane")
    assert "noticed by rank 1" in text and "refuses connections (it was killed or crashed)" in text
    assert not list(out.rglob("results_*.json"))
    assert ended - killed_at < SUSPECT_S + POLL_SLACK_S + SETTLE_S + 10  # launcher's teardown included


@pytest.mark.parametrize("check", list(LOAD_CHECKS))
def test_node_1_killed_during_a_load_check_is_named_gone_by_node_0(tiny_model_dir, tasks_dir, tmp_path, check):
    """Two loopback nodes of one process: both stall in a check at load (the probe, or batch_invariant's check of the
    kernels: a forward of ten minutes), then node 1 is SIGKILLed. Rank 0 names rank 1 gone, both of them in that
    check, well within ``timeout=60``."""
    extra, variable, stage = LOAD_CHECKS[check]
    out = tmp_path / "out"
    args = distperp_args(tiny_model_dir, tasks_dir, out, f"{extra},timeout=60", "dptest_mc")
    holds = [{f"DISTPERP_TEST_HOLD_{variable}": "0:1"}, {f"DISTPERP_TEST_HOLD_{variable}": "1:1"}]
    run = LaunchOutputs(start_two_nodes(args, cwd=tmp_path, envs=holds, outputs=[subprocess.PIPE, subprocess.PIPE]))
    run.wait_for("Loading weights", timeout=240)
    time.sleep(silence_bound(60) + 2)  # both hold, silent in the main thread, past the bound: nobody is named yet
    assert "stops because" not in run.texts[0] + run.texts[1], run.texts[0][-3000:]
    killed_at = time.monotonic()
    run.kill_node(1)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    _assert_survivor_named(text, 0, 1, "is gone: no heartbeat for", stage, stage)
    assert not list(out.rglob("results_*.json"))
    assert ended - killed_at < SUSPECT_S + POLL_SLACK_S + SETTLE_S + 10


def test_a_non_zero_rank_killed_while_scoring_without_shard_size_is_named_gone(tiny_model_dir, tasks_dir, tmp_path):
    """Two nodes of one process, no ``shard_size``, ``timeout=600``: rank 0 stalls after its first batch (a long
    batch); rank 1's worker alone is SIGKILLed while scoring (its launcher then exits by itself). Rank 0 names it
    within seconds, where only the next collective (ten minutes on) would have failed."""
    out = tmp_path / "out"
    args = distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=600", "dptest_rolling", batch_size=1)
    run = LaunchOutputs(
        start_two_nodes(
            args,
            cwd=tmp_path,
            envs=[{"DISTPERP_TEST_HOLD": "0:1"}, {"DISTPERP_TEST_HOLD": "1:1"}],
            outputs=[subprocess.PIPE, subprocess.PIPE],
        )
    )
    run.wait_for("distperp loglikelihood_rolling", timeout=240)
    time.sleep(2.0)
    worker = run.workers(1)[1]
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    ended = run.wait_all(timeout=60)
    assert [p.returncode != 0 for p in run.procs] == [True, True]
    _assert_survivor_named(
        run.texts[0],
        0,
        1,
        "is gone: no heartbeat for",
        "planning, exchanging or gathering",
        "planning, exchanging or gathering loglikelihood_rolling",
    )
    assert not list(out.rglob("results_*.json"))
    assert ended - killed_at < SUSPECT_S + POLL_SLACK_S + SETTLE_S + 10


def test_node_1_killed_while_its_context_parallel_group_scores_is_named_gone(tiny_model_dir, tasks_dir, tmp_path):
    """Two loopback nodes of two processes, ``cp_size=2`` (one group a node, every row on the groups): every rank
    stalls after its group's first batch (a long batch), then node 1 (its launcher and its group) is SIGKILLed.
    Rank 1 names rank 2 gone and rank 0 stops too, within seconds of ``timeout=60``, no results written."""
    out = tmp_path / "out"
    args = distperp_args(
        tiny_model_dir, tasks_dir, out, ",cp_size=2,cp_min_tokens=1,timeout=60", "dptest_rolling", batch_size=1
    )
    holds = [{"DISTPERP_TEST_HOLD": "0:1,1:1"}, {"DISTPERP_TEST_HOLD": "2:1,3:1"}]
    run = LaunchOutputs(
        start_two_nodes(args, cwd=tmp_path, per_node=2, envs=holds, outputs=[subprocess.PIPE, subprocess.PIPE])
    )
    run.wait_for("distperp loglikelihood_rolling", timeout=240)
    time.sleep(2.0)  # every rank reaches its hold (holding past the bound names nobody: the generation test above)
    killed_at = time.monotonic()
    run.kill_node(1)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    assert f"distperp: rank 1 stops because rank 2 ({HOST}) is gone: no heartbeat for" in text, text[-4000:]
    assert f"distperp: rank 0 stops because rank 2 ({HOST})" in text, text[-4000:]
    assert not list(out.rglob("results_*.json"))
    assert ended - killed_at < SUSPECT_S + POLL_SLACK_S + SETTLE_S + 10


def test_a_stopped_rank_in_generation_is_named_unresponsive_within_the_bound(tiny_model_dir, tasks_dir, tmp_path):
    """One node of two processes, ``timeout=30`` (bound 10 s): rank 0 stalls in its first lane, rank 1 is stopped
    with SIGSTOP while generating (hung, not dead: its kernel still accepts connections). Rank 0 names it as
    unresponsive once the bound has passed, not before, and exits 1. (Its launcher would then end rank 1 with
    SIGTERM and, since a stopped process does not take it, SIGKILL after torch's 30 s grace: the test kills it as
    soon as rank 0 has exited.)"""
    out = tmp_path / "out"
    args = distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=30", "dptest_chain", batch_size=1)
    run = launch_one_node(args, tmp_path, {"DISTPERP_TEST_HOLD_LANE": "0:1"})
    run.wait_for("distperp generate_until", timeout=240)
    time.sleep(1.0)
    workers = run.workers(0)
    stopped = workers[1]
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.monotonic()
    named = run.wait_for("distperp: rank 0 stops because rank 1", timeout=60)
    bound = silence_bound(30)
    assert bound - 1 <= named - stopped_at <= bound + PROBE_REPLY_S + POLL_SLACK_S + 2
    deadline = time.monotonic() + 15
    while _alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(workers[0])  # rank 0 exited by itself: the launcher names it the root cause below
    os.kill(stopped, signal.SIGKILL)
    run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    root_cause = text[text.index("Root Cause") :]
    assert "rank      : 0 (local_rank: 0)" in root_cause and "exitcode  : 1 " in root_cause, root_cause
    _assert_survivor_named(text, 0, 1, "stopped responding: no heartbeat for ", "generating", "generating (lane")
    assert (
        f"s (the bound: {bound:.0f} s, from timeout) and its process accepts a connection but does not answer" in text
    )
    assert not list(out.rglob("results_*.json"))
