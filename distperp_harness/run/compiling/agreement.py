"""Every rank compiles in turn and all agree on the outcome.

**Failures.** When compiling fails on any rank (a model, attention implementation, quantized weights or torch build
that dynamo/inductor cannot handle) rank 0 says why, once, and every rank runs eager: one rank's failure turns
compiling off for all, so every rank computes with the same kernels (a failure of the later tree-mask graph: rows
with a tree mask run eager on every rank). The evaluation itself never fails for it.

**Caches.** Inductor's on-disk FX graph cache (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``)
keeps compiled kernels across runs; each node's local rank 0 compiles first and the node's other ranks then load
its kernels from that cache (a warm rerun still traces with dynamo: seconds, not minutes).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from distperp_harness.distributed.protocol import Collective


def in_turn(
    collective: Collective, what: str, attempt: Callable[[], Any], reason: str | None = None
) -> list[tuple[str | None, Any]]:
    """``attempt()`` on every rank (skipped where ``reason`` already says why not), the node's local rank 0 first: it
    fills inductor's on-disk cache and the node's other ranks then load its kernels. Returns every rank's ``(failure
    reason or None, what attempt returned)``; a failure never escapes (the evaluation runs eager instead)."""
    if collective.local_rank != 0:
        collective.barrier(f"wait for local rank 0 to compile {what}")
    result = None
    if reason is None:
        try:
            result = attempt()
        except Exception as exc:  # any compile failure means: run eager (never fail the run)
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if collective.local_rank == 0:
        collective.barrier(f"local rank 0 compiled {what}")
    return collective.all_gather_object((reason, result), f"agree on compiling {what}")


def first_failure(reasons: Sequence[str | None]) -> str | None:
    """The lowest rank's failure reason (with its rank when there are several), or None."""
    failed = next(((rank, why) for rank, why in enumerate(reasons) if why), None)
    if failed is None:
        return None
    return failed[1] + (f" (rank {failed[0]})" if len(reasons) > 1 else "")


def fake_compile_failure(variable: str = "DISTPERP_TEST_COMPILE_FAILURE") -> None:
    """Tests fake a compile failure by setting ``variable`` (its value is the message):
    ``DISTPERP_TEST_COMPILE_FAILURE`` at load, ``DISTPERP_TEST_TREE_MASK_FAILURE`` for the tree-mask graph."""
    message = os.environ.get(variable)
    if message:
        raise RuntimeError(message)
