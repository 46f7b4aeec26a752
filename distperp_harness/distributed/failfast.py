"""One failing rank stops the whole run within seconds, and every rank's last words name it and the cause.

Why a separate channel: with sharded weights (``shard_size``) every forward is collective. A rank that fails
(non-finite logits, out of memory, any exception) leaves its group's other ranks waiting in an FSDP gather or in
the store; on NCCL they block on the host and nothing but the watchdog (``timeout``) would end them, with a SIGABRT
that names nobody. Without sharding, the other ranks would compute (or generate) all their share before meeting
the failure at the next gather.

The rendezvous store (:mod:`~distperp_harness.distributed.store`) is the channel, whichever rank or launcher hosts it:

* **The failing rank** — around every stage (:func:`stop_together`: forwards, planning, generation, the document
  split, lm-eval's gathers) and, for errors anywhere else, from the interpreter's last-chance hook
  (:func:`uncaught`) — prints its record to stderr, writes it to :data:`FAILURE_KEY`
  (``rank R (host, device) failed while <stage>: <error>``), and waits up to :data:`ACK_WAIT_S` seconds until every
  other rank has acknowledged it. That wait keeps the store alive (it lives in node 0's launcher, or in rank 0's
  process, and a launcher ends its other ranks as soon as one exits) until the peers have printed; only then does
  the error propagate (and the traceback print). After the traceback, :data:`DONE_KEY` lets the peers go.
* **Every rank** runs a :class:`FailureWatch` daemon thread, on **its own store connection** (a store client
  serializes its calls: a watch sharing the main thread's client waited behind the main thread's blocking ``get``
  of a shard group's step, up to ``timeout``, so it never saw rank 0's record; see docs/faults.md). It polls
  every :data:`POLL_S` seconds. A peer's record: print ``distperp: rank r stops because rank R ... failed ...``,
  acknowledge, wait up to :data:`DONE_WAIT_S` for the failing rank's traceback and :data:`EXIT_GRACE_S` more (so
  that the failing rank exits first and its launcher reports it as the first failure), ``os._exit(1)``. The store
  unreachable for :data:`GONE_AFTER` polls in a row: rank 0 / node 0 is gone
  (:func:`~distperp_harness.distributed.store.store_gone`); print that and ``os._exit(1)``. Once this process is
  leaving normally (:func:`closing`) a vanished store is no failure.
* **A peer that is lost without a word** (killed, stopped, its node gone) writes no record: the same thread beats,
  watches the next rank and answers probes (:mod:`~distperp_harness.distributed.liveness`); the watcher of a lost
  peer publishes a record for it (``rank R (host) is gone: ...`` or ``... stopped responding: ...``) with
  :data:`DONE_KEY` set to :data:`LOST` at once, and every rank, the watcher included, handles it as a peer's record,
  printing its own stage (:func:`current_stage`), then waits until the acknowledgements settle (:func:`settle`:
  the lost never acknowledge) before ``os._exit(1)``.

``os._exit``: the main thread may be blocked in a collective or store call that will never complete, which no
Python exception could interrupt. Nothing is written: lm-eval writes results only after the last gather.

**Generation and other loops** wrap each unit of work (a lane, a decode step, real or idle) in
``with stop_together(collective, device, "generating"):``; it costs nothing until an error is raised, nests (the
innermost block publishes, outer ones re-raise), and is safe to enter per step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

from distperp_harness.distributed import liveness
from distperp_harness.distributed.controlplane import bound_address, host_name
from distperp_harness.distributed.liveness import current_stage, pop_stage, push_stage
from distperp_harness.distributed.protocol import Collective
from distperp_harness.distributed.store import (
    CollectiveError,
    default_store,
    is_distributed_failure,
    private_client,
    store_gone,
)
from distperp_harness.errors import InputError

FAILURE_KEY = "distperp/failure"
ACK_KEY = "distperp/failure_acks"
DONE_KEY = "distperp/failure_done"
LOST = b"lost"
"""The value of :data:`DONE_KEY` with a liveness record: no traceback follows, and some ranks never acknowledge."""
POLL_S = 1.0
ACK_WAIT_S = 10.0
DONE_WAIT_S = 3.0
EXIT_GRACE_S = 1.0
GONE_AFTER = 2
SETTLE_QUIET_S = 2 * POLL_S + liveness.PROBE_CONNECT_S + liveness.PROBE_REPLY_S
"""How long the acknowledgements must stand still before a lost peer's survivors exit: two polls, and a probe that
may hold a watch thread between them."""


def describe(exc: BaseException) -> str:
    """First line of an error, with its type (at most 1,000 characters: a NaN error names up to three windows)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:1000]


