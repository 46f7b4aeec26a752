"""Liveness: a peer process that is gone, or stopped responding, is named by every rank within seconds, in any stage.

A failure record (:mod:`~distperp_harness.distributed.failfast`) needs a rank that can still speak. A process that
is killed (SIGKILL, the OOM killer, a preempted node) says nothing, and neither does one that is stopped (SIGSTOP,
a hung host). Outside a collective nobody would notice: a survivor generating its share, or waiting in lm-eval's
code, goes on for hours. So each rank's watch thread (:class:`~distperp_harness.distributed.failfast.FailureWatch`,
on its own store connection) also runs a :class:`Liveness`:

* **Beats.** Every poll it adds 1 to its counter ``distperp/beat/<rank>`` in the rendezvous store
  (``TCPStore.add``), and, when its stage changed since the last beat, writes the stage (``distperp/stage/<rank>``).
* **Watches one peer**, the next rank in a ring (``rank + 1`` modulo the world size): it reads that counter
  (``add(key, 0)``) every poll. Each rank is watched by exactly one other, so a poll costs a rank O(1) store calls
  (two adds, the failure check, now and then a stage) whatever the world size, and the store host serves
  ``~4 x world_size`` calls a second. When several consecutive ranks are lost (a whole node), the nearest live rank
  before them in the ring notices the first.
* **Answers probes.** A listening TCP socket on the address gloo binds to
  (:func:`~distperp_harness.distributed.controlplane.bound_address`); the watch thread answers each connection
  with one line between polls.

A peer whose counter has not moved for :data:`SUSPECT_S` seconds is **probed**, and judged by how its host answers:

* *connection refused*: no process listens there any more, the host does: the process **is gone** (killed or
  crashed). Declared at once, a few seconds after its last beat.
* *a reply*: its watch thread runs, so the process is alive and its beats are merely late; the clock restarts.
* *connected, no reply* (the kernel accepts for a process that does not run: stopped, hung, swapped out) or *no
  connection* (the host does not answer: a lost node): declared when the silence reaches :func:`silence_bound`
  (``timeout / 6``, within 10..60 s) as **stopped responding**, or as **gone** with "its host does not answer".

The bound: the heartbeat runs on a thread of its own, which a long decode step, a big prefill or a checkpoint load
does not stop (torch's kernels and file reads release the GIL), so only a whole process or host standing still
silences it. Ten seconds at least rides out a page-cache stall, a GC pause or a store hiccup (ten missed beats);
``timeout / 6`` keeps a lost peer noticed well before any collective's ``timeout`` would end a wait on it; 60 s at
most keeps "within seconds" true for the long ``timeout`` values that big checkpoints' loading asks for.

The declaring rank publishes a failure record (the first record wins, as for a failing rank); every rank prints it
with its own stage, acknowledges, waits until the acknowledgements settle, and exits 1 (no results are written).
A rank that leaves normally adds :data:`LEFT` to its counter first, so that its watcher never names it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

BEAT_KEY = "distperp/beat/{}"
STAGE_KEY = "distperp/stage/{}"
PEER_KEY = "distperp/peer/{}"
LEFT = 1 << 40
"""Added once to a rank's beat counter when it leaves normally: its watcher stops watching it."""
SUSPECT_S = 3.0
PROBE_CONNECT_S = 2.0
PROBE_REPLY_S = 2.5
"""Longer than one poll: a live watch thread answers between two of its polls."""
MIN_SILENCE_S, MAX_SILENCE_S = 10.0, 60.0


_STAGES: list[str] = []
_BASE_STAGE = ["starting (checks, loading and preparing the model)"]


def current_stage() -> str:
    """What this process's main thread is doing: the innermost :func:`stop_together` stage, else the base stage
    (:func:`set_base_stage`)."""
    return _STAGES[-1] if _STAGES else _BASE_STAGE[0]


def push_stage(stage: str) -> None:
    """The main thread enters ``stage`` (nests; :func:`pop_stage` leaves it)."""
    _STAGES.append(stage)


def pop_stage() -> None:
    _STAGES.pop()


def set_base_stage(stage: str) -> None:
    """The stage outside every :func:`~distperp_harness.distributed.failfast.stop_together` block (starting; then
    lm-eval's own code)."""
    _BASE_STAGE[0] = stage


def silence_bound(timeout_s: float) -> float:
    """Seconds without a beat (and without an answer to a probe) after which a peer is declared lost:
    ``timeout / 6`` within 10..60 s (module docstring: why). Never under 10 s, even for a ``timeout`` shorter than
    that: a live watch thread may be held a few seconds by a probe of its own, and a collective's ``timeout`` ends
    a wait on a lost peer first anyway."""
    return max(MIN_SILENCE_S, min(MAX_SILENCE_S, float(timeout_s) / 6.0))


