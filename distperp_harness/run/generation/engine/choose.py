"""Token choice on the device: each running row's next token from its row of logits, before anything is read back.

Greedy rows take the argmax; a sampled lane's rows draw from their own seeded generators
(:func:`~.sampling.draw`, which a row gets when it starts). The choice stays on the device; the loop reads the
chosen tokens back once a step (:class:`~.transfer.HostReads`), and the scheduler decides from them which rows end.
"""

from __future__ import annotations

from typing import Sequence

import torch

from distperp_harness.run.generation.engine.sampling import draw, generators_for
from distperp_harness.run.generation.engine.scheduler import GenRow


class Chooser:
    """Chooses tokens for the rows of one lane: greedy when ``seeds`` is ``None``, else sampled with ``warpers``
    (the lane's distribution warpers) and one generator per row, seeded with ``seeds[row.job]``."""

    def __init__(self, seeds: Sequence[int] | None, warpers, device: torch.device) -> None:
        self.seeds, self.warpers, self.device = seeds, warpers, device

    def start(self, rows: Sequence[GenRow], logits: torch.Tensor) -> torch.Tensor:
        """First tokens of freshly prefilled ``rows`` (``logits``: ``[len(rows), vocab]``); a sampled row gets its
        generator here."""
        if self.seeds is not None:
            for r, g in zip(rows, generators_for([self.seeds[r.job] for r in rows], self.device)):
                r.generator = g
        return self(rows, logits)

    def __call__(self, rows: Sequence[GenRow], logits: torch.Tensor) -> torch.Tensor:
        """Next tokens of running ``rows``: a ``[len(rows)]`` long tensor on the logits' device."""
        if self.seeds is None:
            return logits.argmax(-1)
        # every row of a sampled lane got its generator at start(); draw() refuses a count that differs
        return draw(self.warpers, logits, [r.generator for r in rows if r.generator is not None])
