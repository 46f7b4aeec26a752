"""Liveness: the bound, the probe's answers on real sockets, the watcher's verdicts on a fake clock, O(1) store
calls per poll, and watch threads over a real TCPStore naming a lost peer. The real launches (a node killed, a rank
killed, a rank stopped) are in ``test_failfast.py``."""

import socket
import threading
import time
from datetime import timedelta

import pytest
from helpers import DictStore

from distperp_harness.distributed import failfast, liveness
from distperp_harness.distributed.liveness import LEFT, Liveness, Peer, Probe


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_bound_is_a_sixth_of_timeout_within_10_and_60_s():
    assert liveness.silence_bound(60) == 10 and liveness.silence_bound(120) == 20
    assert liveness.silence_bound(1800) == 60 and liveness.silence_bound(30) == 10
    assert liveness.silence_bound(4) == 10  # never under ten polls: a live watch may be held by a probe of its own


def test_the_probe_tells_a_live_a_gone_and_a_stopped_process_apart():
    peer, sock = liveness.me("here", "127.0.0.1")
    assert peer.port and peer.address == "127.0.0.1"
    stop = threading.Event()

    def serve():  # a watch thread, answering between its polls
        while not stop.wait(0.05):
            liveness.answer(sock, 7)

    threading.Thread(target=serve, daemon=True).start()
    assert liveness.probe(peer) is Probe.ALIVE
    stop.set()
    sock.close()  # the process is gone: nobody listens on its port, its host answers
    assert liveness.probe(peer) is Probe.REFUSED
    silent = socket.socket()  # a process that does not run: its kernel accepts, nobody answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    assert liveness.probe(Peer("here", 1, "127.0.0.1", silent.getsockname()[1]), reply_s=0.3) is Probe.NO_REPLY
    silent.close()
    assert liveness.probe(Peer("here", 1)) is Probe.UNKNOWN


def _watcher(store, clock, outcomes, world_size=4, rank=1, bound_s=10.0):
    """Rank ``rank``'s liveness; its peer (``rank + 1``) published where it runs and its stage."""
    peer = (rank + 1) % world_size
    store.set(liveness.PEER_KEY.format(peer), Peer("node-b", 77, "10.0.0.2", 5000).encode())
    store.set(liveness.STAGE_KEY.format(peer), b"generating (lane 3, 8 prompts)")
    probed = []

    def probe_of(p):
        probed.append(p)
        return outcomes.pop(0)

    live = Liveness(
        store, rank, world_size, bound_s, lambda: "scoring", Peer("node-a", 12), clock=clock, probe_of=probe_of
    )
    return live, probed, liveness.BEAT_KEY.format(peer)


def test_a_peer_whose_process_refuses_is_named_gone_a_few_seconds_after_its_last_beat():
    store, clock = DictStore(), _Clock()
    live, probed, beat = _watcher(store, clock, [Probe.REFUSED])
    for _ in range(5):  # a beating peer (however slow its main thread) is never probed
        store.add(beat, 1)
        clock.now += 1
        assert live.tick() is None
    clock.now += liveness.SUSPECT_S - 0.5
    assert live.tick() is None and not probed
    clock.now += 1.0
    record = live.tick()
    assert probed == [Peer("node-b", 77, "10.0.0.2", 5000)]
    assert record.startswith("rank 2 (node-b) is gone: no heartbeat for ")
    assert "refuses connections" in record and "it was generating (lane 3, 8 prompts) (pid 77)" in record
    assert record.endswith("noticed by rank 1")
    assert int(store.data[liveness.BEAT_KEY.format(1)]) >= 7  # the watcher beat at every tick


def test_a_peer_that_accepts_but_does_not_answer_is_named_unresponsive_at_the_bound_only():
    store, clock = DictStore(), _Clock()
    live, probed, beat = _watcher(store, clock, [Probe.NO_REPLY, Probe.NO_REPLY], bound_s=10.0)
    store.add(beat, 1)
    assert live.tick() is None
    for _ in range(9):
        clock.now += 1
        assert live.tick() is None  # probed once at SUSPECT_S; no reply is no verdict before the bound
    assert len(probed) == 1
    clock.now += 1
    record = live.tick()
    assert len(probed) == 2 and record.startswith(
        "rank 2 (node-b) stopped responding: no heartbeat for 10 s (the bound: 10 s"
    )