def where(device: Any = None) -> str:
    """``host, device`` of this process (``host`` alone without a device)."""
    host = host_name()
    return f"{host}, {device}" if device is not None else host


def record_of(rank: int, cause: str, *, where: str = "", stage: str = "scoring") -> str:
    return f"rank {rank}{f' ({where})' if where else ''} failed while {stage}: {cause}"


def publish(
    store: Any,
    rank: int,
    world_size: int,
    cause: str,
    *,
    ack_wait_s: float = ACK_WAIT_S,
    where: str = "",
    stage: str = "scoring",
) -> bool:
    """Record that ``rank`` failed (``cause``, while ``stage``), then wait until the other ranks acknowledged (at
    most ``ack_wait_s``). The first record stays: a later failing rank (the same error on every rank, say) leaves
    the first cause to be named, acknowledges it as a watch would, and returns at once, so that the first never
    waits for ranks that fail themselves. Returns True when every peer acknowledged in time, False on timeout or
    when the store cannot be reached."""
    record = record_of(rank, cause, where=where, stage=stage)
    try:
        if first_record(store, record) != record:
            store.add(ACK_KEY, 1)
            return True
        deadline = time.monotonic() + ack_wait_s
        while time.monotonic() < deadline:
            if store.add(ACK_KEY, 0) >= world_size - 1:
                return True
            time.sleep(0.05)
    except Exception:  # the store host is gone: nobody can be told, the error still stands
        return False
    return False


def first_record(store: Any, record: str) -> str:
    """Write ``record`` unless the run has one already, in one store call (``compare_set``: no window in which a
    record is claimed but not yet written); returns the record that stands."""
    return store.compare_set(FAILURE_KEY, "", record.encode()).decode()


def read(store: Any) -> str | None:
    """The failure record, or None when no rank failed (or the store cannot be reached)."""
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        return None
    return None


def stop_message(rank: int, record: str, stage: str | None = None) -> str:
    here = f" (rank {rank} was {stage})" if stage else ""
    return (
        f"distperp: rank {rank} stops because {record}{here}. Every rank of the run stops; the evaluation is "
        f"incomplete and no results were written."
    )


