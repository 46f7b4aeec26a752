"""The rendezvous store, who hosts it, and what a broken collective is: the one owner of these three facts.

The store is the TCP key-value store every process group of the run is built from (torch's ``TCPStore``). It is
served by one process, the **store host**:

* under ``accelerate launch`` / ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE=True``), by the launcher of node 0,
  which also starts rank 0 and ends its other local ranks as soon as one of them exits;
* otherwise (``init_process_group`` from environment variables), by rank 0's own process.

Either way, node 0 going away (rank 0 killed, its launcher killed, its host lost) takes the store with it, and every
other rank must read "store host gone" as "rank 0 / node 0 is gone" (:func:`store_gone`).

A store *client* (one Python object) serializes its calls: while one thread waits in ``get`` for a key that is not
there yet (up to the run's ``timeout``), every other call through the same object waits behind it. A thread that
must not wait behind the main thread (the failure watch) therefore uses its own connection, :func:`private_client`.
"""

from __future__ import annotations

import os
from typing import Any


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the group broke."""


def default_store() -> Any:
    """The default process group's rendezvous store (``None`` without a process group)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group, or torch's private API moved: callers then do without
        return None


def private_client(store: Any) -> Any:
    """A second connection to the same store (``Store.clone``), safe to use from another thread while this one is
    blocked in a store call; ``store`` itself where the store cannot be cloned (a fake in tests)."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # e.g. a store type without a clone: share the one connection
        return store


def store_address() -> str:
    """``MASTER_ADDR:MASTER_PORT`` of the run (``?`` for what the environment does not say)."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def store_host() -> str:
    """Who serves the store, in words: node 0's launcher or rank 0's process, and where."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the launcher of node 0 (with rank 0), at {store_address()}"
    return f"rank 0's process, at {store_address()}"


def store_gone(rank: int) -> str:
    """Why ``rank`` cannot reach the store any more, as a cause the failure messages print."""
    return (
        f"the rendezvous store, served by {store_host()}, is unreachable from rank {rank}: rank 0 or node 0 "
        f"(its launcher, its host) failed, was killed or was lost. The launcher of node 0 (its output or its "
        f"log) says which rank failed first, and why"
    )


_BROKEN = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe", "socket")


def is_distributed_failure(exc: BaseException) -> bool:
    """True for a broken collective or store call (a gloo/NCCL error, a peer or the store host gone, a timeout),
    False for an error of this rank's own (NaN logits, out of memory, a bad input): the one classifier of the two."""
    import torch.distributed as dist

    if isinstance(exc, (CollectiveError, *(t for t in (getattr(dist, "DistError", None),) if t is not None))):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, ConnectionError)) and any(w in text for w in _BROKEN)
