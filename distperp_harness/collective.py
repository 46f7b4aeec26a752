"""The process group, through Accelerate: global ranks, tensor gathers with a timeout, named missing ranks.

Accelerate's :class:`~accelerate.PartialState` owns the group (gloo on CPU, nccl on GPU) and reads the
environment that ``accelerate launch`` or ``torchrun`` set, so ranks are *global* across nodes. Every
collective is bounded by ``timeout`` seconds (given to ``init_process_group``). Before each collective a rank
marks its arrival in the rendezvous store; when a collective fails (a peer died, or the timeout passed) the
error names the ranks that never arrived, instead of a bare gloo/nccl message.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
from datetime import timedelta
from typing import Any, Callable, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the group broke."""


class Collective:
    """Gathers among all processes of the run; a no-op wrapper when there is one process."""

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
        backend = getattr(self._state, "backend", None) or ""
        self._comm_device = self._state.device if "nccl" in backend else torch.device("cpu")
        self._step = 0
        if self.distributed:
            _watch_for_failure()
            atexit.register(_leave_group, timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self, name: str = "barrier") -> None:
        if self.distributed:
            self._guarded(name, torch.distributed.barrier)

    def all_gather_object(self, obj: T, name: str = "gather objects") -> list[T]:
        """Every rank's ``obj``, in rank order (one pickled round trip, as bytes in a tensor)."""
        if not self.distributed:
            return [obj]
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        parts = self.all_gather_tensor(torch.from_numpy(payload.copy()), name=name)
        return [pickle.loads(p.numpy().tobytes()) for p in parts]

    def all_gather_tensor(self, tensor: torch.Tensor, name: str = "gather tensors") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (first dimensions may differ; trailing ones must match), on the CPU, in rank order."""
        if not self.distributed:
            return [tensor.cpu()]
        dist = torch.distributed
        local = tensor.to(self._comm_device).contiguous()
        size = torch.tensor([local.shape[0]], dtype=torch.int64, device=self._comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._guarded(f"{name} (sizes)", lambda: dist.all_gather(sizes, size))
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=self._comm_device)
        padded[: local.shape[0]] = local
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._guarded(name, lambda: dist.all_gather(out, padded))
        return [o[: int(s.item())].cpu() for o, s in zip(out, sizes)]

    def _guarded(self, name: str, op: Callable[[], Any]) -> Any:
        """Run ``op``; on failure raise :class:`CollectiveError` naming the ranks that never arrived."""
        self._step += 1
        store = _default_store()
        key = f"distperp/step{self._step}"
        if store is not None:
            try:
                store.set(f"{key}/rank{self.rank}", b"1")
            except Exception:  # noqa: BLE001 - store host gone; the collective below will fail and say so
                store = None
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistBackendError variants
            raise CollectiveError(self._explain(name, key, store, exc)) from exc

    def _explain(self, name: str, key: str, store: Any, exc: Exception) -> str:
        head = (f"distperp: collective '{name}' failed on rank {self.rank} of {self.world_size} "
                f"(timeout {self.timeout_s:g} s)")
        missing: list[int] | None = None
        if store is not None:
            try:
                missing = [r for r in range(self.world_size) if not store.check([f"{key}/rank{r}"])]
            except Exception:  # noqa: BLE001
                missing = None
        if missing:
            who = f"rank(s) {missing} never arrived (died, hung, or were killed)"
        elif store is None and self.rank != 0:
            who = "rank 0, which hosts the rendezvous store, is unreachable (died or was killed)"
        else:
            who = "every rank arrived, so a peer failed during the exchange"
        return (f"{head}: {who}. The evaluation is incomplete and no results were written. "
                f"Underlying error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


_FAILED = False


def _watch_for_failure() -> None:
    """Note an uncaught exception (it runs before ``atexit``), so a failing rank does not wait at exit."""
    if getattr(sys.excepthook, "_distperp", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        global _FAILED
        _FAILED = True
        previous(kind, value, traceback)

    hook._distperp = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _leave_group(timeout_s: float) -> None:
    """At exit: wait until every rank is done with the group, then tear it down.

    lm-eval's rank 0 still aggregates and writes results after the last collective; a rank that exited meanwhile
    could abort in gloo's teardown ("terminate called without an active exception"). A dead peer makes the
    barrier fail at once; a hung one is bounded by the timeout.
    """
    dist = torch.distributed
    try:
        if _FAILED or not dist.is_initialized():
            return  # failing: leave at once, so the peers' collectives fail fast instead of waiting here
        if dist.get_backend() == "gloo":
            # Bounded well below the run's timeout: at worst a rank waits a minute, then leaves anyway.
            dist.monitored_barrier(timeout=timedelta(seconds=min(timeout_s, 60.0)), wait_all_ranks=True)
        else:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API; the error message is then less specific
        return None
