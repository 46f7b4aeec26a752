"""Fault injection for the failure and resume tests: unset in normal runs, where it only counts calls.

``NAME=<rank>:<n>`` in the environment makes that rank run ``NAME``'s action at its n-th call of one injection point;
``NAME=<rank>:<n>,<rank>:<n>`` names several ranks.
"""

from __future__ import annotations

import collections
import os
from typing import Callable, Mapping

_calls: collections.Counter = collections.Counter()


def inject(point: str, rank: int, actions: Mapping[str, Callable[[str], None]]) -> None:
    """Count a call at ``point``; for each variable of ``actions`` set to ``<rank>:<n>`` naming this rank and this
    call, run its action (given the variable's value)."""
    _calls[point] += 1
    for name, act in actions.items():
        spec = os.environ.get(name)
        for part in (spec or "").split(","):
            if part:
                fault_rank, after = (int(x) for x in part.split(":"))
                if rank == fault_rank and _calls[point] == after:
                    act(f"{name}={spec}")