class FailureWatch:
    """Daemon thread on a private connection to ``store``: when a peer's failure record appears, print it,
    acknowledge, ``on_failure(message)`` (default: wait for the failing rank's traceback, then ``os._exit(1)``);
    when the store is unreachable for ``gone_after`` polls in a row, ``on_failure`` with the store-gone message.
    With a :class:`~distperp_harness.distributed.liveness.Liveness` (:meth:`watch_peers`) each poll also beats,
    answers probes and watches the next rank: a lost peer is published as a record of its own, then handled as
    any record."""

    def __init__(
        self,
        store: Any,
        rank: int,
        *,
        poll_s: float = POLL_S,
        gone_after: int = GONE_AFTER,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.poll_s, self.gone_after = private_client(store), rank, poll_s, gone_after
        self.on_failure = on_failure or self._exit_now
        self.own_failure = False  # set when this rank failed: it raises (and names itself) instead
        self.closing = False  # set when this process leaves normally: a store that goes away is no failure then
        self.liveness: liveness.Liveness | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distperp-failure-watch", daemon=True)

    def watch_peers(self, world_size: int, timeout_s: float) -> "FailureWatch":
        """Beat and watch the next rank (before :meth:`start`; publishes this rank's probe address)."""
        peer, sock = liveness.me(host_name(), bound_address()[0])
        self.liveness = liveness.Liveness(
            self.store, self.rank, world_size, liveness.silence_bound(timeout_s), current_stage, peer, sock
        )
        return self

    def start(self) -> "FailureWatch":
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Ask the thread to end; wait up to ``wait_s`` seconds until it has (it is between store calls then)."""
        self._stop.set()
        if wait_s > 0 and self._thread.is_alive():
            self._thread.join(wait_s)
        if self.liveness is not None and not self._thread.is_alive():
            if self.closing:
                self.liveness.leave()
            self.liveness.close()

    def _run(self) -> None:
        misses = 0
        while not self._stop.wait(self.poll_s):
            try:
                record = self.store.get(FAILURE_KEY).decode() if self.store.check([FAILURE_KEY]) else None
                lost = self._tick() if record is None else None
                if lost is not None:
                    record = self._declare(lost)
                misses = 0
            except Exception:  # store host gone (or one poll lost): gone after `gone_after` in a row
                misses += 1
                if self.own_failure or self.closing:
                    return
                if misses >= self.gone_after:
                    message = stop_message(self.rank, store_gone(self.rank), current_stage())
                    print(message, file=sys.stderr, flush=True)
                    self.on_failure(message)
                    return
                continue
            if record is None or self.own_failure:
                continue
            message = stop_message(self.rank, record, current_stage())
            print(message, file=sys.stderr, flush=True)  # before the acknowledgement: the failing rank then exits
            with contextlib.suppress(Exception):  # best effort: the store host may be gone
                self.store.add(ACK_KEY, 1)
            self.on_failure(message)
            return

    def _tick(self) -> str | None:
        """Beat and watch the next rank; a record when it is lost (never while this process leaves normally)."""
        if self.liveness is None:
            return None
        if self.closing:
            self.liveness.leave()
            return None
        try:
            lost = self.liveness.tick()
        except Exception:  # a store that went away shows in the next poll's check; nothing else may
            return None  # end this thread
        return None if self.own_failure else lost

    def _declare(self, record: str) -> str:
        """Publish a lost peer's record (the first record of the run stays: it is returned when another came
        first); no traceback follows it, so :data:`DONE_KEY` is set at once, to :data:`LOST`."""
        standing = first_record(self.store, record)
        if standing == record:
            self.store.compare_set(DONE_KEY, "", LOST)
        return standing

    def _exit_now(self, message: str) -> None:
        """The default ``on_failure`` (the message is printed already): after a failing peer's record, wait up to
        :data:`DONE_WAIT_S` until its traceback printed; after a lost peer's, until the acknowledgements stop
        coming (every live rank acknowledges within a poll; the lost ones never do); then end the process, exit
        code 1."""
        try:
            if self.store.check([FAILURE_KEY]):
                deadline = time.monotonic() + DONE_WAIT_S
                while time.monotonic() < deadline and not self.store.check([DONE_KEY]):
                    time.sleep(0.05)
                if self.store.check([DONE_KEY]) and self.store.get(DONE_KEY) == LOST:
                    settle(self.store, quiet_s=SETTLE_QUIET_S)
                else:
                    time.sleep(EXIT_GRACE_S)  # the failing rank exits first: its launcher then names it the cause
        except Exception:  # the store went away meanwhile (or was never there): go now
            pass
        hard_exit(1)


def hard_exit(code: int) -> None:
    """End this process now with ``code``: end its multiprocessing children (``os._exit`` skips their cleanup),
    flush stdout and stderr, ``os._exit``. No atexit handler and no destructor runs: the exit barrier, or a process
    group's destructor, would wait for peers that are gone or stopping (an NCCL group's, for minutes). Takes no
    lock a stuck main thread could hold (no ``logging.shutdown``): the watch thread calls it too."""
    import multiprocessing

    try:
        for child in multiprocessing.active_children():
            child.terminate()
    except Exception:  # exiting anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # exiting anyway
            stream.flush()
    os._exit(code)


def settle(store: Any, quiet_s: float, limit_s: float = ACK_WAIT_S) -> None:
    """Wait until the acknowledgement count has not moved for ``quiet_s`` seconds (at most ``limit_s``): every live
    rank has then seen the record, and the store's host may go."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now, count = time.monotonic(), int(store.add(ACK_KEY, 0))
        if count != last:
            last, since = count, now
        elif now - since >= quiet_s:
            return
        time.sleep(0.1)


