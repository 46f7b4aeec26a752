"""One loaded base kept across PEFT adapters, for in-process callers that evaluate several adapters of one base
(``series``): the base is read once, and each adapter after the first is applied to it as to a fresh load.

Use: ``with keeping_base():`` around the evaluations; :func:`~distperp_harness.model.loading.load_adapted` then
asks :func:`kept_base` for the base of a ``peft=`` model instead of loading it, when the model is loaded plainly
(``quantize=none``, neither sharded nor tensor-parallel: those change the weights' storage after the adapter).

Contract (bits): the base handed to an adapter holds the bits a fresh load gives, so each adapter's results are
bit-identical to ``--model_args pretrained=BASE,peft=ADAPTER`` alone:

* ``merge_adapter=true`` (default): PEFT merges ``W + B A`` into the base weights in place, and merging the other
  way (``unmerge``) does not give ``W`` back bit for bit. So before the merge the weights it writes (each LoRA
  layer's base weight and bias) are copied aside on the CPU (:meth:`KeptBase.before_merge`), and written back before
  the next adapter applies.
* ``merge_adapter=false``: the adapter's LoRA layers wrap the untouched base Linears; PEFT's ``unload()`` (without
  merging) puts the base Linears back.

After restoring, the model's parameter names and shapes must be the base's (checked; else it is loaded again). Not
kept (the base is loaded fresh for that adapter, and the kept one dropped): an adapter that is not LoRA, or has
``modules_to_save`` / trainable tokens (PEFT swaps whole modules for those), or needs the embeddings resized (a
tokenizer longer than the base's vocabulary), or a load with other options than the kept base's (``peft=`` and
``resume_dir`` aside). An adapter that fails to apply drops the kept base (PEFT may have left layers in it).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from accelerate.logging import get_logger

from distperp_harness.options import Options

log = get_logger(__name__)

_KEEPER: contextvars.ContextVar[BaseKeeper | None] = contextvars.ContextVar("distperp_kept_base", default=None)


def _load_key(options: Options, device: torch.device, dtype: Any) -> tuple:
    """What loaded a base: every option but ``peft`` and ``resume_dir`` (which do not change the base), the device
    and the dtype."""
    chosen = tuple(sorted((k, repr(v)) for k, v in options.to_dict().items() if k not in ("peft", "resume_dir")))
    return (chosen, str(device), str(dtype))


def _shapes(model: torch.nn.Module) -> dict[str, tuple]:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: (tuple(t.shape), t.dtype) for name, t in named.items()}


@dataclass
class KeptBase:
    """The base model, what loaded it (:func:`_load_key`), its parameter names and shapes as loaded, and how to undo
    the adapter applied to it last (None: nothing applied)."""

    key: tuple
    model: torch.nn.Module
    shapes: dict[str, tuple]
    undo: Callable[[], torch.nn.Module] | None = None
    adapters: int = 0

    def restore(self) -> bool:
        """Undo the last adapter; True when the model has the base's names and shapes again."""
        if self.undo is not None:
            self.model, self.undo = self.undo(), None
        self.model.eval()
        return _shapes(self.model) == self.shapes

    def before_merge(self, peft_model: Any) -> None:
        """Copy aside (CPU) each tensor that merging ``peft_model``'s LoRA layers writes (:meth:`restore`)."""
        from peft.tuners.lora import LoraLayer

        saved: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in peft_model.base_model.model.named_modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                saved[name] = {k: v.detach().to("cpu", copy=True) for k, v in base.named_parameters(recurse=False)}

        def undo() -> torch.nn.Module:
            with torch.no_grad():
                for name, tensors in saved.items():
                    module = self.model.get_submodule(name)
                    for key, value in tensors.items():
                        getattr(module, key).copy_(value)
            return self.model

        self.undo = undo

    def unmerged(self, peft_model: Any) -> None:
        """``peft_model`` stays unmerged: undo is PEFT's ``unload()`` (the base Linears back, untouched)."""
        self.undo = lambda: peft_model.unload()


@dataclass
class BaseKeeper:
    """What :func:`keeping_base` holds: the kept base (None before the first adapter or after a drop) and counts for
    the log (``loads``: bases read, ``reuses``: adapters applied to a kept one)."""

    kept: KeptBase | None = None
    loads: int = 0
    reuses: int = 0
    notes: list[str] = field(default_factory=list)

    def base(self, options: Options, device: torch.device, dtype: Any, load: Callable[[], Any]) -> KeptBase:
        """The kept base for this load, restored; else ``load()`` kept as the new base."""
        key = _load_key(options, device, dtype)
        kept = self.kept
        if kept is not None and kept.key == key:
            if kept.restore():
                self.reuses += 1
                kept.adapters += 1
                log.info(
                    f"distperp: base {options.pretrained} reused for peft={options.peft} (loaded once, its weights as "
                    "loaded)",
                    main_process_only=True,
                )
                return kept
            self.notes.append(f"the base's weights differed after {options.peft}'s predecessor: loaded again")
        self.drop()
        model = load()
        self.loads += 1
        self.kept = KeptBase(key, model, _shapes(model), adapters=1)
        return self.kept

    def drop(self) -> None:
        """Forget the kept base (the next adapter loads its own)."""
        self.kept = None

    def holds(self, model: Any) -> bool:
        return self.kept is not None and self.kept.model is model


def adapter_keepable(peft_config: Any) -> str | None:
    """Why the base of an adapter with ``peft_config`` cannot be kept across adapters (module doc), or None."""
    kind = str(getattr(peft_config.peft_type, "value", peft_config.peft_type))
    if kind != "LORA":
        return f"a {kind} adapter (only LoRA's merge is undone)"
    if getattr(peft_config, "modules_to_save", None):
        return "modules_to_save (PEFT replaces those modules)"
    if getattr(peft_config, "trainable_token_indices", None):
        return "trainable_token_indices (PEFT replaces the embeddings)"
    return None


def kept_base() -> BaseKeeper | None:
    """The keeper of the enclosing :func:`keeping_base`, or None."""
    return _KEEPER.get()


@contextlib.contextmanager
def keeping_base() -> Iterator[BaseKeeper]:
    """Keep one PEFT base across the loads inside (module doc); dropped when the block ends."""
    keeper = BaseKeeper()
    token = _KEEPER.set(keeper)
    try:
        yield keeper
    finally:
        keeper.drop()
        _KEEPER.reset(token)
