"""Which engine decodes a lane (:func:`choose_engine`), decided before any forward from the lane's generation
arguments, the model's cache layers and its decided paths:

* :attr:`Engine.SLOTS`: continuous batching (:func:`~.loop.decode_lane`; its :class:`~.loop.Decoder` picks the KV
  batch: fixed-shape buffers and the run's decode step (:func:`decode_step`) where it covers the lane, else
  ``DynamicCache`` edits). Sliding-window and chunked layers included: their keys are kept whole and their windows
  applied in the masks (:mod:`.masks`);
* :attr:`Engine.GENERATE`: ``model.generate`` batches of ``slots`` rows (:mod:`.batchgen`): generation arguments
  beyond the sampling warpers, a ``generation_config`` that adds logits processors, recurrent layers (linear
  attention, state spaces), or windows on a model that does not take distperp's 4D masks or continue a whole cache
  (:func:`~.masks.slots_refused`). Every row waits for its batch's last; no refill.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from accelerate.logging import get_logger

from distperp_harness.run.compiling.state import CompileState
from distperp_harness.run.generation.engine.cudagraphs import GraphStep
from distperp_harness.run.generation.engine.masks import slots_refused
from distperp_harness.run.generation.engine.sampling import SAMPLING_KEYS
from distperp_harness.run.generation.engine.step import CompiledStep, StaticStep, unsupported

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)

SLOT_KEYS = frozenset({"do_sample", "num_beams", "num_return_sequences", *SAMPLING_KEYS})
"""Normalized generation arguments (besides ``until`` and ``max_gen_toks``) that slots decode; any other key sends
the lane to ``model.generate`` batches."""

_NEUTRAL_PROCESSORS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
}
"""``generation_config`` fields that make ``generate`` add a logits processor, with their neutral values."""


class Engine(enum.Enum):
    """How a lane is decoded; the value is the name the call's record carries (``engines``)."""

    SLOTS = "slots"
    GENERATE = "generate"


def arguments_refused(model: torch.nn.Module, kwargs: dict) -> str | None:
    """Why slots cannot decode a lane with these normalized arguments (``None``: they can)."""
    extra = sorted(k for k in kwargs if k not in SLOT_KEYS)
    if extra:
        return f"generation arguments {extra}"
    if int(kwargs.get("num_beams", 1) or 1) > 1 or int(kwargs.get("num_return_sequences", 1) or 1) > 1:
        return "beam search or several sequences per request"
    config = getattr(model, "generation_config", None)
    added = [
        name
        for name, neutral in _NEUTRAL_PROCESSORS.items()
        if config is not None and getattr(config, name, neutral) not in (neutral, None)
    ]
    return f"the model's generation_config sets {added}" if added else None


def choose_engine(model: PreTrainedModel, kwargs: dict) -> tuple[Engine, str | None]:
    """The engine of a lane with these normalized arguments, and why slots do not serve it (``None`` for slots):
    the arguments (:func:`arguments_refused`), then the model (:func:`~.masks.slots_refused`)."""
    reason = arguments_refused(model, kwargs) or slots_refused(model)
    return (Engine.SLOTS, None) if reason is None else (Engine.GENERATE, reason)


_FALLBACKS: set[str] = set()


def note_fallback(reason: str) -> None:
    """Say once per reason (rank 0) that lanes run as ``model.generate`` batches."""
    if reason not in _FALLBACKS:
        _FALLBACKS.add(reason)
        log.info(
            f"generation: {reason}: lanes run as model.generate batches (every row waits for the batch's "
            "last; no refill)",
            main_process_only=True,
        )


def decode_step(
    model: PreTrainedModel,
    device: torch.device,
    pad_token_id: int | None,
    *,
    compiled: CompileState,
    batch_invariant: bool,
    grouped: bool,
    cuda_graphs: bool,
) -> tuple[StaticStep | None, str]:
    """The run's fixed-shape decode step and a line saying which (``None``: lanes decode on the ``DynamicCache``
    batch): compiled when compiling is active; CUDA graphs on CUDA for a model whole on one device (``grouped``: a
    shard or tensor-parallel group) that takes the fixed-shape step, unless ``cuda_graphs`` is off; else none.
    Fixed shapes are used only where a graph pays for them: every slot of a fixed-shape step computes until the
    lane's last row ends (measured on CPU, SmolLM2, 8 prompts in 8 slots: 1.7-2.4 decode positions per new token
    against 1.0). None when the run is batch-invariant (its rows attend alone on the dynamic cache, at the shapes of
    their own tokens)."""
    pad = pad_token_id
    if compiled.active:
        return CompiledStep(model, compiled, device, pad), "the compiled decode step"
    if batch_invariant:
        return None, "batch-invariant: the dynamic cache, every row attending alone (or one row per lane)"
    if device.type == "cuda" and cuda_graphs and not grouped:
        why = unsupported(model)
        if why is not None:
            return None, f"the dynamic cache ({why})"
        return GraphStep(model, device, pad), "the fixed-shape decode step as CUDA graphs"
    return None, "the dynamic cache (eager: fixed shapes buy nothing without a graph)"