_WATCH: list[FailureWatch] = []
_PLACE: dict[str, Any] = {"rank": 0, "world_size": 1, "device": None, "published": False}


def stop_watch(wait_s: float = 5.0) -> None:
    """End this process's watch before the interpreter shuts down: a daemon thread still inside a store call at
    finalization is ended by ``pthread_exit`` through C++ frames, which aborts the process ("terminate called without
    an active exception") after a run that finished well."""
    for watch in _WATCH:
        watch.stop(wait_s)


def closing() -> None:
    """This process is leaving normally (its last collective is behind it): the store host may go first."""
    for watch in _WATCH:
        watch.closing = True


def leaving() -> None:
    """This process stops now, on purpose or after a broken collective (SIGTERM with ``resume_dir``, the failing
    exit): mark it as left at once, so that its watcher does not name it as lost while the others stop too. Uses
    the main thread's store client, idle here, not the watch's (which may be inside a probe or a store call)."""
    closing()
    store = default_store()
    for watch in _WATCH:
        if watch.liveness is not None and store is not None:
            watch.liveness.leave(store)


def start_watch(
    store: Any, rank: int, world_size: int | None = None, timeout_s: float | None = None
) -> FailureWatch | None:
    """Start this process's :class:`FailureWatch` once (None without a store); remember the rank for
    :func:`uncaught`. With ``timeout_s`` (the run's ``timeout``) it also beats and watches the next rank
    (:mod:`~distperp_harness.distributed.liveness`)."""
    if store is None:
        return None
    _PLACE.update(rank=rank, world_size=world_size or _PLACE["world_size"])
    if not _WATCH:
        watch = FailureWatch(store, rank)
        if timeout_s is not None and _PLACE["world_size"] > 1:
            watch.watch_peers(_PLACE["world_size"], timeout_s)
        _WATCH.append(watch.start())
    return _WATCH[0]


def set_device(device: Any) -> None:
    """The device this process computes on, for the records of :func:`uncaught`."""
    _PLACE["device"] = device


def fail_here(exc: BaseException, rank: int, world_size: int, device: Any, stage: str, store: Any = None) -> None:
    """This rank failed with ``exc`` while ``stage``: tell every rank (once per process; later calls return). An
    input error every rank raises alike (``same_on_every_rank``: rank 0 prints it) is no one rank's failure: nothing
    is published, and each rank exits with it; one of this rank's own is published, its line printed by the
    input-error hook (``distperp: error (rank R): ...``)."""
    for watch in _WATCH:
        watch.own_failure = True
    if isinstance(exc, InputError) and exc.same_on_every_rank:
        return
    if _PLACE["published"]:
        return
    _PLACE["published"] = True
    store = store if store is not None else default_store()
    record = record_of(rank, describe(exc), where=where(device), stage=stage)
    if not isinstance(exc, InputError):  # an input error's own line names this rank (errors.one_line)
        print(f"distperp: {record}. Telling the other ranks, which stop now.", file=sys.stderr, flush=True)
    if store is not None:
        publish(store, rank, world_size, describe(exc), ack_wait_s=ACK_WAIT_S, where=where(device), stage=stage)


