"""A failing rank stops every rank within seconds, named (failfast), and the control plane across nodes
(controlplane): the rules with fakes, then real ``accelerate launch`` runs on gloo."""

import subprocess
import sys
import time

import pytest

from distperp_harness.distributed import controlplane, failfast
from helpers import accelerate_launch_prefix, free_port, offline_env, run_command


class _Store:
    """The rendezvous store's ``set``/``get``/``check``/``add`` over a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])


class _Collective:
    distributed, rank, world_size = True, 1, 3


def test_the_first_failure_is_recorded_and_every_peer_stops_naming_it(monkeypatch):
    store = _Store()
    monkeypatch.setattr("distperp_harness.distributed.collective._default_store", lambda: store)
    monkeypatch.setattr(failfast, "ACK_WAIT_S", 0.0)
    stopped = []
    watches = [failfast.FailureWatch(store, r, poll_s=0.01, on_failure=stopped.append) for r in (0, 2)]
    with pytest.raises(ValueError, match="NaN"):
        with failfast.stop_together(_Collective(), "cuda:1"):
            raise ValueError("the model produced NaN/inf logits")
    failfast.publish(store, 2, 3, "RuntimeError: later", ack_wait_s=0)  # a second failure does not replace it
    record = failfast.read(store)
    assert record.startswith("rank 1 (") and "cuda:1" in record and "ValueError: the model produced NaN" in record
    for w in watches:
        w.start()
    deadline = time.monotonic() + 5
    while len(stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(stopped) == sorted(failfast.stop_message(r, record) for r in (0, 2))
    assert "rank 0 stops because rank 1 (" in stopped[0] + stopped[1] and "no results were written" in stopped[0]
    assert int(store.get(failfast.ACK_KEY)) == 2  # the failing rank waits for these before it exits


def test_a_broken_collective_is_not_recorded_as_a_failure_of_this_rank(monkeypatch):
    store = _Store()
    monkeypatch.setattr("distperp_harness.distributed.collective._default_store", lambda: store)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with failfast.stop_together(_Collective(), None):
            raise RuntimeError("[gloo] Connection closed by peer")
    assert failfast.read(store) is None
    failfast.publish(store, 0, 3, "torch.OutOfMemoryError: CUDA out of memory", ack_wait_s=0)
    with pytest.raises(RuntimeError, match=r"rank 1 stops because rank 0 failed while scoring: torch.OutOfMemory"):
        with failfast.stop_together(_Collective(), None):
            raise RuntimeError("[gloo] Connection closed by peer")


# -------------------------------------------------------------------------------------- control plane rules
def test_a_loopback_bind_on_several_hosts_is_refused_naming_address_variable_and_fix():
    entries = [("node-a", "10.0.0.1", "host name resolves"), ("node-a", "10.0.0.1", "x"),
               ("node-b", "127.0.1.1", "host name 'node-b' resolves to it (GLOO_SOCKET_IFNAME unset)")]
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
@pytest.mark.distributed
@pytest.mark.parametrize("forward", [1, 3])
def test_one_failing_rank_of_a_shard_group_stops_every_rank_within_seconds_named(tiny_model_dir, tasks_dir,
                                                                                 tmp_path, forward):
    """Rank 1 of a ``shard_size=2`` group raises before its n-th forward (its peer waits in the forward's first
    gather); with ``timeout=600`` only failfast can end the peer: it does within seconds, naming rank 1."""
    out = tmp_path / "out"
    args = ["-m", "lm_eval", "--model", "distperp", "--model_args",
            f"pretrained={tiny_model_dir},max_length=128,shard_size=2,timeout=600",
            "--tasks", "dptest_rolling,dptest_mc", "--include_path", str(tasks_dir), "--batch_size", "3",
            "--output_path", str(out)]
    t0 = time.monotonic()
    proc = run_command([*accelerate_launch_prefix(2), *args], cwd=tmp_path, check=False, timeout=300,
                       env={"DISTPERP_TEST_FAIL": f"1:{forward}"})
    elapsed = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 0 stops because rank 1 (" in text and "failed while scoring: RuntimeError: injected failure" in text, \
        text[-3000:]
    assert not list(out.rglob("results_*.json"))
    assert elapsed < 200  # loading and planning included; far below the 600 s timeout any gather would wait


@pytest.mark.distributed
def test_a_faked_loopback_bind_on_two_nodes_is_refused_at_start(tiny_model_dir, tasks_dir, tmp_path):
    port = free_port()
    args = ["-m", "lm_eval", "--model", "distperp", "--model_args", f"pretrained={tiny_model_dir},max_length=64",
            "--tasks", "dptest_mc", "--include_path", str(tasks_dir), "--output_path", str(tmp_path / "out")]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
         "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=offline_env({"DISTPERP_TEST_HOSTNAME": f"node{rank}",
                         **({"DISTPERP_TEST_GLOO_ADDRESS": "127.0.1.1"} if rank == 1 else {})}))
        for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode != 0
        assert "rank 1 on node1 binds to 127.0.1.1" in output and "GLOO_SOCKET_IFNAME=<interface>" in output, \
            output[-3000:]


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
    try:
        failfast.stop_watch(wait_s=5)
    finally:
        failfast._WATCH.remove(watch)
    assert not watch._thread.is_alive()
