"""A failing rank stops every rank within seconds, named (failfast), and the control plane across nodes
(controlplane): the rules with fakes, then real ``accelerate launch`` runs on gloo."""

import re
import socket
import subprocess
import threading
import time

import pytest
from helpers import (
    LOAD_CHECKS,
    TASKS_DIR,
    DictStore,
    LaunchOutputs,
    accelerate_launch_prefix,
    distperp_args,
    free_port,
    launch_one_node,
    offline_env,
    start_two_nodes,
)

from distperp_harness.distributed import controlplane, failfast


class _Collective:
    distributed, rank, world_size = True, 1, 3


@pytest.fixture(autouse=True)
def _fresh_process_record(monkeypatch):
    """Each test is a fresh process as far as failfast knows: nothing published yet, no watch."""
    monkeypatch.setitem(failfast._PLACE, "published", False)
    monkeypatch.setattr(failfast, "_WATCH", [])


def test_the_first_failure_is_recorded_and_every_peer_stops_naming_it(monkeypatch):
    store = DictStore()
    monkeypatch.setattr(failfast, "default_store", lambda: store)
    monkeypatch.setattr(failfast, "ACK_WAIT_S", 0.0)
    stopped = []
    watches = [failfast.FailureWatch(store, r, poll_s=0.01, on_failure=stopped.append) for r in (0, 2)]
    with pytest.raises(ValueError, match="NaN"), failfast.stop_together(_Collective(), "cuda:1"):
        raise ValueError("the model produced NaN/inf logits")
    failfast.publish(store, 2, 3, "RuntimeError: later", ack_wait_s=0)  # a second failure does not replace it,
    assert int(store.get(failfast.ACK_KEY)) == 1  # and acknowledges the first: nobody waits for a failing rank
    record = failfast.read(store)
    assert record.startswith("rank 1 (") and "cuda:1" in record and "ValueError: the model produced NaN" in record
    for w in watches:
        w.start()
    deadline = time.monotonic() + 5
    while len(stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(stopped) == sorted(failfast.stop_message(r, record, failfast.current_stage()) for r in (0, 2))
    assert "rank 0 stops because rank 1 (" in stopped[0] + stopped[1] and "no results were written" in stopped[0]
    assert int(store.get(failfast.ACK_KEY)) == 3  # the first failing rank waits for world_size - 1 of these


def test_a_broken_collective_is_not_recorded_as_a_failure_of_this_rank(monkeypatch):
    store = DictStore()
    monkeypatch.setattr(failfast, "default_store", lambda: store)
    with pytest.raises(RuntimeError, match="Connection closed by peer"), failfast.stop_together(_Collective(), None):
        raise RuntimeError("[gloo] Connection closed by peer")
    assert failfast.read(store) is None
    failfast.publish(store, 0, 3, "torch.OutOfMemoryError: CUDA out of memory", ack_wait_s=0)
    stops = r"rank 1 stops because rank 0 failed while scoring: torch.OutOfMemory"
    with pytest.raises(RuntimeError, match=stops), failfast.stop_together(_Collective(), None):
        raise RuntimeError("[gloo] Connection closed by peer")


def test_the_watch_is_not_queued_behind_a_store_call_of_the_main_thread():
    """Why each watch has a store client of its own: one store client serializes its calls, so a watch sharing the
    main thread's client would wait behind its blocking ``get`` (a shard group's step that a failed rank 0 never
    announces). The watch polls on a clone: it sees the record while the main thread still waits."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    client = PrefixStore("default_pg", TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=3)))
    # the blocked get ends with whatever the store raises at its timeout: the thread only has to end
    never = "a step never announced"
    blocked = threading.Thread(target=lambda: pytest.raises(Exception, client.get, never))  # noqa: B017 - any error
    blocked.start()
    time.sleep(0.3)
    stopped = []
    watch = failfast.FailureWatch(client, 1, poll_s=0.05, on_failure=stopped.append).start()
    t0 = time.monotonic()
    failfast.publish(client.clone(), 0, 2, "ValueError: the model produced NaN/inf logits", ack_wait_s=3)
    assert stopped and "rank 1 stops because rank 0 failed while scoring: ValueError" in stopped[0]
    assert time.monotonic() - t0 < 2 and blocked.is_alive()  # acknowledged while the main thread still waits
    watch.stop(1)
    blocked.join()


def test_a_store_that_goes_away_is_read_as_rank_0_gone_unless_this_process_is_leaving():
    class _GoneStore:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    stopped = []
    failfast.FailureWatch(_GoneStore(), 1, poll_s=0.01, on_failure=stopped.append).start()._thread.join(5)
    assert len(stopped) == 1 and stopped[0].startswith("distperp: rank 1 stops because the rendezvous store, served")
    assert "unreachable from rank 1: rank 0 or node 0 (its launcher, its host)" in stopped[0]
    leaving = failfast.FailureWatch(_GoneStore(), 1, poll_s=0.01, on_failure=stopped.append)
    leaving.closing = True
    leaving.start()._thread.join(5)
    assert len(stopped) == 1


def test_one_classifier_of_broken_collectives():
    from distperp_harness.distributed.store import CollectiveError, is_distributed_failure

    assert is_distributed_failure(CollectiveError("anything"))
    assert is_distributed_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not is_distributed_failure(ValueError("the model produced NaN/inf logits while scoring the window"))
    assert not is_distributed_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def _last_chance_hook(monkeypatch, rank: int, world_size: int) -> tuple[DictStore, list]:
    """A rank's place in the world, its failure watch (not started) on a local store, and the exits it asks for."""
    store = DictStore()
    monkeypatch.setattr(failfast, "default_store", lambda: store)
    monkeypatch.setattr(failfast, "ACK_WAIT_S", 0.0)
    monkeypatch.setattr(failfast, "_WATCH", [failfast.FailureWatch(store, rank)])
    monkeypatch.setitem(failfast._PLACE, "rank", rank)
    monkeypatch.setitem(failfast._PLACE, "world_size", world_size)
    exits: list = []
    monkeypatch.setattr(failfast.os, "_exit", exits.append)
    return store, exits


def test_an_error_outside_every_stage_is_published_from_the_last_chance_hook(monkeypatch):
    store, exits = _last_chance_hook(monkeypatch, 2, 3)
    monkeypatch.setitem(failfast._PLACE, "device", "cuda:2")
    failfast.uncaught(KeyError("doc_to_text"))
    record = failfast.read(store)
    assert record.startswith("rank 2 (") and "cuda:2) failed while running the evaluation: KeyError" in record
    assert store.check([failfast.DONE_KEY]) and exits == [1]  # peers may go; this rank leaves first
    failfast._PLACE["published"] = False
    failfast.uncaught(KeyboardInterrupt())  # Ctrl-C: nothing to publish, and the store host may leave first
    assert failfast._WATCH[0].closing and exits == [1]


@pytest.mark.parametrize("same", [True, False])
def test_an_input_error_is_said_once(monkeypatch, capsys, same):
    """An input error every rank meets alike (the command line, an agreed answer) is nobody's failure: nothing is
    published, and rank 0 alone prints it (errors.one_line); one that this rank alone meets is published for the
    peers, its one line (``distperp: error (rank R): ...``) printed by the input-error hook, not a second time here."""
    from distperp_harness.errors import InputError

    store, exits = _last_chance_hook(monkeypatch, 1, 2)
    failfast.uncaught(InputError("cp_size=3 is not valid with 2 process(es)", same_on_every_rank=same))
    record = failfast.read(store)
    assert capsys.readouterr().err == ""
    if same:
        assert record is None and exits == []
    else:
        assert "failed while running the evaluation: InputError: cp_size=3" in record and exits == [1]
    failfast._PLACE["published"] = False


# -------------------------------------------------------------------------------------- control plane rules
def test_a_loopback_bind_on_several_hosts_is_refused_naming_address_variable_and_fix():
    entries = [
        ("node-a", "10.0.0.1", "host name resolves"),
        ("node-a", "10.0.0.1", "x"),
        ("node-b", "127.0.1.1", "host name 'node-b' resolves to it (GLOO_SOCKET_IFNAME unset)"),
    ]
    problem = controlplane.binding_problem(entries)
    assert "rank 2 on node-b binds to 127.0.1.1" in problem and "GLOO_SOCKET_IFNAME=<interface>" in problem
    assert "NCCL_SOCKET_IFNAME" in problem and "ip -brief addr" in problem
    assert controlplane.binding_problem([(h, "10.0.0.9", "") for h in ("a", "b")]) is None
    assert controlplane.binding_problem([("a", "127.0.0.1", ""), ("a", "127.0.0.1", "")]) is None  # one host: fine


def test_bound_address_follows_the_variable_then_the_host_name(monkeypatch):
    monkeypatch.delenv("DISTPERP_TEST_GLOO_ADDRESS", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    address, how = controlplane.bound_address()
    assert controlplane.is_loopback(address) and how == "GLOO_SOCKET_IFNAME=lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(controlplane.socket, "gethostname", lambda: "no-such-host.invalid")
    address, how = controlplane.bound_address()
    assert address == "127.0.0.1" and "does not resolve" in how


# ------------------------------------------------------------------------------------------ real launches
def _assert_named(text, *, peer, failing, stage, host="", device="cpu", failing_text=None):
    """The peer's last words (in ``text``) name the failing rank, its host and device, the stage and the cause; the
    failing rank (in ``failing_text``, default ``text``) said it failed."""
    where = f"{host}, {device}" if host else ""
    assert f"distperp: rank {peer} stops because rank {failing} ({where}" in text, text[-4000:]
    assert f"failed while {stage}: RuntimeError: injected failure for tests" in text, text[-4000:]
    failing_text = text if failing_text is None else failing_text
    assert f"distperp: rank {failing} (" in failing_text and "Telling the other ranks, which stop now." in failing_text


@pytest.mark.distributed
def test_one_failing_rank_of_a_shard_group_stops_every_rank_within_seconds_named(tiny_model_dir, tasks_dir, tmp_path):
    """Rank 1 of a ``shard_size=2`` group raises before its 3rd forward (its peer waits in the forward's first
    gather); with ``timeout=600`` only failfast can end the peer: it does within seconds, naming rank 1."""
    failing = 1
    out = tmp_path / "out"
    run = launch_one_node(
        distperp_args(tiny_model_dir, tasks_dir, out, ",shard_size=2,timeout=600"),
        tmp_path,
        {"DISTPERP_TEST_FAIL": "1:3"},
    )
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    _assert_named(text, peer=1 - failing, failing=failing, stage="scoring")
    root_cause = text[text.index("Root Cause") :]  # the failing rank exited first: its launcher names it
    assert f"rank      : {failing} (local_rank: {failing})" in root_cause, root_cause
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30  # far below the 600 s any gather or store call would wait


@pytest.mark.distributed
@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("check", list(LOAD_CHECKS))
def test_a_rank_failing_at_a_load_check_stops_its_peer_named(tiny_model_dir, tasks_dir, tmp_path, failing, check):
    """Two checks at load run forwards and gathers: the probe (the scoring paths; with sharded weights its forwards
    gather them) and ``batch_invariant=true``'s check of the kernels (the ranks agree on its outcome). A rank that
    raises before either (rank 0, the store's host, or rank 1) leaves its peer waiting with ``timeout=600``;
    failfast ends it within seconds, naming the failing rank and the check."""
    extra, variable, stage = LOAD_CHECKS[check]
    extra += ",shard_size=2" if check == "probe" else ""  # the probe's forwards then gather sharded weights
    out = tmp_path / "out"
    run = launch_one_node(
        distperp_args(tiny_model_dir, tasks_dir, out, f"{extra},timeout=600", tasks="dptest_mc"),
        tmp_path,
        {f"DISTPERP_TEST_FAIL_{variable}": f"{failing}:1"},
    )
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    assert run.procs[0].returncode != 0
    _assert_named(run.texts[0], peer=1 - failing, failing=failing, stage=stage)
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30


_NAN_DOCS = [
    "Zyzzyva quokka marmoset. Zyzzyva quokka marmoset. Zyzzyva quokka marmoset.",  # its batch: rank 0's
    "The river was high after the rain.",
]


def _nan_model_and_task(model_dir, tmp_path):
    """A copy of the test model whose input embedding row of one token of ``_NAN_DOCS[0]`` (not in the other) is
    NaN, and a rolling task of the two documents (one window, one batch each with ``batch_size=1``)."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    poisoned = sorted(set(tokenizer(_NAN_DOCS[0])["input_ids"][:-1]) - set(tokenizer(_NAN_DOCS[1])["input_ids"]))[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    tokenizer.save_pretrained(tmp_path / "nan_model")
    tasks = shutil.copytree(TASKS_DIR, tmp_path / "tasks")
    (tasks / "dptest_nan.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _NAN_DOCS))
    (tasks / "dptest_nan.yaml").write_text(
        (tasks / "dptest_rolling.yaml")
        .read_text()
        .replace("task: dptest_rolling", "task: dptest_nan")
        .replace("dptest_rolling.jsonl", "dptest_nan.jsonl")
    )
    return tmp_path / "nan_model", tasks


@pytest.mark.distributed
def test_nan_logits_on_rank_0_only_are_named_by_rank_1(tiny_model_dir, tmp_path):
    """``shard_size=2,timeout=600``, only rank 0's window gives non-finite logits. Rank 0's
    error stays as clear as in one process (the window's text); rank 1, which then waits in the store's ``get``
    for the group's next step, names rank 0 within seconds. (With the watch on the main thread's store client, as
    before, its poll queued behind that ``get``: rank 1 died of the launcher's SIGTERM, unnamed.)"""
    model, tasks = _nan_model_and_task(tiny_model_dir, tmp_path)
    out = tmp_path / "out"
    args = [
        "-m",
        "lm_eval",
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model},max_length=128,shard_size=2,timeout=600",
        "--tasks",
        "dptest_nan",
        "--include_path",
        str(tasks),
        "--batch_size",
        "1",
        "--output_path",
        str(out),
    ]
    run = launch_one_node(args, tmp_path, {})
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert run.procs[0].returncode != 0
    assert "distperp: rank 1 stops because rank 0 (" in text, text[-4000:]
    assert (
        "failed while scoring: ValueError: the model produced NaN/inf logits while scoring the window 'Zyzzyva" in text
    )
    assert "Try dtype=float32, or check the checkpoint." in text  # rank 0's own traceback, as in one process
    assert "rank      : 0 (local_rank: 0)" in text[text.index("Root Cause") :]  # rank 0 exited first
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30


@pytest.mark.distributed
def test_rank_0_failing_while_planning_on_two_nodes_is_named_on_the_other_node(tiny_model_dir, tasks_dir, tmp_path):
    """Rank 0 (node 0: the store's host) raises at the start of a scoring call while rank 1, on another node with
    no launcher that saw it, waits in the exchange of units (``timeout=600``)."""
    out = tmp_path / "out"
    env = {"DISTPERP_TEST_FAIL_PLANNING": "0:1"}
    run = LaunchOutputs(
        start_two_nodes(
            distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=600", tasks="dptest_mc"),
            cwd=tmp_path,
            envs=[env, env],
            outputs=[subprocess.PIPE, subprocess.PIPE],
        )
    )
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    assert [p.returncode != 0 for p in run.procs] == [True, True]
    _assert_named(
        run.texts[1],
        peer=1,
        failing=0,
        host=socket.gethostname(),
        failing_text=run.texts[0],
        stage="planning, exchanging or gathering loglikelihood",
    )
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30


@pytest.mark.distributed
@pytest.mark.parametrize(
    "failing, variable, stage, extra",
    [
        (0, "DISTPERP_TEST_FAIL_LANE", "generating (lane ", ""),
        (1, "DISTPERP_TEST_FAIL_GENERATION", "generating", ""),
        (
            0,
            "DISTPERP_TEST_FAIL_GROUP_STEP",
            "generating on a context-parallel group (lane ",
            ",cp_size=2,cp_min_tokens=1",
        ),
        (
            1,
            "DISTPERP_TEST_FAIL_GROUP_STEP",
            "generating on a context-parallel group (lane ",
            ",cp_size=2,cp_min_tokens=1",
        ),
    ],
    ids=["lane-0", "call-1", "group-step-0", "group-step-1"],
)
def test_a_rank_failing_in_generation_stops_its_peer_named(
    tiny_model_dir, tasks_dir, tmp_path, failing, variable, stage, extra
):
    """``generate_until`` runs inside the channel, and so does every lane: the peer (generating its share, or
    waiting in generation's gathers) ends within seconds, naming the failing rank, rank 0 (the store's node)
    included, and the lane it was generating (rank 0 in a lane; rank 1 at the call's start). With ``cp_size=2``
    (one group, every prompt on it) either member failing at a decode step over the split cache stops the other,
    waiting for it in the step's all-gather."""
    out = tmp_path / "out"
    run = launch_one_node(
        distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=600" + extra, tasks="dptest_chain"),
        tmp_path,
        {variable: f"{failing}:1"},
    )
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    assert run.procs[0].returncode != 0
    text = run.texts[0]
    if stage.endswith("(lane "):  # the lane's number and size follow
        assert f"failed while {stage}" in text and "): RuntimeError: injected failure for tests" in text
        stage = text.split("failed while ", 1)[1].split("): RuntimeError", 1)[0] + ")"
    _assert_named(text, peer=1 - failing, failing=failing, stage=stage)
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30


@pytest.mark.distributed
def test_node_0_killed_mid_run_ends_node_1_naming_the_store_host(tiny_model_dir, tasks_dir, tmp_path):
    """Node 0's launcher (the store's host) and rank 0 die with SIGKILL while rank 0 scores (it holds after its
    first batch); rank 1, alone on node 1, must end within ``timeout=20`` saying node 0 / rank 0 is gone, in one
    line (no traceback, no C++ frames)."""
    out = tmp_path / "out"
    run = LaunchOutputs(
        start_two_nodes(
            distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=20"),
            cwd=tmp_path,
            envs=[{"DISTPERP_TEST_HOLD": "0:1"}, {}],
            outputs=[subprocess.PIPE, subprocess.PIPE],
        )
    )
    run.wait_for("distperp loglikelihood", timeout=240)  # rank 0's progress bar: scoring has begun
    time.sleep(1.0)
    killed_at = time.monotonic()
    run.kill_node(0)
    ended = run.wait_all(timeout=60)
    text = run.texts[1]
    assert run.procs[1].returncode != 0, text[-4000:]
    assert "the rendezvous store, served by the launcher of node 0 (with rank 0), at 127.0.0.1:" in text, text[-4000:]
    assert "is unreachable from rank 1: rank 0 or node 0" in text
    # one line from the rank, not torch's store-client traceback or c10d's warnings with C++ frames (the launcher
    # of node 1 still prints its own summary of the failed worker)
    assert text.count("distperp: rank 1 stops because") == 1, text[-4000:]
    assert not re.search(r"\[rank\d+\]: Traceback", text) and "frame #" not in text, text[-4000:]
    assert not list(out.rglob("results_*.json"))
    assert ended - killed_at < 20 + 5  # within the timeout (the watch sees the store gone in about 2 s)


@pytest.mark.distributed
def test_a_faked_loopback_bind_on_two_nodes_is_refused_at_start(tiny_model_dir, tasks_dir, tmp_path):
    port = free_port()
    args = [
        "-m",
        "lm_eval",
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={tiny_model_dir},max_length=64",
        "--tasks",
        "dptest_mc",
        "--include_path",
        str(tasks_dir),
        "--output_path",
        str(tmp_path / "out"),
    ]
    procs = [
        subprocess.Popen(
            [*accelerate_launch_prefix(2, port, num_machines=2, machine_rank=rank), *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=offline_env(
                {
                    "DISTPERP_TEST_HOSTNAME": f"node{rank}",
                    **({"DISTPERP_TEST_GLOO_ADDRESS": "127.0.1.1"} if rank == 1 else {}),
                }
            ),
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    said = "rank 1 on node1 binds to 127.0.1.1"  # every rank meets it alike: rank 0 says it, once for the launch
    assert said in outputs[0] and "GLOO_SOCKET_IFNAME=<interface>" in outputs[0], outputs[0][-3000:]
    assert said not in outputs[1] and "distperp: error" not in outputs[1], outputs[1][-3000:]


def test_stopping_the_watch_waits_for_its_thread():
    import threading

    class _SlowStore:
        entered = threading.Event()

        def check(self, keys):
            self.entered.set()
            time.sleep(0.2)  # inside a store call when asked to stop
            return False

    watch = failfast.FailureWatch(_SlowStore(), 1, poll_s=0.01).start()
    assert _SlowStore.entered.wait(5)
    failfast._WATCH.append(watch)
    failfast.stop_watch(wait_s=5)
    assert not watch._thread.is_alive()


@pytest.mark.distributed
@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_failing_to_load_stops_every_rank_named(tiny_model_dir, tasks_dir, tmp_path, failing):
    """The load is followed by an agreement (every rank's outcome gathered): a rank whose load fails (rank 0, the
    store's host, or rank 1) raises its own error, named once by that rank, and the other stops within seconds of
    ``timeout=600`` without reporting the agreement's ``StepFailed`` as a failure of its own (rank 0 names the
    failing rank once more, with the fix; rank 1 is silent); no results written."""
    out = tmp_path / "out"
    run = launch_one_node(
        distperp_args(tiny_model_dir, tasks_dir, out, ",timeout=600", tasks="dptest_mc"),
        tmp_path,
        {"DISTPERP_TEST_FAIL_LOAD": f"{failing}:1"},
    )
    started = time.monotonic()
    ended = run.wait_all(timeout=240)
    text = run.texts[0]
    assert run.procs[0].returncode != 0, text[-3000:]
    own = rf"distperp: rank {failing} \([^)]*\) failed while running the evaluation: RuntimeError: injected failure"
    assert len(re.findall(own, text)) == 1, text[-3000:]  # the failing rank names itself, once
    assert "StepFailed" not in text, text[-3000:]  # the peer does not report the agreement as a failure of its own
    if failing == 1:  # rank 0 says why it stops, with the fix (or its watch saw rank 1's record first)
        assert "distperp: error: rank 1 (" in text or "distperp: rank 0 stops because rank 1 (" in text, text[-3000:]
    assert not list(out.rglob("results_*.json"))
    assert ended - started < 120  # far below the 600 s a gather would wait