@contextlib.contextmanager
def stop_together(collective: Collective, device: Any = None, stage: str = "scoring") -> Iterator[None]:
    """Around one stage or unit of work of a multi-process run (a forward, planning, a generation lane or decode
    step): on an error of this rank's own, tell every rank (:func:`fail_here`: printed, recorded, acknowledged)
    before re-raising it. A broken collective (a peer's failure seen from here) is re-raised as it is, or as a
    :class:`~distperp_harness.distributed.store.CollectiveError` naming the peer's record when there is one.
    Nests (the innermost block names the stage); with one process, or without a store, it only re-raises.

    Cheap enough for every generation lane or decode step, real or idle: entering costs a ``try``; the store is
    touched only when an error leaves the block. Errors the caller recovers from (an out-of-memory retry with a
    smaller batch) must be caught inside the block, since whatever leaves it stops the run."""
    push_stage(stage)
    try:
        yield
    except Exception as exc:
        if not getattr(collective, "distributed", False):
            raise
        store = default_store()
        if store is None:
            raise
        if is_distributed_failure(exc):
            if not hasattr(exc, "distperp_stage"):  # the innermost stage: what this rank was doing
                with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
                    exc.distperp_stage = stage  # type: ignore[attr-defined]
            record = read(store)
            if (
                record is not None
                and not record.startswith(f"rank {collective.rank} ")
                and f"rank {collective.rank} stops because" not in str(exc)
            ):
                raise CollectiveError(stop_message(collective.rank, record, stage)) from exc
            raise
        fail_here(exc, collective.rank, collective.world_size, device, stage, store)
        raise
    finally:
        pop_stage()


def stop_line(exc: BaseException) -> str | None:
    """The one line an uncaught broken collective or store call prints instead of its traceback when the store host
    is gone (:func:`~distperp_harness.distributed.store.store_gone`: node 0's launcher or rank 0 killed, its host
    lost), naming the stage this rank was in; ``None`` for anything else (the traceback then shows it). The failure
    watch, which would say the same once more, is told to stay quiet."""
    store = default_store()
    if store is None or not _WATCH or not is_distributed_failure(exc):
        return None
    try:
        store.check([FAILURE_KEY])
        return None  # the store answers: not the store host gone
    except Exception:  # the store host is gone: the line below says so
        pass
    for watch in _WATCH:
        watch.own_failure = True
    rank = int(_PLACE["rank"])
    return stop_message(rank, store_gone(rank), getattr(exc, "distperp_stage", None))


def uncaught(exc: BaseException) -> None:
    """From the interpreter's last-chance hook, after the traceback printed: an error of this rank's own raised
    outside every :func:`stop_together` (lm-eval's code, loading) is published like one inside; then the peers,
    which waited for the traceback, may go, and this process ends at once with exit code 1 (``os._exit``, as on
    SIGTERM with ``resume_dir``: nothing is left to write, and the exit barrier must not wait for peers that are
    stopping). KeyboardInterrupt and broken collectives publish nothing and exit as usual."""
    store = default_store()
    if not _WATCH or store is None:
        return
    if not isinstance(exc, Exception):
        closing()  # Ctrl-C: every rank was interrupted, and the store host may go first
        return
    for watch in _WATCH:
        watch.own_failure = True
    if not is_distributed_failure(exc):
        fail_here(exc, _PLACE["rank"], _PLACE["world_size"], _PLACE["device"], "running the evaluation", store)
    if _PLACE["published"]:
        with contextlib.suppress(Exception):  # store host gone
            store.compare_set(DONE_KEY, "", b"1")  # a lost peer's record, if it came first, keeps its LOST
        hard_exit(1)  # at once, before the peers (which wait EXIT_GRACE_S): the launcher then names this rank first