class Probe(enum.Enum):
    """How a peer's probe address answered."""

    ALIVE = "alive"  # its watch thread answered
    REFUSED = "refused"  # the host answered, no process listens: the process is gone
    NO_REPLY = "no reply"  # connected (the kernel accepted), the process did not answer: stopped or hung
    NO_CONNECT = "no connection"  # the host did not answer (lost, or unreachable)
    UNKNOWN = "unknown"  # the peer published no probe address


@dataclass(frozen=True)
class Peer:
    """What a rank publishes about itself once, at start: where it runs and where it answers probes."""

    host: str
    pid: int
    address: str = ""
    port: int = 0

    def encode(self) -> bytes:
        return f"{self.host}\t{self.pid}\t{self.address}\t{self.port}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Peer":
        host, pid, address, port = raw.decode().split("\t")
        return cls(host, int(pid), address, int(port))


def published(store: Any, rank: int) -> Peer:
    """What ``rank`` published about itself (``?`` when it never did: lost before its watch started); never waits
    for the key."""
    key = PEER_KEY.format(rank)
    return Peer.decode(store.get(key)) if store.check([key]) else Peer("?", 0)


def listener(address: str) -> socket.socket | None:
    """A non-blocking listening socket on ``address`` (port chosen by the system), or None when it cannot bind."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            address or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.bind(where)
        sock.listen(64)
        sock.setblocking(False)
        return sock
    except OSError:
        return None


def answer(sock: socket.socket | None, beats: int) -> None:
    """Answer every pending probe on ``sock`` with one line (never blocks)."""
    while sock is not None:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        try:
            conn.setblocking(True)
            conn.settimeout(0.5)
            conn.sendall(f"alive {beats}\n".encode())
        except OSError:
            pass
        finally:
            conn.close()


def probe(peer: Peer, connect_s: float = PROBE_CONNECT_S, reply_s: float = PROBE_REPLY_S) -> Probe:
    """Connect to ``peer``'s probe address and read its line (module docstring: what each answer means)."""
    if not peer.port:
        return Probe.UNKNOWN
    try:
        conn = socket.create_connection((peer.address, peer.port), timeout=connect_s)
    except ConnectionRefusedError:
        return Probe.REFUSED
    except OSError:  # timed out, host or network unreachable
        return Probe.NO_CONNECT
    try:
        conn.settimeout(reply_s)
        return Probe.ALIVE if conn.recv(64).startswith(b"alive") else Probe.NO_REPLY
    except ConnectionResetError:  # accepted by a dying process's kernel, then reset
        return Probe.REFUSED
    except OSError:
        return Probe.NO_REPLY
    finally:
        conn.close()


def verdict(outcome: Probe, silent_s: float, bound_s: float) -> str | None:
    """The words for a peer silent for ``silent_s`` whose probe gave ``outcome``, or None while it is not lost
    (yet): refused is final at once; no reply or no connection only from the bound on."""
    if outcome is Probe.REFUSED:
        return (
            f"is gone: no heartbeat for {silent_s:.0f} s and its process refuses connections (it was killed or crashed)"
        )
    if silent_s < bound_s or outcome is Probe.ALIVE:
        return None
    silence = f"no heartbeat for {silent_s:.0f} s (the bound: {bound_s:.0f} s, from timeout)"
    if outcome is Probe.NO_REPLY:
        return (
            f"stopped responding: {silence} and its process accepts a connection but does not answer "
            f"(stopped, hung, or its host stalls)"
        )
    if outcome is Probe.NO_CONNECT:
        return f"is gone: {silence} and its host does not answer (the node was lost, or its network)"
    return f"stopped responding: {silence}"


