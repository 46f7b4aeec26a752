"""Fault injection for the failure and resume tests: unset in normal runs, where it only counts calls.

``NAME=<rank>:<n>`` in the environment makes that rank run ``NAME``'s action at its n-th call of one injection point;
``NAME=<rank>:<n>,<rank>:<n>`` names several ranks.
"""

from __future__ import annotations

import collections
import os
import time
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


_POINTS = {
    "forward": "DISTPERP_TEST_FAIL",
    "planning": "DISTPERP_TEST_FAIL_PLANNING",
    "generation": "DISTPERP_TEST_FAIL_GENERATION",
    "lane": "DISTPERP_TEST_FAIL_LANE",
    "probe": "DISTPERP_TEST_FAIL_PROBE",
    "load": "DISTPERP_TEST_FAIL_LOAD",
    "invariance": "DISTPERP_TEST_FAIL_INVARIANCE",
    "group_step": "DISTPERP_TEST_FAIL_GROUP_STEP",
}
_HOLDS = {
    "lane": "DISTPERP_TEST_HOLD_LANE",
    "probe": "DISTPERP_TEST_HOLD_PROBE",
    "invariance": "DISTPERP_TEST_HOLD_INVARIANCE",
    "group_step": "DISTPERP_TEST_HOLD_GROUP_STEP",
}


def fail_for_tests(rank: int, point: str = "forward") -> None:
    """Fault injection for the failure tests; unset in normal runs. ``<VARIABLE>=<rank>:<n>`` makes that rank raise
    at its n-th call of ``point`` as an error of its own would:

    * ``DISTPERP_TEST_FAIL`` (``forward``): before a forward's first gather (real or idle forward);
    * ``DISTPERP_TEST_FAIL_PLANNING`` (``planning``): at the start of a scoring call, before the exchange of units;
    * ``DISTPERP_TEST_FAIL_GENERATION`` (``generation``): at the start of a ``generate_until`` call;
    * ``DISTPERP_TEST_FAIL_LANE`` (``lane``): before a generation lane this rank computes (its n-th lane);
      ``DISTPERP_TEST_HOLD_LANE`` stalls there instead (a decode step of ten minutes: slow, not lost);
    * ``DISTPERP_TEST_FAIL_PROBE`` (``probe``): before the probe of the n-th model at load (the model, then the
      reference); ``DISTPERP_TEST_HOLD_PROBE`` stalls there instead;
    * ``DISTPERP_TEST_FAIL_LOAD`` (``load``): while loading the n-th model of the process (its n-th
      :class:`~distperp_harness.lm.DistPerpLM`; a checkpoint of ``series``), as a file this rank cannot read would;
    * ``DISTPERP_TEST_FAIL_INVARIANCE`` (``invariance``): before ``batch_invariant=true``'s check of the kernels at
      load (:func:`~distperp_harness.run.runtime.decide_invariance`); ``DISTPERP_TEST_HOLD_INVARIANCE`` stalls there;
    * ``DISTPERP_TEST_FAIL_GROUP_STEP`` (``group_step``): before a decode step of a prompt a context-parallel group
      generates (every member makes each step); ``DISTPERP_TEST_HOLD_GROUP_STEP`` stalls there instead.
    """
    actions: dict[str, Callable[[str], None]] = {_POINTS[point]: _raise_injected}
    if point in _HOLDS:
        actions[_HOLDS[point]] = _hold
    inject(point, rank, actions)


def _hold(spec: str) -> None:
    time.sleep(600)  # a step of ten minutes: slow, not lost


def _raise_injected(spec: str) -> None:
    raise RuntimeError(f"injected failure for tests ({spec})")
