"""lm-eval's process-group calls (``all_gather``, ``gather_object``, ``barrier``) through distperp's process
group, inside the failure channel, and ``--use_cache``'s refusal on several processes: a mixin of the face."""

from __future__ import annotations

from typing import Any

import torch

from distperp_harness.distributed.failfast import stop_together
from distperp_harness.docsplit import fill_empty_ranks
from distperp_harness.errors import OptionError
from distperp_harness.options import use_cache_error


class GroupCalls:
    """What lm-eval's evaluator calls on the model to gather across ranks; the class mixing this in sets
    ``collective``, ``_device``, ``document_split`` and ``world_size``."""

    collective: Any
    _device: torch.device
    document_split: Any
    world_size: int

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 (a 0-d tensor counts as one element)."""
        with stop_together(self.collective, self._device, "taking part in lm-eval's all_gather"):
            parts = self.collective.all_gather_tensor(
                tensor.reshape(1) if tensor.dim() == 0 else tensor, "lm-eval all_gather"
            )
            return torch.cat(parts).to(tensor.device)

    def gather_object(self, obj, dst: int = 0):
        with stop_together(self.collective, self._device, "taking part in lm-eval's gather_object"):
            gathered = self.collective.gather_object(obj, dst, "lm-eval gather_object")
            return fill_empty_ranks(gathered, self.document_split) if gathered is not None else None

    def barrier(self) -> None:
        with stop_together(self.collective, self._device, "taking part in lm-eval's barrier"):
            self.collective.barrier("lm-eval barrier")

    def set_cache_hook(self, cache_hook) -> None:
        if self.world_size > 1 and getattr(cache_hook, "dbdict", None) is not None:
            raise OptionError(use_cache_error(self.world_size))  # every rank meets it: rank 0 says it
        super().set_cache_hook(cache_hook)  # type: ignore[misc]  # lm-eval's LM, later in the MRO