def test_a_lost_host_is_named_gone_at_the_bound_and_an_answering_peer_restarts_the_clock():
    store, clock = DictStore(), _Clock()
    live, probed, beat = _watcher(store, clock, [Probe.ALIVE, Probe.NO_CONNECT, Probe.NO_CONNECT])
    store.add(beat, 1)
    live.tick()
    clock.now += liveness.SUSPECT_S
    assert live.tick() is None  # it answered: alive, its beats are late
    clock.now += 9.0
    assert live.tick() is None and len(probed) == 2  # suspected again, its host silent: no verdict yet
    clock.now += 1.5
    assert "is gone: no heartbeat for 10 s (the bound: 10 s, from timeout) and its host does not answer" in live.tick()


def test_a_peer_that_left_normally_is_never_named():
    store, clock = DictStore(), _Clock()
    live, probed, beat = _watcher(store, clock, [])
    store.add(beat, LEFT)
    for _ in range(3):
        clock.now += 30
        assert live.tick() is None
    assert not probed
    live.leave()
    assert int(store.data[liveness.BEAT_KEY.format(1)]) >= LEFT


@pytest.mark.parametrize("world_size", [4, 1024])
def test_a_poll_costs_the_same_few_store_calls_at_any_world_size(world_size):
    store, clock = DictStore(), _Clock()
    live, _, beat = _watcher(store, clock, [], world_size=world_size, rank=world_size - 1)
    live.tick()  # the first beat also writes the stage
    store.calls = 0
    for _ in range(10):
        store.add(beat, 1)
        clock.now += 1
        live.tick()
    assert store.calls - 10 == 2 * 10  # its own beat and one read of its peer's: O(1), whatever the world size


def test_a_rank_lost_before_it_published_is_still_named(monkeypatch):
    store, clock = DictStore(), _Clock()
    live = Liveness(
        store, 0, 2, 10.0, lambda: "starting", Peer("a", 1), clock=clock, probe_of=lambda p: liveness.probe(p)
    )
    live.tick()
    clock.now += 11
    assert live.tick().startswith("rank 1 (?) stopped responding: no heartbeat for 11 s")


