"""The :class:`Collective` protocol: what the stages need of the process group, typed without importing it.

:class:`~distperp_harness.distributed.collective.AccelerateCollective` implements it for a run; tests pass in-process
fakes. A leaf of ``distributed/``: modules below ``collective`` (``failfast``) type their argument with it.
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class Collective(Protocol):
    """What the stages need of the process group: who this rank is, and the gathers every rank calls together.

    :class:`~distperp_harness.distributed.collective.AccelerateCollective` is the run's; tests pass in-process fakes
    (threads, or one rank). Every method is collective: every rank calls it, in the same order, with the same
    ``name`` (the failure message's stage).
    """

    rank: int
    world_size: int
    local_rank: int
    timeout_s: float

    @property
    def is_main(self) -> bool: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def sequence(self) -> int: ...

    def barrier(self, name: str = "barrier") -> None: ...

    def all_gather_object(self, obj: T, name: str = "gather objects") -> list[T]: ...

    def gather_object(self, obj: T, dst: int = 0, name: str = "gather objects to one rank") -> list[T] | None: ...

    def all_gather_tensor(self, tensor: torch.Tensor, name: str = "gather tensors") -> list[torch.Tensor]: ...

    def exchange(
        self, parts: Sequence[np.ndarray], counts: Sequence[int], name: str = "exchange"
    ) -> list[np.ndarray]: ...
