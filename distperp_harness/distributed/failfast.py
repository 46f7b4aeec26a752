"""One failing rank stops the whole run within seconds, and every rank's last words name it and the cause.

Why a separate channel: with sharded weights (``shard_size``) every forward is collective. A rank that fails
(non-finite logits, out of memory, any exception) leaves its group's other ranks waiting in an FSDP gather; on
NCCL they block on the host at the first device→host read and nothing but the NCCL watchdog (``timeout``) would
end them, with a SIGABRT that names nobody. Without sharding, the other ranks would compute all their batches
before meeting the failure at the next gather of results.

The rendezvous store (the TCP key-value store every process group is built from, hosted by rank 0) is the channel:

* **The failing rank** (:func:`stop_together`, around every forward, real or idle) writes one record,
  ``rank R (host, device) failed while scoring: <error>``, to the key :data:`FAILURE_KEY`, waits up to
  :data:`ACK_WAIT_S` seconds until every other rank has acknowledged it (so that the store, and the launcher,
  outlive the message), and re-raises its error.
* **Every rank** runs a :class:`FailureWatch` daemon thread that polls that key every :data:`POLL_S` seconds. When a
  peer's record appears it prints ``distperp: rank r stops because rank R ... failed ...`` to stderr, acknowledges,
  and ends the process at once with exit code 1 (``os._exit``: its main thread may be blocked in a collective
  that will never complete, which no Python exception could interrupt). Nothing is written: lm-eval writes results
  only after the last gather, which no rank reaches.

A rank blocked in a gather therefore ends within about ``POLL_S``, whatever the backend and the ``timeout``; a rank
that is computing ends at its next poll too. The mesh groups' own timeout (``timeout=``, see
:func:`~distperp_harness.model.sharding.make_mesh`) remains the bound for a rank that hangs without failing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

from distperp_harness.distributed.testfaults import inject

FAILURE_KEY = "distperp/failure"
ACK_KEY = "distperp/failure_acks"
POLL_S = 1.0
ACK_WAIT_S = 10.0


def describe(exc: BaseException) -> str:
    """First line of an error, with its type (at most 400 characters)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:400]


def publish(store: Any, rank: int, world_size: int, cause: str, *, ack_wait_s: float = ACK_WAIT_S,
            where: str = "") -> bool:
    """Record that ``rank`` failed (``cause``), then wait until the other ``world_size - 1`` ranks acknowledged
    (at most ``ack_wait_s``). The first record stays (a later one from another rank is dropped: the first cause is
    the one to name). Returns True when every peer acknowledged in time."""
    record = f"rank {rank}{f' ({where})' if where else ''} failed while scoring: {cause}"
    try:
        if store.add(f"{FAILURE_KEY}/count", 1) == 1:
            store.set(FAILURE_KEY, record.encode())
        deadline = time.monotonic() + ack_wait_s
        while time.monotonic() < deadline:
            if store.add(ACK_KEY, 0) >= world_size - 1:
                return True
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store host is gone: nobody can be told, the error still stands
        return False
    return False


def read(store: Any) -> str | None:
    """The failure record, or None when no rank failed (or the store cannot be reached)."""
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:  # noqa: BLE001
        return None
    return None


def stop_message(rank: int, record: str) -> str:
    return (f"distperp: rank {rank} stops because {record}. Every rank of the run stops; the evaluation is "
            f"incomplete and no results were written.")


class FailureWatch:
    """Daemon thread: when a peer's failure record appears in ``store``, print it, acknowledge, ``on_failure``
    (default: ``os._exit(1)``). Stops quietly when the store goes away (rank 0 exited: the next collective then
    fails and says so)."""

    def __init__(self, store: Any, rank: int, *, poll_s: float = POLL_S,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.store, self.rank, self.poll_s = store, rank, poll_s
        self.on_failure = on_failure or _exit_now
        self.own_failure = False  # set by this rank's own stop_together: it raises instead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distperp-failure-watch", daemon=True)

    def start(self) -> "FailureWatch":
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Ask the thread to end; wait up to ``wait_s`` seconds until it has (it is between store calls then)."""
        self._stop.set()
        if wait_s > 0 and self._thread.is_alive():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                present = self.store.check([FAILURE_KEY])
                record = self.store.get(FAILURE_KEY).decode() if present else None
            except Exception:  # noqa: BLE001 - store host gone
                return
            if record is None or self.own_failure:
                continue
            message = stop_message(self.rank, record)
            try:
                self.store.add(ACK_KEY, 1)
            except Exception:  # noqa: BLE001
                pass
            self.on_failure(message)
            return


def _exit_now(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(1)


_WATCH: list[FailureWatch] = []


def stop_watch(wait_s: float = 5.0) -> None:
    """End this process's watch before the interpreter shuts down: a daemon thread still inside a store call at
    finalization is ended by ``pthread_exit`` through C++ frames, which aborts the process ("terminate called without
    an active exception") after a run that finished well."""
    for watch in _WATCH:
        watch.stop(wait_s)


def start_watch(store: Any, rank: int) -> FailureWatch | None:
    """Start this process's :class:`FailureWatch` once (None without a store)."""
    if store is None:
        return None
    if not _WATCH:
        _WATCH.append(FailureWatch(store, rank).start())
    return _WATCH[0]


@contextlib.contextmanager
def stop_together(collective: Any, device: Any = None) -> Iterator[None]:
    """Around one forward of a multi-process run: on an error of this rank's own, tell every rank
    (:func:`publish`) before re-raising it. A broken collective (a peer's failure seen from here) is re-raised
    as it is, naming the peer's record when there is one."""
    try:
        yield
    except Exception as exc:
        if not getattr(collective, "distributed", False):
            raise
        from distperp_harness.distributed.collective import _default_store

        store = _default_store()
        if store is None:
            raise
        if _is_distributed_failure(exc):
            record = read(store)
            if record is not None and not record.startswith(f"rank {collective.rank} "):
                raise RuntimeError(stop_message(collective.rank, record)) from exc
            raise
        for watch in _WATCH:
            watch.own_failure = True
        publish(store, collective.rank, collective.world_size, describe(exc),
                where=f"{socket.gethostname()}, {device}" if device is not None else socket.gethostname())
        raise


def _is_distributed_failure(exc: BaseException) -> bool:
    """A broken collective (gloo/NCCL error, peer gone, timeout), as opposed to an error of this rank's own."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    from distperp_harness.distributed.collective import CollectiveError

    if isinstance(exc, CollectiveError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in ("gloo", "nccl", "connection", "timed out",
                                                                     "timeout", "peer"))


def fail_for_tests(rank: int) -> None:
    """Fault injection before each forward of the failure tests; unset in normal runs.
    ``DISTPERP_TEST_FAIL=<rank>:<forward>`` makes that rank raise at its n-th forward (real or idle), before the
    forward's first gather, as an error of its own would."""
    inject("forward", rank, {"DISTPERP_TEST_FAIL": _raise_injected})


def _raise_injected(spec: str) -> None:
    raise RuntimeError(f"injected failure for tests (DISTPERP_TEST_FAIL={spec})")
