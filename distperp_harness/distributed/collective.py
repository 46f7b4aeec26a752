"""The process group, through Accelerate: global ranks, a gloo control plane with a timeout, named missing ranks.

Accelerate's :class:`~accelerate.PartialState` owns the default group (gloo on CPU, nccl on GPU) and reads the
environment that ``accelerate launch`` or ``torchrun`` set, so ranks are *global* across nodes.

Everything distperp exchanges (units, the plan's inputs, float64 results, lm-eval's gathers, barriers) is a small
CPU payload, and it travels on a dedicated **gloo control group** created from the same store, on CPU and GPU
runs alike (one code path, tested on CPU). Why not the NCCL group with ``TORCH_NCCL_BLOCKING_WAIT``:

* NCCL collectives are queued on a stream: ``all_gather`` returns before it ran, and a failure surfaces later
  (at a sync such as ``.item()``), or never: NCCL cannot see that a peer died, so the survivors wait the whole
  timeout, after which the watchdog aborts the process (SIGABRT) unless blocking wait is on, which in turn makes
  every NCCL op host-blocking for all users of the group (future FSDP gathers included).
* gloo is synchronous and TCP-based: a peer that exits closes its sockets, so survivors fail at once rather
  than at the timeout; a hung peer is bounded by ``timeout``; payloads already live on the CPU, so nothing is
  staged in GPU memory; ``monitored_barrier`` names missing ranks at exit. The price is TCP bandwidth for the
  payloads (a fixed-size record per unit, 4 bytes per token only towards the rank that computes it, a few
  float64 per unit back to the ranks that asked), negligible next to scoring.

Every collective is issued with ``async_op=True`` and waited on *inside* the guard, so an error from any
backend, also one raised at wait time, becomes a :class:`~distperp_harness.distributed.store.CollectiveError`. Before
each collective a rank marks its arrival in the rendezvous store; the error names the ranks that never arrived, or
the store host (node 0) when the store itself is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from distperp_harness.distributed import failfast
from distperp_harness.distributed.controlplane import control_group as _control_group
from distperp_harness.distributed.failfast import start_watch, stop_watch
from distperp_harness.distributed.liveness import describe_ranks
from distperp_harness.distributed.protocol import Collective
from distperp_harness.distributed.store import CollectiveError, default_store, is_distributed_failure, store_gone
from distperp_harness.errors import close_progress_bars, install_excepthook, wants_traceback

__all__ = ["AccelerateCollective", "Collective", "CollectiveError", "default_store"]

T = TypeVar("T")


class AccelerateCollective:
    """:class:`Collective` over Accelerate's process group (module doc); a no-op wrapper when there is one process."""

    bytes_sent: int = 0
    """Payload bytes this rank sent to other ranks so far (``bytes_received``: received from them)."""
    bytes_received: int = 0

    def __init__(self, timeout_s: float = 1800.0, cpu: bool | None = None) -> None:
        """``cpu``: use a gloo group on the CPU (default: when CUDA is unavailable)."""
        from accelerate import PartialState

        cpu = (not torch.cuda.is_available()) if cpu is None else cpu
        self._state = PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self.rank: int = self._state.process_index
        self.world_size: int = self._state.num_processes
        self.local_rank: int = self._state.local_process_index
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.num_nodes: int = max(1, self.world_size // max(1, local_world))
        self.backend: str = str(getattr(self._state, "backend", None) or "none")
        self._group: Any = None
        self._step = 0  # the last step number this instance issued (numbers come from the process-wide _STEPS)
        if self.distributed:
            self._group = _control_group(self.rank, self.world_size, timeout_s)
            _watch_for_failure()
            start_watch(default_store(), self.rank, self.world_size, timeout_s)  # failing or lost peers stop it
            atexit.register(_leave_group, timeout_s, self._group)

    @property
    def control_backend(self) -> str:
        """Backend of the group distperp's own exchanges run on (``gloo``; ``none`` with one process)."""
        return torch.distributed.get_backend(self._group) if self._group is not None else "none"

    @property
    def sequence(self) -> int:
        """The number of this process's latest collective, over every ``AccelerateCollective`` it created: equal on
        every rank between two collectives, and never reused within the run (a key prefix for the store)."""
        return self._step

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self, name: str = "barrier") -> None:
        if self.distributed:
            self._guarded(name, lambda: torch.distributed.barrier(group=self._group, async_op=True))

    def all_gather_object(self, obj: T, name: str = "gather objects") -> list[T]:
        """Every rank's ``obj``, in rank order (one pickled round trip, as bytes in a tensor)."""
        if not self.distributed:
            return [obj]
        parts = self.all_gather_tensor(torch.from_numpy(_pickled(obj)), name=name)
        return [pickle.loads(p.numpy().tobytes()) for p in parts]

    def gather_object(self, obj: T, dst: int = 0, name: str = "gather objects to one rank") -> list[T] | None:
        """Every rank's ``obj`` in rank order on ``dst``, ``None`` elsewhere; only ``dst`` receives payloads."""
        if not self.distributed:
            return [obj]
        payload = _pickled(obj)
        sizes = self._sizes(len(payload), name)
        parts = [payload if r == dst else payload[:0] for r in range(self.world_size)]
        received = self.exchange(parts, [s if self.rank == dst else 0 for s in sizes], name)
        return [pickle.loads(p.tobytes()) for p in received] if self.rank == dst else None

    def all_gather_tensor(self, tensor: torch.Tensor, name: str = "gather tensors") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (first dimensions may differ; trailing ones must match), on the CPU, in rank order.

        Parts of different sizes travel unpadded (an all-to-all with per-rank counts); equal ones in one all-gather.
        """
        if not self.distributed:
            return [tensor.cpu()]
        dist = torch.distributed
        local = tensor.detach().cpu().contiguous()
        sizes = self._sizes(local.shape[0], name)
        row = int(np.prod(local.shape[1:], dtype=np.int64))
        if len(set(sizes)) == 1:
            out = [torch.empty_like(local) for _ in range(self.world_size)]
            self._guarded(name, lambda: dist.all_gather(out, local, group=self._group, async_op=True))
            nbytes = local.numel() * local.element_size()
            self._count(nbytes * (self.world_size - 1), nbytes * (self.world_size - 1))
            return out
        flat = local.reshape(-1).numpy()
        received = self.exchange([flat] * self.world_size, [s * row for s in sizes], name)
        return [torch.from_numpy(r).reshape(s, *local.shape[1:]) for r, s in zip(received, sizes)]

    def exchange(self, parts: Sequence[np.ndarray], counts: Sequence[int], name: str = "exchange") -> list[np.ndarray]:
        """All-to-all: send ``parts[d]`` (1-D, one dtype) to rank ``d``; receive ``counts[s]`` elements from rank ``s``.

        Every rank must know what it receives (the plan says so); nothing is padded. Returns one array per source
        rank, in rank order (``parts[rank]`` comes back as is).
        """
        if len(parts) != self.world_size or len(counts) != self.world_size:
            raise ValueError(f"exchange needs one part and one count per rank ({self.world_size})")
        dtype = np.result_type(*[np.asarray(p).dtype for p in parts])
        if not self.distributed:
            return [np.asarray(parts[0], dtype=dtype)]
        send = torch.from_numpy(np.concatenate([np.asarray(p, dtype=dtype).reshape(-1) for p in parts]))
        recv = torch.empty(int(sum(counts)), dtype=send.dtype)
        in_splits = [int(np.asarray(p).size) for p in parts]
        out_splits = [int(c) for c in counts]
        self._guarded(
            name,
            lambda: torch.distributed.all_to_all_single(
                recv, send, out_splits, in_splits, group=self._group, async_op=True
            ),
        )
        item = send.element_size()
        self._count(item * (send.numel() - in_splits[self.rank]), item * (recv.numel() - out_splits[self.rank]))
        bounds = np.concatenate([[0], np.cumsum(out_splits)])
        flat = recv.numpy()
        return [flat[bounds[r] : bounds[r + 1]] for r in range(self.world_size)]

    def _sizes(self, n: int, name: str) -> list[int]:
        """Every rank's ``n`` (one fixed-size all-gather)."""
        size = torch.tensor([n], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._guarded(
            f"{name} (sizes)", lambda: torch.distributed.all_gather(sizes, size, group=self._group, async_op=True)
        )
        self._count(8 * (self.world_size - 1), 8 * (self.world_size - 1))
        return [int(s.item()) for s in sizes]

    def _count(self, sent: int, received: int) -> None:
        """Payload bytes this rank sent to and received from *other* ranks (its own part excluded where known)."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def _guarded(self, name: str, op: Callable[[], Any]) -> None:
        """Issue ``op`` (which returns a work handle, or None) and wait for it; on any failure, at issue or at
        wait, raise :class:`CollectiveError` naming the ranks that never arrived."""
        self._step = next(_STEPS)
        store = default_store()
        key = f"distperp/step{self._step}"
        if store is not None:
            try:
                store.set(f"{key}/rank{self.rank}", b"1")
            except Exception:  # store host gone; the collective below will fail and say so
                store = None
        try:
            work = op()
            if work is not None:
                work.wait(timedelta(seconds=self.timeout_s))  # the backend's own bound, stated once more here
        except Exception as exc:  # torch raises RuntimeError/DistBackendError variants
            raise CollectiveError(self._explain(name, key, store, exc)) from exc

    def _explain(self, name: str, key: str, store: Any, exc: Exception) -> str:
        head = (
            f"distperp: collective '{name}' failed on rank {self.rank} of {self.world_size} "
            f"(timeout {self.timeout_s:g} s)"
        )
        missing: list[int] | None = None
        if store is not None:
            try:
                missing = [r for r in range(self.world_size) if not store.check([f"{key}/rank{r}"])]
            except Exception:  # the store went away during the collective
                store = None
        if missing:
            who = f"rank(s) {missing} never arrived: {describe_ranks(store, missing)}"
        elif store is None:
            who = store_gone(self.rank)
        else:
            who = "every rank arrived, so a peer failed during the exchange"
        return (
            f"{head}: {who}. The evaluation is incomplete and no results were written. "
            f"Underlying error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )


@contextlib.contextmanager
def naming_failures(collective, active: bool) -> Iterator[None]:
    """Around a sharded forward: when one of FSDP's gathers fails (a rank of the group died or hung past the
    timeout), meet on the gloo control group, whose error names the ranks that never arrived
    (:class:`~distperp_harness.distributed.store.CollectiveError`); if everyone arrives, the original error
    stands."""
    try:
        yield
    except Exception as exc:
        if active and collective.distributed and is_distributed_failure(exc):
            collective.barrier("check which ranks are alive after a failed gather of sharded weights")
        raise


_FAILED = False
_EXIT_CODE = 1
_STEPS = itertools.count(1)
"""Collective numbers, process-wide: a second model instance in one process group (``sweep``) must not reuse the
store keys of the first (arrival marks, claimed batches)."""


def _watch_for_failure() -> None:
    """Note an uncaught exception (it runs before ``atexit``), so a failing rank does not wait at exit; after its
    traceback, tell the other ranks (:func:`~distperp_harness.distributed.failfast.uncaught`)."""
    if getattr(sys.excepthook, "_distperp", False):
        return
    install_excepthook()  # innermost: it prints an input error as one line, then this hook tells the peers
    previous = sys.excepthook

    def hook(kind, value, traceback):
        global _FAILED, _EXIT_CODE
        _FAILED = True
        _EXIT_CODE = 130 if issubclass(kind, KeyboardInterrupt) else 1  # a shell's code for Ctrl-C
        line = None if wants_traceback() else failfast.stop_line(value)
        if line is None:
            previous(kind, value, traceback)
        else:  # the store host is gone: one line, not a traceback of torch's store client
            close_progress_bars()
            print(line, file=sys.stderr, flush=True)
        failfast.uncaught(value)

    hook._distperp = True  # type: ignore[attr-defined]
    hook._distperp_input = True  # type: ignore[attr-defined]  # it wraps the input-error hook
    sys.excepthook = hook


def _leave_group(timeout_s: float, group: Any) -> None:
    """At exit: wait until every rank is done with the groups, then tear them down.

    lm-eval's rank 0 still aggregates and writes results after the last collective; a rank that exited meanwhile
    could abort in gloo's teardown ("terminate called without an active exception"). The wait is a
    ``monitored_barrier`` on the gloo control group, whatever the default group's backend: a dead peer makes it
    fail at once, a hung one is bounded by ``min(timeout, 60 s)``; then the rank leaves anyway.
    """
    dist = torch.distributed
    failfast.closing()  # from here on, node 0 (the store host) may leave before this rank: that is no failure
    try:
        if _FAILED or not dist.is_initialized():
            stop_watch(wait_s=2.0)  # the watch thread must not be inside a store call at finalization
            if _FAILED:
                failfast.leaving()  # its watcher must not name it as lost: it says why it stops itself
                failfast.hard_exit(_EXIT_CODE)  # no destructor may wait on a lost peer (NCCL's can, for minutes)
            return
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=min(timeout_s, 60.0)), wait_all_ranks=True)
        stop_watch()  # before the store goes away, and before the interpreter ends daemon threads
        dist.destroy_process_group()
    except Exception:  # best effort at exit
        pass


def _pickled(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
