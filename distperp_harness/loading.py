"""Builders: tokenizer and model from :class:`~distperp_harness.options.Options`.

Plain functions (torchtune's builder style). The model is any Hugging Face causal LM, from a hub id or a local
folder; hub loading is the real code path users run (it needs network access, which tests do not have).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.logging import get_logger

from distperp_harness.options import Options

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype | str:
    """``"auto"`` (the checkpoint's dtype) or a torch dtype."""
    return "auto" if name == "auto" else _DTYPES[name]


def _check_source(name: str, what: str) -> None:
    """Fail early and clearly on a path that looks local but does not exist."""
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if os.path.isdir(os.path.expanduser(name)):
        return
    if looks_local or os.path.exists(name):
        raise ValueError(f"{what}={name!r}: no such model folder (expected a directory with config.json); "
                         "give an existing local folder or a Hugging Face hub id like 'org/name'")


def load_tokenizer(options: Options):
    """The tokenizer of ``options.tokenizer`` or ``options.pretrained``, with a pad token."""
    import transformers

    source = options.tokenizer or options.pretrained
    _check_source(source, "tokenizer" if options.tokenizer else "pretrained")
    kwargs = {"revision": options.revision, "trust_remote_code": options.trust_remote_code}
    if options.add_bos_token is not None:
        kwargs["add_bos_token"] = options.add_bos_token
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.expanduser(source), **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {source!r}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def load_model(options: Options, device: torch.device, dtype: torch.dtype | str, source: str | None = None,
               key: str = "pretrained"):
    """The causal LM at ``source`` (default ``options.pretrained``) in ``dtype`` on ``device``, in eval mode.

    ``key``: the ``--model_args`` key that named ``source``, for error messages.
    """
    import transformers

    source = source or options.pretrained
    _check_source(source, key)
    kwargs = {"revision": options.revision, "trust_remote_code": options.trust_remote_code, "dtype": dtype}
    if options.attn_implementation:
        kwargs["attn_implementation"] = options.attn_implementation
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.expanduser(source), **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a causal LM from {key}={source!r}: {exc}") from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def model_max_length(options: Options, model, tokenizer) -> int:
    """``options.max_length`` or the model's context length, resolved as lm-eval's ``hf`` model does."""
    if options.max_length:
        return options.max_length
    from lm_eval.models.utils import DEFAULT_MAX_LENGTH, resolve_max_length

    return resolve_max_length(model.config, tokenizer, default=DEFAULT_MAX_LENGTH)


@dataclass
class Loaded:
    """Everything the load stage builds: tokenizer, (quantized) model, optional reference, and facts about them."""

    device: torch.device
    tokenizer: Any
    model: torch.nn.Module
    reference: torch.nn.Module | None
    quant_report: Any | None
    weight_bytes: int
    max_length: int


def load_all(options: Options, device: torch.device) -> Loaded:
    """Tokenizer → model on ``device`` (in the dtype quantization needs) → reference → quantization.

    The reference (``reference=base`` or a path) is loaded unquantized in the dtype the user asked for (``auto``:
    the checkpoint's), so KL divergence measures everything ``quantize=`` changed, including a bf16 cast it implied.
    """
    from distperp_harness.quantize import quantize_model, resolve_model_dtype, weight_bytes

    tokenizer = load_tokenizer(options)
    asked = torch_dtype(options.dtype)
    dtype = asked
    if options.quantize != "none":
        dtype, note = resolve_model_dtype(options.quantize, options.dtype, device)
        log.info(note, main_process_only=True)
    model = load_model(options, device, asked if dtype is None else dtype)
    reference = None
    if options.reference == "base":
        if options.quantize == "none":
            raise ValueError("reference=base compares against the unquantized checkpoint, but quantize=none. "
                             "Fix: add quantize=int4 (or int8, 8da4w), or give reference=<other model path>.")
        reference = load_model(options, device, asked)
    elif options.reference is not None:
        reference = load_model(options, device, asked, source=options.reference, key="reference")
    report = None
    if options.quantize != "none":
        report = quantize_model(model, options.quantize, group_size=options.group_size,
                                include_lm_head=options.quantize_lm_head)
        log.info(report.summary(), main_process_only=True)
    max_length = model_max_length(options, model, tokenizer)
    if options.stride is not None and options.stride > max_length:
        raise ValueError(f"stride={options.stride} is not valid: need 0 < stride <= max_length ({max_length}). "
                         "Fix: lower stride or set max_length.")
    return Loaded(device, tokenizer, model, reference, report, weight_bytes(model), max_length)
