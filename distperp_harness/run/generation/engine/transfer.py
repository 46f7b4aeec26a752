"""The decode loop's traffic between host and device, in one place so that it can be counted.

* :func:`to_device` and :func:`write_into`: host values to a new device tensor or into an existing one, without
  waiting for the device (pinned memory and a non-blocking copy on CUDA, where a plain
  ``torch.tensor(values, device=cuda)`` synchronises the stream; a plain tensor elsewhere).
* :class:`HostReads`: every device-to-host read of the loop (the chosen tokens of a step). A read waits for the
  device to finish what was queued before it: that wait is the loop's one synchronisation per forward, so the
  reads are counted (``LaneStats.host_reads``) and the tests assert one per forward.
* :func:`counting_reads`: counts every read of a tensor's values by Python code (the model's forward included),
  to check that nothing else reads the device back (tests and ``benchmarks/decode_host.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (numbers or nested lists of them) as a ``dtype`` tensor on ``device``; never waits for the device."""
    host = _host(values, dtype, device)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _host(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    # pinned: a non-blocking copy from it does not wait; torch's host allocator keeps the block until it is done
    return host.pin_memory() if device.type == "cuda" else host


def write_into(target: torch.Tensor, values: Sequence) -> None:
    """``target[...] = values`` (same shape) without waiting for the device."""
    target.copy_(_host(values, target.dtype, target.device), non_blocking=True)


@dataclass
class HostReads:
    """Counts the loop's device-to-host reads (``count``)."""

    count: int = 0

    def tokens(self, chosen: torch.Tensor) -> list[int]:
        """``chosen`` (a ``[rows]`` integer tensor) on the host: the step's one synchronisation."""
        self.count += 1
        return chosen.tolist()


READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy")
"""The ``torch.Tensor`` methods through which Python reads a tensor's values (each waits for the device)."""


@dataclass
class ReadCount:
    """Reads of tensor values counted by :func:`counting_reads`, by method."""

    by_method: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_method.values())


@contextlib.contextmanager
def counting_reads() -> Iterator[ReadCount]:
    """Counts, while inside, every call of :data:`READ_METHODS` on any tensor (a measuring tool: it patches
    ``torch.Tensor`` for the whole process)."""
    count = ReadCount()
    saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def counted(name: str, method):
        def read(self, *args, **kwargs):
            count.by_method[name] = count.by_method.get(name, 0) + 1
            return method(self, *args, **kwargs)

        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield count
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
