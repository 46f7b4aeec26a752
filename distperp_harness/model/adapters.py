"""Fine-tunes stored as a difference to their base: ``peft=`` (a PEFT or torchtune LoRA adapter folder / hub id:
``adapter_config.json`` + ``adapter_model.safetensors``) and ``delta=`` (a full checkpoint of weight differences,
as lm-eval ``hf`` defines it: every base parameter plus the delta's parameter of the same name; a tied weight,
which ``state_dict`` lists under two names, gets its delta once, where ``hf`` adds it twice).

Contracts:
* :func:`apply_adapter` takes the loaded, unquantized base (on the device or the CPU staging device) and returns
  the model with the adapter applied, and an :class:`AdapterReport`. With ``merge_adapter=true`` (default) a PEFT
  adapter is merged into the weights (``merge_and_unload``): the result is a plain transformers model, in the
  base's dtype, that quantizes, shards and compiles like any checkpoint; quantization therefore always sees the
  merged weights (the loader quantizes after this step, never while loading, when an adapter is given). With
  ``merge_adapter=false`` the adapter stays unmerged, computed as PEFT computes it (``W x + B A x``, what lm-eval
  ``hf`` runs): the transformers model is returned with PEFT's LoRA layers in place of its Linears (not the
  ``PeftModel`` wrapper, whose ``base_model`` is not the transformers body scoring reads).
* As ``hf``, the base's embeddings are resized first when the tokenizer is longer than the model's vocabulary
  (an adapter trained with added tokens).
* A ``delta=`` checkpoint must hold every parameter of the base with its shape; else a ValueError names the first
  missing or mismatched one.
* A missing ``peft`` package is one ValueError naming the install.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from accelerate.logging import get_logger

from distperp_harness.errors import InputError
from distperp_harness.model.kept_base import BaseKeeper, adapter_keepable
from distperp_harness.options import Options

log = get_logger(__name__)


@dataclass(frozen=True)
class AdapterReport:
    """What was applied to the base: ``kind`` (``peft`` or ``delta``), its ``source``, whether it was ``merged``
    into the weights, PEFT's ``peft_type`` / ``rank`` / ``target_modules`` (peft only) and a one-line ``note``."""

    kind: str
    source: str
    merged: bool
    peft_type: str | None = None
    rank: int | None = None
    target_modules: list[str] | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise InputError(
            "peft= needs the 'peft' package, which is not installed. Fix: pip install 'peft>=0.13' "
            "(or pip install 'distperp-harness[checkpoints]')."
        )


def _vocab_size(model: torch.nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    return int(getattr(text, "vocab_size", None) or config.vocab_size)


def apply_peft(
    model: torch.nn.Module, options: Options, tokenizer: Any, keeper: BaseKeeper | None = None
) -> tuple[torch.nn.Module, AdapterReport]:
    """The base with the PEFT adapter ``options.peft`` (at ``options.revision``), merged unless
    ``options.merge_adapter`` is false (module doc). ``keeper``: ``model`` is its kept base
    (:mod:`~distperp_harness.model.kept_base`), told how to undo this adapter, or dropped where it cannot be."""
    _require_peft()
    from peft import PeftModel

    source = options.peft
    if source is None:
        raise InputError("apply_peft needs peft=<adapter folder or hub id>; none was given.")
    kept = keeper.kept if keeper is not None and keeper.holds(model) else None
    if tokenizer is not None and _vocab_size(model) != len(tokenizer):
        if keeper is not None:
            keeper.drop()  # resized embeddings are not the base's: the next adapter loads its own
            kept = None
        log.info(
            f"distperp: the model's vocabulary ({_vocab_size(model)}) differs from the tokenizer's "
            f"({len(tokenizer)}): resizing the embeddings before applying the adapter (as lm-eval hf)",
            main_process_only=True,
        )
        getattr(model, "resize_token_embeddings")(len(tokenizer))  # noqa: B009 - a transformers model's method
    device = next(model.parameters()).device
    try:
        peft_model = PeftModel.from_pretrained(
            model, os.path.expanduser(source), revision=options.revision, torch_device=str(device), is_trainable=False
        )
    except (OSError, ValueError) as exc:
        if keeper is not None:
            keeper.drop()  # PEFT may have injected layers before failing
        raise InputError(
            f"could not load a PEFT adapter from peft={source!r}: {exc}. Fix: give the folder (or hub "
            "id) holding adapter_config.json and adapter_model.safetensors."
        ) from exc
    config = peft_model.peft_config[peft_model.active_adapter]
    targets = getattr(config, "target_modules", None)
    common: dict[str, Any] = dict(
        kind="peft",
        source=source,
        peft_type=str(getattr(config.peft_type, "value", config.peft_type)),
        rank=getattr(config, "r", None),
        target_modules=sorted(targets) if targets else None,
    )
    if kept is not None and keeper is not None:
        why = adapter_keepable(config)
        if why is not None:
            log.info(f"distperp: the base is not kept across adapters: {source} has {why}", main_process_only=True)
            keeper.drop()
            kept = None
    if not options.merge_adapter:  # the transformers model, its Linears replaced by PEFT's LoRA layers in place
        peft_model.eval()
        if kept is not None:
            kept.unmerged(peft_model)
        return cast(torch.nn.Module, peft_model.base_model.model), AdapterReport(
            **common, merged=False, note=f"PEFT adapter {source} applied unmerged (merge_adapter=false)."
        )
    if kept is not None:
        kept.before_merge(peft_model)
    merged = peft_model.merge_and_unload()
    if kept is not None and keeper is not None and merged is not kept.model:
        keeper.drop()  # PEFT returned another object: nothing to restore into
    when = f" before quantize={options.quantize}" if options.quantize != "none" else ""
    return merged, AdapterReport(
        **common,
        merged=True,
        note=f"PEFT adapter {source} merged into the weights{when} "
        f"(in {str(next(merged.parameters()).dtype).removeprefix('torch.')}).",
    )


def apply_delta(model: torch.nn.Module, delta: torch.nn.Module, source: str) -> AdapterReport:
    """Add ``delta``'s parameters to ``model``'s, name by name, in place (lm-eval ``hf``'s ``delta=``)."""
    theirs = delta.state_dict()
    seen: set[int] = set()  # a tied weight appears under two names: add its delta once
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if param.data_ptr() in seen:
                continue
            seen.add(param.data_ptr())
            if name not in theirs:
                raise InputError(
                    f"delta={source!r} has no weight {name!r} of the base model. Fix: give a delta "
                    "checkpoint saved from the same architecture as pretrained=."
                )
            if theirs[name].shape != param.shape:
                raise InputError(
                    f"delta={source!r}: weight {name!r} has shape {tuple(theirs[name].shape)}, the "
                    f"base's is {tuple(param.shape)}. Fix: a delta of the same architecture."
                )
            param.add_(theirs[name].to(device=param.device, dtype=param.dtype))
    return AdapterReport(kind="delta", source=source, merged=True, note=f"delta weights {source} added to the base's.")
