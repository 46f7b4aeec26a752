"""Token choice for generation: greedy, or a draw from each request's own seeded generator.

A sampled request draws from its own ``torch.Generator`` (seeded from lm-eval's ``--seed`` and the request's
content, :mod:`.generate`), never from the global RNG, so a sample does not depend on the rank,
the batch or the other rows, and the caller's RNG is left as it was. The warpers are transformers' own, in
``generate``'s order (temperature, top-k, top-p, min-p, typical, epsilon, eta).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Sequence, cast

import torch
from accelerate.logging import get_logger
from transformers import LogitsProcessor, LogitsProcessorList

from distperp_harness.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""Generation arguments applied by the distribution warpers (transformers' sampling-only logits processors)."""


def warpers_for(model: PreTrainedModel, kwargs: dict) -> LogitsProcessorList:
    """The distribution warpers of a sampled request; removes the sampling arguments from ``kwargs``.

    Built from the model's ``generation_config`` updated with the request's arguments, as ``generate`` does.
    ``do_sample=true`` without a temperature samples at the model's ``generation_config`` temperature (1.0 when it
    sets none), as transformers does; lm-eval's ``hf`` passes 0.0 there and fails.

    Raises:
        ValueError: beam sampling, or a temperature that is not > 0.
    """
    from transformers.generation import logits_process as lp

    if int(kwargs.get("num_beams", 1) or 1) > 1:
        raise InputError(
            f"do_sample=True with num_beams={kwargs['num_beams']} (beam sampling) is not supported; "
            "use num_beams=1 or do_sample=False in the task's generation_kwargs"
        )
    config = copy.deepcopy(model.generation_config)
    asked = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
    if "temperature" not in asked:
        log.info(
            f"do_sample=true without a temperature: sampling at the model's generation_config temperature "
            f"({config.temperature if config.temperature is not None else 1.0})",
            main_process_only=True,
        )
    elif not float(asked["temperature"]) > 0:
        raise InputError(
            f"do_sample=True with temperature={asked['temperature']}: sampling needs a temperature > 0; "
            "set do_sample=False for greedy decoding or a positive temperature"
        )
    config.update(**asked)
    warpers = LogitsProcessorList()
    if config.temperature is not None and float(config.temperature) != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(float(config.temperature)))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(lp.TopKLogitsWarper(top_k=int(config.top_k), min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=float(config.top_p), min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(lp.MinPLogitsWarper(min_p=float(config.min_p), min_tokens_to_keep=1))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(lp.TypicalLogitsWarper(mass=float(config.typical_p), min_tokens_to_keep=1))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(lp.EpsilonLogitsWarper(epsilon=float(config.epsilon_cutoff), min_tokens_to_keep=1))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(
            lp.EtaLogitsWarper(
                epsilon=float(config.eta_cutoff),
                min_tokens_to_keep=1,
                device=model.device,  # type: ignore[arg-type]  # annotated str; it goes to torch.tensor(device=)
            )
        )
    return warpers


def draw(warpers: LogitsProcessorList, scores: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row (``scores``: ``[rows, vocab]``): row ``i`` drawn with ``generators[i]`` from the warped
    distribution. Returns a ``[rows]`` long tensor."""
    if len(generators) != scores.shape[0]:
        raise ValueError(
            f"{scores.shape[0]} rows of scores for {len(generators)} seeded generators; "
            "sampled generation takes one sequence per request (num_return_sequences=1)"
        )
    # warpers ignore the ids; transformers annotates them torch.LongTensor (the legacy type of an int64 tensor)
    dummy = cast(torch.LongTensor, torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device))
    probs = torch.softmax(warpers(dummy, scores.float()), dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def generators_for(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


class SeededDraw(LogitsProcessor):
    """The last logits processor of a sampled ``model.generate`` batch: :func:`draw`, then only the drawn token
    is left finite (so greedy selection takes it)."""

    def __init__(self, warpers: LogitsProcessorList, seeds: Sequence[int], device: torch.device) -> None:
        self.warpers = warpers
        self.generators = generators_for(seeds, device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        picks = draw(self.warpers, scores, self.generators).unsqueeze(1)
        return torch.full_like(scores, float("-inf")).scatter_(1, picks, 0.0)
