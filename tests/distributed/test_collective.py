"""The control plane with fakes: a collective that fails after it was queued, named missing ranks, the exit wait.

Real multi-process behaviour (timeouts, killed ranks, Ctrl-C, the control group's backend) is in
``tests/test_distributed.py``.
"""

from datetime import timedelta

import pytest
import torch

from distperp_harness.distributed import collective as coll
from distperp_harness.distributed.collective import AccelerateCollective, CollectiveError


class _Store:
    """The rendezvous store's ``set``/``check`` over a dict."""

    def __init__(self, present=()):
        self.keys = set(present)

    def set(self, key, value):
        self.keys.add(key)

    def check(self, keys):
        return all(k in self.keys for k in keys)


class _FailingWork:
    """What an NCCL collective returns: queued fine, fails when waited on."""

    def __init__(self):
        self.waited = None

    def wait(self, timeout=None):
        self.waited = timeout
        raise RuntimeError("NCCL communicator was aborted: watchdog timeout")


def _two_rank_collective(rank=0):
    c = AccelerateCollective.__new__(AccelerateCollective)  # no process group: the logic above the backend only
    c.rank, c.world_size, c.local_rank, c.num_nodes, c.timeout_s = rank, 2, rank, 1, 7.0
    c.backend, c._group, c._step = "nccl", object(), 0
    return c


def test_a_failure_at_wait_time_is_a_collective_error_naming_the_missing_rank(monkeypatch):
    store = _Store()
    monkeypatch.setattr(coll, "default_store", lambda: store)
    works = []

    def all_gather(out, tensor, group=None, async_op=False):
        work = _FailingWork()
        works.append(work)
        return work  # returns at once, as NCCL does; the error only shows at wait()

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    with pytest.raises(
        CollectiveError,
        match=r"'gather scores \(sizes\)' failed on rank 0 of 2 \(timeout 7 s\): "
        r"rank\(s\) \[1\] never arrived",
    ) as info:
        _two_rank_collective().all_gather_tensor(torch.zeros(3), name="gather scores")
    assert works and works[0].waited == timedelta(seconds=7)  # every wait bounded by the run's timeout
    assert "no results were written" in str(info.value) and "watchdog timeout" in str(info.value)


def test_every_collective_runs_on_the_control_group_with_cpu_tensors(monkeypatch):
    monkeypatch.setattr(coll, "default_store", lambda: _Store())
    c = _two_rank_collective()
    seen = []

    class _Done:
        def wait(self, timeout=None):
            return True

    def all_gather(out, tensor, group=None, async_op=False):
        seen.append((group, tensor.device.type, async_op))
        for o in out:
            o.copy_(tensor)
        return _Done()

    def barrier(group=None, async_op=False):
        seen.append((group, "cpu", async_op))
        return _Done()

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "barrier", barrier)
    parts = c.all_gather_tensor(torch.arange(4.0))
    assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0, 3.0]] * 2
    assert c.all_gather_object({"a": 1}) == [{"a": 1}, {"a": 1}]
    c.barrier()
    assert seen and all(g is c._group and dev == "cpu" and async_op for g, dev, async_op in seen)


def test_a_dead_store_host_is_named(monkeypatch):
    class _DeadStore:
        def set(self, key, value):
            raise RuntimeError("connection reset")

    monkeypatch.setattr(coll, "default_store", lambda: _DeadStore())
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None, async_op=False: _FailingWork())
    with pytest.raises(
        CollectiveError, match=r"the rendezvous store, served by .* is unreachable from rank 1: rank 0 or node 0"
    ):
        _two_rank_collective(rank=1).barrier("lm-eval barrier")


def test_exit_waits_on_the_control_group_with_a_bounded_monitored_barrier(monkeypatch):
    calls = []
    group = object()
    monkeypatch.setattr(coll, "_FAILED", False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.distributed,
        "monitored_barrier",
        lambda group=None, timeout=None, wait_all_ranks=False: calls.append((group, timeout, wait_all_ranks)),
    )
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroyed"))
    monkeypatch.setattr(coll, "stop_watch", lambda: calls.append("watch stopped"))
    coll._leave_group(1800.0, group)
    # the failure watch (a thread in store calls) ends before the teardown and before the interpreter ends threads
    assert calls == [(group, timedelta(seconds=60), True), "watch stopped", "destroyed"]
    calls.clear()
    coll._leave_group(5.0, group)
    assert calls[0][1] == timedelta(seconds=5)


def test_a_failing_rank_leaves_without_waiting(monkeypatch):
    monkeypatch.setattr(coll, "_FAILED", True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "monitored_barrier", lambda **kw: pytest.fail("must not wait"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *a: pytest.fail("must not wait"))
    exits = []
    monkeypatch.setattr(coll.os, "_exit", exits.append)
    coll._leave_group(1800.0, object())
    assert exits == [1]  # at once: no destructor of a process group may wait for a lost peer


_JOB = r"""
import json, sys
import numpy as np, torch
from distperp_harness.distributed.collective import AccelerateCollective

c = AccelerateCollective(60, cpu=True)
r, w = c.rank, c.world_size
parts = [np.arange(r * 10 + d, dtype=np.int32) for d in range(w)]  # rank r sends r*10+d values to rank d
got = c.exchange(parts, [s * 10 + r for s in range(w)], "test exchange")
before = c.bytes_received
uneven = c.all_gather_tensor(torch.full((r + 1, 2), float(r)), "test uneven gather")
uneven_bytes = c.bytes_received - before
before = c.bytes_received
objects = c.gather_object({"rank": r, "pad": "x" * (1000 * r)}, 1, "test gather to one rank")
out = {"exchange": [g.tolist() for g in got], "uneven": [u.tolist() for u in uneven],
       "uneven_bytes": uneven_bytes, "objects": objects, "object_bytes": c.bytes_received - before}
with open(sys.argv[1] + f".{r}", "w") as f:
    json.dump(out, f)
"""


def test_exchange_uneven_gathers_and_gather_to_one_rank_move_no_padding(tmp_path):
    """Three real gloo ranks: the all-to-all delivers exactly what was addressed, parts of different sizes travel
    unpadded, and ``gather_object`` sends payloads to ``dst`` only."""
    import json
    import subprocess
    import sys

    from tests.helpers import free_port, offline_env

    job = tmp_path / "job.py"
    job.write_text(_JOB)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "3",
            "--master_port",
            str(free_port()),
            str(job),
            str(out),
        ],
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    for r, res in enumerate(results):
        assert res["exchange"] == [list(range(s * 10 + r)) for s in range(3)]
        assert res["uneven"] == [[[float(s)] * 2] * (s + 1) for s in range(3)]
        others = sum((s + 1) * 2 * 4 for s in range(3) if s != r)  # float32 rows of the other ranks, unpadded
        assert res["uneven_bytes"] == others + 8 * 2
        if r == 1:
            assert [o["rank"] for o in res["objects"]] == [0, 1, 2]
            assert res["object_bytes"] > 2000
        else:
            assert res["objects"] is None and res["object_bytes"] == 16  # only the sizes reached this rank