@dataclass(eq=False)
class Liveness:
    """One rank's beat, its watch of the next rank, and its probe answers; :meth:`tick` once per poll, from the
    watch thread only (it owns ``store``, a private connection).

    Args:
        store: the rendezvous store (a private client); rank, world_size: this process's place.
        bound_s: :func:`silence_bound` of the run's timeout. stage: returns this rank's current stage.
        me: what this rank publishes about itself. clock: seconds, monotonic (tests pass a fake).
        probe_of: how a peer is probed (tests pass a fake).
    """

    store: Any
    rank: int
    world_size: int
    bound_s: float
    stage: Callable[[], str]
    me: Peer
    sock: socket.socket | None = None
    clock: Callable[[], float] = time.monotonic
    probe_of: Callable[[Peer], Probe] = probe
    peer_rank: int = field(init=False)
    beats: int = field(init=False, default=0)
    left: bool = field(init=False, default=False)
    peer_left: bool = field(init=False, default=False)
    _stage_sent: str | None = field(init=False, default=None)
    _seen: int = field(init=False, default=-1)  # the peer's counter at its last change
    _since: float = field(init=False)  # when it last changed (or when watching began)
    _probed_at: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.peer_rank = (self.rank + 1) % self.world_size
        self._since = self.clock()
        self.store.set(PEER_KEY.format(self.rank), self.me.encode())

    def tick(self) -> str | None:
        """Beat, answer probes, and watch the peer: a record naming the peer when it is lost, else None."""
        self.beat()
        answer(self.sock, self.beats)
        if self.world_size < 2 or self.peer_left:
            return None
        value = int(self.store.add(BEAT_KEY.format(self.peer_rank), 0))
        now = self.clock()
        if value >= LEFT:
            self.peer_left = True
            return None
        if value != self._seen:
            self._seen, self._since, self._probed_at = value, now, None
            return None
        silent = now - self._since
        due = (silent >= SUSPECT_S and self._probed_at is None) or silent >= self.bound_s
        if not due:
            return None
        self._probed_at = now
        outcome = self.probe_of(self.peer())
        if outcome is Probe.ALIVE:
            self._since, self._probed_at = self.clock(), None
            return None
        words = verdict(outcome, silent, self.bound_s)  # the silence when the probe began
        return None if words is None else self.record(words)

    def beat(self) -> None:
        if self.left:
            return
        self.beats = int(self.store.add(BEAT_KEY.format(self.rank), 1))
        stage = self.stage()
        if stage != self._stage_sent:
            self.store.set(STAGE_KEY.format(self.rank), stage.encode())
            self._stage_sent = stage

    def leave(self, store: Any = None) -> None:
        """This rank leaves normally: its watcher must not name it (one store call, through ``store`` when given,
        else the watch's own client; best effort)."""
        if not self.left:
            self.left = True
            with contextlib.suppress(Exception):  # the store host left first: nobody watches any more
                (store if store is not None else self.store).add(BEAT_KEY.format(self.rank), LEFT)

    def peer(self) -> Peer:
        """What the watched rank published."""
        return published(self.store, self.peer_rank)

    def record(self, words: str) -> str:
        """``rank R (host) <words>, while <its last stage>; noticed by rank r``."""
        peer = self.peer()
        key = STAGE_KEY.format(self.peer_rank)
        stage = self.store.get(key).decode() if self.store.check([key]) else "starting"
        return (
            f"rank {self.peer_rank} ({peer.host}) {words}; it was {stage} (pid {peer.pid}); noticed by rank {self.rank}"
        )

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


def me(host: str, address: str) -> tuple[Peer, socket.socket | None]:
    """This process's :class:`Peer` and its probe listener, bound on ``address`` (the one gloo binds to, which the
    other nodes reach); on every interface, reached by the host name, when that address is unknown; no probe port
    when nothing can be bound."""
    known = address not in ("", "unknown")
    sock = listener(address if known else "")
    if sock is None:
        return Peer(host, os.getpid()), None
    return Peer(host, os.getpid(), address if known else socket.gethostname(), sock.getsockname()[1]), sock


_STATE_OF = {
    Probe.ALIVE: "is alive (it answers) but had not arrived yet",
    Probe.REFUSED: "is gone (its process refuses connections: killed or crashed)",
    Probe.NO_REPLY: "stopped responding (it accepts a connection but does not answer)",
    Probe.NO_CONNECT: "is gone or unreachable (its host does not answer)",
    Probe.UNKNOWN: "never published where it answers",
}


def describe_ranks(store: Any, ranks: list[int], limit: int = 4, wait_s: float = 1.5) -> str:
    """What became of ``ranks`` (those missing from a failed collective), each probed once, at most ``limit`` of
    them (about ``2 * wait_s`` seconds each at worst): ``rank 2 (host) is gone (...); rank 3 (host) ...``."""
    parts = []
    for rank in ranks[:limit]:
        try:
            peer = published(store, rank)
        except Exception:  # the store went away meanwhile
            peer = Peer("?", 0)
        parts.append(f"rank {rank} ({peer.host}) {_STATE_OF[probe(peer, wait_s, wait_s)]}")
    more = f"; {len(ranks) - limit} more not probed" if len(ranks) > limit else ""
    return "; ".join(parts) + more
