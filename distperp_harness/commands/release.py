"""Whether a dropped run gave its memory back: the model collected and, on CUDA, the allocated bytes back at the
baseline measured before the first run (``distperp check``; ``benchmarks.gpu_check`` records the same).

Both sides are measured with cuBLAS's per-handle workspaces dropped: torch makes one at a process's first matrix
product and keeps it for the process (32 MiB on Hopper), which is torch's, not a run's.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

RELEASE_SLACK = 16 << 20
"""Allocated CUDA bytes a run may leave behind (the caching allocator's own bookkeeping)."""


def _drop_cublas_workspaces() -> None:
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def cuda_baseline() -> int | None:
    """Allocated CUDA bytes before any run, cuBLAS's workspaces left out; ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # the process's first product
    torch.cuda.synchronize()
    _drop_cublas_workspaces()
    return int(torch.cuda.memory_allocated())


@dataclass(frozen=True)
class Release:
    """What was left of a dropped run: whether its model was collected, and on CUDA the allocated bytes above the
    baseline (``None`` without one)."""

    collected: bool
    left_bytes: int | None

    @property
    def ok(self) -> bool:
        return self.collected and (self.left_bytes is None or self.left_bytes <= RELEASE_SLACK)

    @property
    def detail(self) -> str:
        text = "model collected" if self.collected else "model still referenced after gc.collect()"
        if self.left_bytes is not None:
            text += f"; {self.left_bytes / 2**20:+.1f} MiB allocated vs the baseline"
        return text


def released(model_ref: weakref.ref, baseline: int | None) -> Release:
    """Collect garbage (``DistPerpLM`` sits in reference cycles; torchao's bound ``extra_repr`` adds one), then
    whether the run's model is gone and, with a CUDA ``baseline``, the allocated bytes against it."""
    import torch

    gc.collect()
    left = None
    if baseline is not None:
        torch.cuda.synchronize()
        _drop_cublas_workspaces()
        torch.cuda.empty_cache()
        left = int(torch.cuda.memory_allocated()) - baseline
    return Release(collected=model_ref() is None, left_bytes=left)