def test_watch_threads_over_a_real_store_name_a_killed_peer_and_settle(monkeypatch):
    """Ranks 0 and 1 of 3 watch over a TCPStore; rank 2 published where it answers and then died (its port
    refuses). Rank 1 (its watcher) declares it within seconds; rank 0 reads the record; both name rank 2, their
    own stage, and the acknowledgements settle."""
    from torch.distributed import TCPStore

    monkeypatch.setattr(liveness, "SUSPECT_S", 0.3)
    server = TCPStore("127.0.0.1", 0, 4, True, timedelta(seconds=10), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 4, False, timedelta(seconds=10))
    dead, sock = liveness.me("node-b", "127.0.0.1")
    sock.close()
    Liveness(client, 2, 3, 10.0, lambda: "generating (lane 0, 4 prompts)", dead).beat()
    stopped: list[str] = []
    watches = []
    for rank in (0, 1):
        watch = failfast.FailureWatch(client, rank, poll_s=0.1, on_failure=stopped.append)
        watch.watch_peers(3, 60)
        watches.append(watch)
    t0 = time.monotonic()
    for w in watches:
        w.start()
    deadline = time.monotonic() + 10
    while len(stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(stopped) == 2 and time.monotonic() - t0 < 3
    for message in stopped:
        assert "stops because rank 2 (node-b) is gone: no heartbeat for" in message
        assert "it was generating (lane 0, 4 prompts)" in message and "noticed by rank 1" in message
        assert f"was {failfast.current_stage()})" in message and "no results were written" in message
    assert client.get(failfast.DONE_KEY) == failfast.LOST
    t1 = time.monotonic()
    failfast.settle(client, quiet_s=0.3)
    assert int(client.add(failfast.ACK_KEY, 0)) == 2 and time.monotonic() - t1 < 2
    for w in watches:
        w.stop(1)


# ------------------------------------------------------------------------- the watch's side of a lost peer
def _watch(store, rank=1, world_size=3):
    watch = failfast.FailureWatch(store, rank, poll_s=0.01, on_failure=lambda m: None)
    watch.liveness = Liveness(store, rank, world_size, 10.0, lambda: "scoring", Peer("node-a", 12))
    return watch


def test_a_second_declaration_names_the_record_that_stands_and_keeps_its_done_marker():
    store = DictStore()
    first = failfast.FailureWatch(store, 1)._declare("rank 2 (b) is gone: ...; noticed by rank 1")
    assert first == "rank 2 (b) is gone: ...; noticed by rank 1" and store.data[failfast.DONE_KEY] == failfast.LOST
    assert failfast.FailureWatch(store, 3)._declare("rank 4 (c) is gone: ...") == first  # one cause for everyone
    assert failfast.publish(store, 0, 5, "ValueError: late", ack_wait_s=0) and failfast.read(store) == first


def test_the_watch_leaves_when_closing_and_names_nobody_when_its_own_rank_failed():
    store = DictStore()
    watch = _watch(store)
    watch.own_failure = True
    watch.liveness.peer_rank, watch.liveness._seen, watch.liveness._since = 2, 0, -100.0  # long silent
    watch.liveness.probe_of = lambda peer: Probe.REFUSED
    assert watch._tick() is None  # this rank failed: it names itself; it does not declare others
    watch.own_failure, watch.closing = False, True
    assert watch._tick() is None and int(store.data[liveness.BEAT_KEY.format(1)]) >= LEFT


def test_leaving_marks_the_rank_left_through_the_main_threads_client(monkeypatch):
    watch_store, main_store = DictStore(), DictStore()
    watch = _watch(watch_store)
    monkeypatch.setattr(failfast, "_WATCH", [watch])
    monkeypatch.setattr(failfast, "default_store", lambda: main_store)
    failfast.leaving()
    assert watch.closing and int(main_store.data[liveness.BEAT_KEY.format(1)]) == LEFT
    assert liveness.BEAT_KEY.format(1) not in watch_store.data  # the watch's client may be busy: untouched


def test_survivors_of_a_lost_peer_settle_before_exiting_and_a_late_traceback_keeps_lost(monkeypatch):
    store = DictStore()
    watch = _watch(store)
    watch._declare("rank 2 (b) is gone: ...")
    settled, exits = [], []
    monkeypatch.setattr(failfast, "settle", lambda s, quiet_s: settled.append(quiet_s))
    monkeypatch.setattr(failfast.os, "_exit", exits.append)
    watch._exit_now("message")
    assert settled == [failfast.SETTLE_QUIET_S] and exits == [1]
    assert failfast.SETTLE_QUIET_S >= 2 * failfast.POLL_S + liveness.PROBE_CONNECT_S + liveness.PROBE_REPLY_S
    monkeypatch.setattr(failfast, "default_store", lambda: store)
    monkeypatch.setattr(failfast, "_WATCH", [watch])
    monkeypatch.setitem(failfast._PLACE, "published", False)
    failfast.uncaught(ValueError("a failure of its own, after the record"))  # publishes nothing new
    assert store.data[failfast.DONE_KEY] == failfast.LOST and exits == [1, 1]


def test_settle_waits_while_acknowledgements_keep_coming():
    store = DictStore()
    store.add(failfast.ACK_KEY, 1)
    threading.Timer(0.3, store.add, args=(failfast.ACK_KEY, 1)).start()
    t0 = time.monotonic()
    failfast.settle(store, quiet_s=0.5, limit_s=5)
    took = time.monotonic() - t0
    assert int(store.data[failfast.ACK_KEY]) == 2 and 0.75 <= took < 2.0  # the late one restarted the quiet time
