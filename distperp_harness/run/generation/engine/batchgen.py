"""Generation in ``model.generate`` batches: the path for what slots (:mod:`.loop`) do not
serve — generation arguments beyond the sampling warpers (beam search, repetition penalties, ...), a model
``generation_config`` that adds logits processors, or a cache that cannot be edited row by row.

A batch's rows are laid out ``[prefix][pad...][own suffix]`` with zeros in the attention mask on the pads;
``generate`` derives position ids from the mask's cumulative sum, so each suffix continues its prefix's positions
exactly as a left-padded row would. A model with sliding-window or chunked layers, whose windows ``generate`` lays
by column, and a cache that cannot restart from a prefix get plain left-padded rows ``[pad...][prompt]`` instead
(lm-eval ``hf``'s layout). The batch runs until every row has stopped (lm-eval's criteria).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from accelerate.logging import get_logger
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import StoppingCriteria, StoppingCriteriaList

from distperp_harness.run.generation.engine.masks import has_windows
from distperp_harness.run.generation.engine.sampling import SeededDraw, warpers_for
from distperp_harness.run.generation.engine.stats import LaneStats
from distperp_harness.run.generation.engine.thinking import answer, stop_in_answer
from distperp_harness.run.scoring.engine.kvcache import CacheNotShareable, cache_argument, prefix_cache

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """A model ``model.generate`` runs on: transformers' ``*ForCausalLM`` classes are both."""


log = get_logger(__name__)

_UNSHAREABLE: list[str] = []


def _prefix_cache(model: PreTrainedModel, prefix: torch.Tensor, rows: int):
    """The KV cache of ``prefix`` (shape ``[1, P]``), repeated to ``rows`` rows; ``None`` (logged once) when the
    model's cache cannot be repeated or restarted from (recurrent layers): the batch is then computed whole, its
    rows left-padded."""
    try:
        return prefix_cache(model, prefix, rows)
    except CacheNotShareable as exc:
        if not _UNSHAREABLE:
            _UNSHAREABLE.append(str(exc))
            log.info(
                f"generation: the model's {exc} cannot start rows from a shared prefix; batches are computed whole",
                main_process_only=True,
            )
        return None


@dataclass(frozen=True)
class BatchArgs:
    """A lane's arguments for ``model.generate``: ``kwargs`` (the normalized generation arguments less ``until`` and
    ``max_gen_toks``), the stop strings, ``max_new`` and the ``think_end`` token (:mod:`.thinking`)."""

    kwargs: dict
    until: list[str]
    max_new: int
    think_end: str | int | None = None


@torch.no_grad()
def generate_batch(
    model: CausalLM,
    tokenizer,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    shared: int,
    args: BatchArgs,
    seeds: Sequence[int] | None,
) -> tuple[list[str], LaneStats]:
    """Texts of one batch of ``prompts`` whose first ``shared`` tokens are equal (``seeds``: one per row for a
    sampled batch) and its statistics."""
    kwargs, until, max_new, think_end = dict(args.kwargs), args.until, args.max_new, args.think_end
    shared = 0 if has_windows(model) else shared  # windows by column: pads inside a row would shift them
    prefix = torch.tensor([list(prompts[0][:shared])], dtype=torch.long, device=device)
    cache = _prefix_cache(model, prefix, len(prompts)) if shared else None
    shared = shared if cache is not None else 0
    suffixes = [list(p[shared:]) for p in prompts]
    suffix_width = max(len(s) for s in suffixes)
    width = shared + suffix_width
    pad = tokenizer.pad_token_id
    ids = torch.tensor(
        [list(prompts[0][:shared]) + [pad] * (suffix_width - len(s)) + s for s in suffixes],
        dtype=torch.long,
        device=device,
    )
    mask = torch.tensor(
        [[1] * shared + [0] * (suffix_width - len(s)) + [1] * len(s) for s in suffixes], dtype=torch.long, device=device
    )
    if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
        kwargs.pop("temperature", None)
    extra: dict[str, Any] = {}
    if kwargs.get("do_sample"):
        if seeds is None:
            raise ValueError("internal error: a sampled batch needs one seed per row")
        extra["logits_processor"] = [SeededDraw(warpers_for(model, kwargs), seeds, device)]
        kwargs["do_sample"] = False  # the draw leaves one finite logit per row: the drawn token
    max_length = kwargs.pop("max_length", width + max_new)
    if cache is not None:
        extra[cache_argument(model)] = cache
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_length=max_length,
        use_cache=True,
        stopping_criteria=stop_sequences_criteria(tokenizer, until, width, len(prompts))
        if think_end is None
        else StoppingCriteriaList([_AnswerStops(lambda row: stop_in_answer(tokenizer, think_end, until, row), width)]),
        pad_token_id=pad,
        **kwargs,
        **extra,
    )
    new = out[:, width:]
    texts = [answer(tokenizer, row.tolist(), think_end, until) for row in new]
    steps = new.shape[1]
    stats = LaneStats(
        prompts=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        shared_tokens=shared,
        prefill_forwards=1 + bool(shared),
        prefill_positions=shared + len(prompts) * suffix_width if shared else len(prompts) * width,
        decode_forwards=max(0, steps - 1),
        decode_positions=len(prompts) * max(0, steps - 1),
        generated=int((new != pad).sum()) if pad is not None else int(new.numel()),
    )
    return texts, stats


class _AnswerStops(StoppingCriteria):
    """Per row: done when ``hit(new tokens)`` (a stop string in the answer part, after the thinking trace)."""

    def __init__(self, hit, width: int) -> None:
        self.hit, self.width = hit, width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.Tensor:
        return torch.tensor(
            [self.hit(row) for row in input_ids[:, self.width :].tolist()], dtype=torch.bool, device=input_ids.device
        )
