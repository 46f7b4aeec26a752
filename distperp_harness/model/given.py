"""A model (and tokenizer) already in memory: ``simple_evaluate(model="distperp", model_args={"pretrained": model,
"tokenizer": tokenizer})``, as lm-eval ``hf`` accepts a ``PreTrainedModel``.

Contracts:
* :func:`split_given` takes the objects out of the keyword arguments and leaves strings for
  :class:`~distperp_harness.options.Options`: ``pretrained`` becomes the model's ``name_or_path`` (or
  ``"in-memory"``) and ``in_memory=True``; a tokenizer object is kept aside the same way.
* :func:`check_given` refuses what would change the caller's model in place or needs its files: ``quantize=``,
  ``peft=``, ``delta=``, ``gguf_file=``, ``subfolder=``, ``reference=base``/``pretrained`` and ``shard_size`` > 1
  (each with the fix: save the model and pass its folder). ``reference=<path>`` works.
* The model is used as given: moved to the run's device, put in eval mode, gradients off. Its identity in the
  results is ``model_sha=""`` (no files to hash). The fit check is skipped (the weights are already in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distperp_harness.errors import InputError
from distperp_harness.options import Options


@dataclass
class Given:
    """The caller's objects: a ``torch.nn.Module`` causal LM and, optionally, its tokenizer."""

    model: torch.nn.Module
    tokenizer: Any = None


def split_given(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Given | None]:
    """``(kwargs with strings in place of objects, the objects or None)`` (module doc)."""
    if "in_memory" in kwargs:  # set here only, from the type of pretrained
        raise InputError(
            "Unknown --model_args key(s) for --model distperp: 'in_memory' (it is set when "
            "pretrained is a model object). Fix: drop in_memory."
        )
    model, tokenizer = kwargs.get("pretrained"), kwargs.get("tokenizer")
    if not isinstance(model, torch.nn.Module):
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise InputError(
                f"tokenizer={type(tokenizer).__name__} object was given with pretrained={model!r}. "
                "Fix: pass a tokenizer object only with an in-memory model (pretrained=<model>), "
                "or tokenizer=<path or hub id>."
            )
        return kwargs, None
    out = dict(kwargs)
    out["pretrained"] = str(getattr(model, "name_or_path", "") or "in-memory")
    out["in_memory"] = True
    if tokenizer is not None and not isinstance(tokenizer, str):
        out.pop("tokenizer")
    else:
        tokenizer = None
    return out, Given(model, tokenizer)


def check_given(options: Options, given: Given) -> None:
    """ValueError for the options an in-memory model cannot take (module doc)."""
    if not hasattr(given.model, "config") or not hasattr(given.model, "get_input_embeddings"):
        raise InputError(
            f"pretrained={type(given.model).__name__} is not a transformers causal LM. Fix: pass a "
            "PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained) or its folder."
        )
    refused = [
        f"{key}={getattr(options, key)}" for key in ("peft", "delta", "gguf_file", "subfolder") if getattr(options, key)
    ]
    if options.quantize != "none":
        refused.append(f"quantize={options.quantize}")
    if options.reference in ("base", "pretrained"):
        refused.append(f"reference={options.reference}")
    if options.shard_size != 1:
        refused.append(f"shard_size={options.shard_size}")
    if options.tensor_parallel != 1:
        refused.append(f"tp_size={options.tensor_parallel}")
    if refused:
        raise InputError(
            f"{', '.join(refused)} with an in-memory model (pretrained={type(given.model).__name__}) "
            "would change the caller's model in place or needs its files. Fix: "
            "model.save_pretrained(DIR) and pass pretrained=DIR, or drop those keys "
            "(reference=<path> works with an in-memory model)."
        )
    if given.tokenizer is None and not options.tokenizer:
        import os

        if not os.path.isdir(os.path.expanduser(options.pretrained)):
            raise InputError(
                f"an in-memory model needs its tokenizer: its name_or_path {options.pretrained!r} is "
                "not a folder to load one from. Fix: model_args={'pretrained': model, "
                "'tokenizer': tokenizer} (an object or a path)."
            )


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The caller's model on ``device``, in eval mode, without gradients."""
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
