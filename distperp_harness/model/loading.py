"""Builders: tokenizer and model from :class:`~distperp_harness.options.Options`.

Plain functions (torchtune's builder style). The model is any Hugging Face causal LM, from a hub id or a local
folder; hub loading is the real code path users run (it needs network access, which tests do not have).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from accelerate.logging import get_logger

from distperp_harness.errors import InputError
from distperp_harness.model import parts
from distperp_harness.model.adapters import AdapterReport, apply_delta, apply_peft
from distperp_harness.model.checkpoint import check_gguf, refuse_on_stored, source_kwargs, stored_quantization
from distperp_harness.model.kept_base import kept_base
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
        raise InputError(
            f"{what}={name!r}: no such model folder (expected a directory with config.json); "
            "give an existing local folder or a Hugging Face hub id like 'org/name'"
        )


_LAST_TOKENIZER: list[tuple[tuple, Any]] = []
"""The tokenizer :func:`load_tokenizer` loaded last and what it was loaded from: the fit check and the load stage
of one run read one tokenizer (a 262k-entry tokenizer is a 33 MB file)."""


def load_tokenizer(options: Options):
    """The tokenizer of ``options.tokenizer`` or ``options.pretrained``, with a pad token (loaded once for the same
    source, revision and loading options, one after the other)."""
    key = (
        options.tokenizer, options.pretrained, options.revision, options.trust_remote_code, options.subfolder,
        options.gguf_file, options.add_bos_token, _tokenizer_files(options.tokenizer or options.pretrained),
    )  # fmt: skip
    if _LAST_TOKENIZER and _LAST_TOKENIZER[0][0] == key:
        return _LAST_TOKENIZER[0][1]
    tokenizer = _load_tokenizer(options)
    _LAST_TOKENIZER[:] = [(key, tokenizer)]
    return tokenizer


_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "spiece")


def _tokenizer_files(source: str | None) -> tuple:
    """Names, sizes and modification times of a local folder's tokenizer files (a folder rewritten between two
    loads is read again); empty for a hub id."""
    folder = os.path.expanduser(source or "")
    if not os.path.isdir(folder):
        return ()
    found = []
    for entry in os.scandir(folder):
        if entry.name.startswith(_TOKENIZER_FILES) or entry.name.endswith(".model"):
            stat = entry.stat()
            found.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


def _load_tokenizer(options: Options):
    import transformers

    source = options.tokenizer or options.pretrained
    _check_source(source, "tokenizer" if options.tokenizer else "pretrained")
    kwargs = {"revision": options.revision, "trust_remote_code": options.trust_remote_code}
    if not options.tokenizer:  # a GGUF file holds its tokenizer; a subfolder holds the checkpoint's (as hf)
        check_gguf(options)
        kwargs.update(source_kwargs(options))
    if options.tokenizer:
        parts.check_tokenizer_files(source, "tokenizer")
    elif not options.gguf_file:
        parts.check_tokenizer_files(source, "pretrained", options.subfolder)
    if options.add_bos_token is not None:
        kwargs["add_bos_token"] = options.add_bos_token
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.expanduser(source), **kwargs)
    except (OSError, ValueError) as exc:
        raise InputError(f"could not load a tokenizer from {source!r}: {exc}") from exc
    # Whole documents are tokenized, then cut into windows of max_length: a text longer than the tokenizer's
    # model_max_length is expected, and transformers' warning about it ("indexing errors") does not apply.
    getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def load_model(
    options: Options,
    device: torch.device,
    dtype: torch.dtype | str,
    source: str | None = None,
    key: str = "pretrained",
    quantization_config: Any = None,
    distributed_config: Any = None,
):
    """The causal LM at ``source`` (default ``options.pretrained``) in ``dtype`` on ``device``, in eval mode.

    ``key``: the ``--model_args`` key that named ``source``, for error messages; only ``pretrained`` gets
    ``subfolder``/``gguf_file``. With ``quantization_config`` (a ``transformers.TorchAoConfig``) the checkpoint is
    read tensor by tensor straight onto ``device`` (``device_map``) and each selected Linear weight is quantized
    as soon as it is loaded. A checkpoint saved already quantized loads as saved (its stored config applies).
    ``distributed_config``: the tensor-parallel config of :func:`~distperp_harness.model.tensor_parallel.tp_loading`
    (each rank reads its slices onto ``device``; the checkpoint's config is checked for a TP plan first).
    """
    import transformers

    source = source or options.pretrained
    _check_source(source, key)
    if key == "pretrained":
        check_gguf(options)
    kwargs: dict[str, Any] = {
        "revision": options.revision,
        "trust_remote_code": options.trust_remote_code,
        "dtype": dtype,
        **source_kwargs(options, key),
    }
    if options.attn_implementation:
        kwargs["attn_implementation"] = options.attn_implementation
    if hasattr(transformers.PreTrainedModel, "set_use_kernels"):
        # Hub kernels (on by default when the `kernels` package is installed) swap layers for kernels fetched from
        # the Hub when the model loads onto a GPU: offline that load fails, and online the numerics are the
        # kernels'. distperp computes with the checkpoint's own modules.
        kwargs["use_kernels"] = False
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        if distributed_config is None:  # with TP, transformers places each slice on the mesh's device itself
            kwargs["device_map"] = {"": str(device)}
    if distributed_config is not None:
        from distperp_harness.model.tensor_parallel import check_tp_plan

        check_tp_plan(load_config(options, source, key), int(distributed_config.tp_size), source)
        kwargs["distributed_config"] = distributed_config
    if not kwargs.get("gguf_file"):  # every weight file's header, before any weight is read
        parts.check_weight_files(source, key, kwargs.get("subfolder"))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.expanduser(source), **kwargs)
    except (OSError, ValueError) as exc:
        raise InputError(f"could not load a causal LM from {key}={source!r}: {exc}") from exc
    except Exception as exc:  # a hub checkpoint's cached file cut short (local folders are checked above)
        parts.refuse_damaged(exc, key, source)
        raise
    if quantization_config is None:
        _to_device(model, device, source)
    model.eval()
    model.requires_grad_(False)
    return model


def _to_device(model: torch.nn.Module, device: torch.device, source: str) -> None:
    """``model.to(device)``, except where the model's quantizer placed it already and refuses moves (bitsandbytes:
    lm-eval hf catches the same error)."""
    try:
        model.to(device)
    except ValueError as exc:
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            placed = next(model.parameters()).device
            if placed.type != device.type:
                raise InputError(
                    f"{source!r} is a bitsandbytes checkpoint placed on {placed} by its quantizer, "
                    f"which cannot be moved to {device} ({exc}). Fix: device={placed.type}."
                ) from exc
            return
        raise


TABLE_KEYS = ("max_seq_len", "seq_length", "max_sequence_length")
"""Config keys of a position table lm-eval's ``resolve_max_length`` does not read (MPT's ALiBi table is
``max_seq_len``): a defaulted ``max_length`` never plans a row past it."""


def model_max_length(options: Options, model, tokenizer) -> int:
    """``options.max_length`` or the model's context length, resolved as lm-eval's ``hf`` model does, but never
    past a position table the config declares under :data:`TABLE_KEYS` (a row past it fails in the model)."""
    if options.max_length:
        return options.max_length
    from lm_eval.models.utils import DEFAULT_MAX_LENGTH, resolve_max_length

    resolved = resolve_max_length(model.config, tokenizer, default=DEFAULT_MAX_LENGTH)
    config = getattr(model.config, "text_config", None) or model.config
    tables = [getattr(config, key, None) for key in TABLE_KEYS]
    return min([resolved, *(t for t in tables if isinstance(t, int) and not isinstance(t, bool) and t > 0)])


def load_config(options: Options, source: str | None = None, key: str = "pretrained"):
    """The transformers config of ``source`` (default: ``pretrained``, with its ``subfolder``/``gguf_file``)."""
    import transformers

    source = source or options.pretrained
    _check_source(source, key)
    if key == "pretrained":
        check_gguf(options)
    try:
        return transformers.AutoConfig.from_pretrained(
            os.path.expanduser(source),
            revision=options.revision,
            trust_remote_code=options.trust_remote_code,
            **source_kwargs(options, key),
        )
    except (OSError, ValueError) as exc:
        raise InputError(f"could not load a causal LM from {key}={source!r}: {exc}") from exc


def skeleton(options: Options, dtype: torch.dtype | str, source: str | None = None, key: str = "pretrained"):
    """The model's modules and parameter shapes on the ``meta`` device (no memory, no weights read), in ``dtype``
    (``"auto"``: the checkpoint's, as its config records it)."""
    import transformers

    config = load_config(options, source, key)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        extra = {"attn_implementation": options.attn_implementation} if options.attn_implementation else {}
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=options.trust_remote_code, **extra
        )


def load_quantized(options: Options, device: torch.device, dtype: torch.dtype | str, distributed_config: Any = None):
    """The model with ``options.quantize`` applied *while loading*, and its
    :class:`~distperp_harness.model.quantize.QuantReport`.

    The layer choice (:func:`~distperp_harness.model.quantize.select_layers`) is made on a ``meta`` skeleton, then
    transformers' ``TorchAoConfig`` path loads the checkpoint tensor by tensor onto ``device``, quantizing each
    chosen Linear weight with the same torchao config as soon as it arrives (``modules_to_not_convert``: exactly
    the skipped layers). The unquantized model is never whole on any device; the quantized weights are the same
    bits as quantizing after loading (tests/model/test_loading.py). A tied output embedding that ``quantize_lm_head``
    asks to quantize takes the quantize-after-load path (untying happens there), and a note says so.
    """
    import transformers

    from distperp_harness.model.quantize import SCHEMES, _import_torchao, finish_report, quantize_model, select_layers

    scheme = options.quantize
    # "auto" reaches here only for schemes whose plans do not read the dtype (int8, 8da4w: no preferred dtype)
    plan = SCHEMES[scheme].plan(cast(torch.dtype, dtype), options.group_size, device)
    meta = skeleton(options, dtype)
    selection = select_layers(meta, plan, options.quantize_lm_head)
    if distributed_config is not None and plan.storage != "int8":  # group-wise schemes: groups within a slice
        from distperp_harness.model.tensor_parallel import rowwise_slices_too_narrow

        narrow = rowwise_slices_too_narrow(
            meta, int(distributed_config.tp_size), options.group_size, selection.selected
        )
        selection.selected = [name for name in selection.selected if name not in narrow]
        selection.skipped.update(narrow)
    if selection.notes:  # quantizing a tied head unties it, which transformers' loader does not do
        if distributed_config is not None:
            raise InputError(
                f"quantize_lm_head=true with tp_size={distributed_config.tp_size}: this model's output "
                "head is tied to its input embeddings, and quantizing it means untying it after "
                "loading, which a tensor-parallel slice cannot do. Fix: quantize_lm_head=false, or "
                "tp_size=1."
            )
        model = load_model(options, device, dtype)
        report = quantize_model(model, scheme, group_size=options.group_size, include_lm_head=options.quantize_lm_head)
        return model, dataclasses.replace(
            report,
            notes=report.notes + ("Quantized after loading (a tied output embedding is quantized by untying it).",),
        )
    _import_torchao()
    start = time.perf_counter()
    config = transformers.TorchAoConfig(
        quant_type=plan.config, modules_to_not_convert=[re.escape(name) for name in selection.skipped]
    )
    model = load_model(options, device, dtype, quantization_config=config, distributed_config=distributed_config)
    common = dict(
        scheme=scheme,
        storage=plan.storage,
        note=plan.note,
        device_type=device.type,
        model_dtype=str(dtype).removeprefix("torch."),
        include_lm_head=options.quantize_lm_head,
        weight_bytes_before=sum(p.numel() * p.element_size() for p in meta.parameters()),
    )
    selection.notes.append(
        "Quantized while loading (transformers TorchAoConfig, tensor by tensor); seconds include loading."
    )
    return model, finish_report(model, scheme, plan, options.group_size, selection, common, time.perf_counter() - start)


@dataclass
class Loaded:
    """Everything the load stage builds: tokenizer, (quantized) model, optional reference, and facts about them.

    ``weight_bytes`` / ``reference_weight_bytes``: stored bytes of one whole copy (unsharded). ``sharding``: the
    :class:`~distperp_harness.model.sharding.ShardReport` of each sharded model (``model``, ``reference``).
    ``load_memory``: this rank's :meth:`~distperp_harness.model.memory.LoadMeter.stop` report of the load stage.
    ``adapter``: what ``peft=``/``delta=`` applied; ``stored_quantization``: the config a pre-quantized checkpoint
    was saved with (None for full-precision checkpoints). ``int4_products``: the
    :class:`~distperp_harness.model.int4_products.Int4Products` of a model holding packed int4 weights.
    """

    device: torch.device
    tokenizer: Any
    model: torch.nn.Module
    reference: torch.nn.Module | None
    quant_report: Any | None
    weight_bytes: int
    max_length: int
    reference_weight_bytes: int | None = None
    sharding: dict[str, Any] = field(default_factory=dict)
    load_memory: dict[str, Any] = field(default_factory=dict)
    adapter: AdapterReport | None = None
    stored_quantization: dict | None = None
    int4_products: Any | None = None


def load_adapted(
    options: Options,
    device: torch.device,
    dtype: torch.dtype | str,
    tokenizer: Any,
    distributed_config: Any = None,
    keep: bool = False,
) -> tuple[torch.nn.Module, AdapterReport | None]:
    """``pretrained`` unquantized on ``device`` in ``dtype``, with its ``peft=`` adapter or ``delta=`` weights applied
    (:mod:`~distperp_harness.model.adapters`); without either, :func:`load_model` (tensor-parallel with
    ``distributed_config``; options refuse adapters then). ``keep``: a ``peft=`` base may come from (and stay in)
    the enclosing :func:`~distperp_harness.model.kept_base.keeping_base` (the model loaded plainly: the caller's
    say)."""
    keeper = kept_base() if keep and options.peft and distributed_config is None else None
    if keeper is not None:
        model = keeper.base(options, device, dtype, lambda: load_model(options, device, dtype)).model
    else:
        model = load_model(options, device, dtype, distributed_config=distributed_config)
    if options.peft:
        model, report = apply_peft(model, options, tokenizer, keeper)
        model.requires_grad_(False)
        return model, report
    if options.delta:
        delta = load_model(options, torch.device("cpu"), dtype, source=options.delta, key="delta")
        report = apply_delta(model, delta, options.delta)
        del delta
        return model, report
    return model, None


def load_all(
    options: Options, device: torch.device, mesh: Any = None, given: Any = None, tp_mesh: Any = None
) -> Loaded:
    """:func:`_load_all`; with ``tp_mesh`` (``tp_size`` > 1, :func:`~distperp_harness.model.tensor_parallel.
    make_tp_mesh`), the model and the reference are loaded tensor-parallel on it, each rank reading its slices."""
    if tp_mesh is None:
        return _load_all(options, device, mesh, given)
    from distperp_harness.model.tensor_parallel import tp_loading, tp_report, whole_bytes

    with tp_loading(tp_mesh, device) as config:
        loaded = _load_all(options, device, None, given, config)
    size = int(tp_mesh.size(-1))
    loaded.weight_bytes = whole_bytes(loaded.model, size)
    loaded.sharding = {"model": tp_report(loaded.model, size, "model")}
    if loaded.reference is not None:
        loaded.reference_weight_bytes = whole_bytes(loaded.reference, size)
        loaded.sharding["reference"] = tp_report(loaded.reference, size, "reference")
    for report in loaded.sharding.values():
        log.info(report.note, main_process_only=True)
    return loaded


def _load_all(
    options: Options, device: torch.device, mesh: Any = None, given: Any = None, distributed_config: Any = None
) -> Loaded:
    """Tokenizer → model on ``device`` (quantized while loading) → reference; with ``mesh``, both sharded.

    The reference (``reference=base`` or a path) is loaded unquantized in the dtype the user asked for (``auto``: the
    checkpoint's), so KL divergence measures everything ``quantize=`` changed, including a bf16 cast it implied.
    ``reference=base`` keeps a ``peft=``/``delta=`` fine-tune (the same weights, unquantized); ``reference=pretrained``
    is the checkpoint without them (what the fine-tune changed). With an adapter and ``quantize=``, the adapter is
    merged into the unquantized weights first and the merged model is quantized after loading (a note in the
    quantization report says so); so is a ``gguf_file`` checkpoint. A checkpoint saved already quantized loads as saved;
    ``quantize=`` or ``reference=base`` on it is refused (:func:`~distperp_harness.model.checkpoint. refuse_on_stored`).
    With ``mesh`` (``shard_size`` > 1) an unquantized model is read into host memory (memory-mapped where the dtype
    allows) and FSDP2 moves it to ``device`` one layer at a time as it shards it
    (:func:`~distperp_harness.model.sharding.shard_model`); a quantized model is quantized on ``device`` while loading
    and then sharded except for its torchao weights. Every rank must call this together when ``mesh`` is given.
    ``given``: a :class:`~distperp_harness.model.given.Given` in-memory model (and tokenizer), used as it is.
    """
    from distperp_harness.model.int4_products import install as install_int4_products
    from distperp_harness.model.memory import LoadMeter
    from distperp_harness.model.quantize import quantize_model, resolve_model_dtype, weight_bytes
    from distperp_harness.model.sharding import shard_model

    meter = LoadMeter(device)
    if given is not None:
        return _load_given(options, device, given, meter)
    tokenizer = load_tokenizer(options)
    asked = torch_dtype(options.dtype)
    config = load_config(options)
    parts.check_positions(options.max_length, config, "pretrained", options.pretrained)  # before any weight is read
    stored = stored_quantization(config)
    refuse_on_stored(options, stored)
    staging = device if mesh is None else torch.device("cpu")  # FSDP2 moves each unit to the device as it shards
    report = adapter = None
    if options.quantize != "none":
        preferred, note = resolve_model_dtype(options.quantize, options.dtype, device)
        log.info(note, main_process_only=True)
        dtype = asked if preferred is None else preferred
        if options.peft or options.delta or options.gguf_file:  # merge first, then quantize the merged weights
            model, adapter = load_adapted(options, device, dtype, tokenizer)
            report = quantize_model(
                model, options.quantize, group_size=options.group_size, include_lm_head=options.quantize_lm_head
            )
            why = (
                adapter.note
                if adapter
                else ("transformers dequantizes a GGUF file while loading and cannot quantize it in the same pass.")
            )
            report = dataclasses.replace(report, notes=report.notes + (f"Quantized after loading: {why}",))
        else:
            model, report = load_quantized(options, device, dtype, distributed_config)
        log.info(report.summary(), main_process_only=True)
    else:
        keep = mesh is None and distributed_config is None  # a kept base stays as loaded: never sharded here
        model, adapter = load_adapted(options, staging, asked, tokenizer, distributed_config, keep=keep)
    if adapter is not None:
        log.info(f"distperp: {adapter.note}", main_process_only=True)
    if stored is not None:
        log.info(
            f"distperp: pretrained={options.pretrained!r} was saved quantized "
            f"(quant_method={stored.get('quant_method')!r}); loaded as saved",
            main_process_only=True,
        )
    products = install_int4_products(model, options.int4_prefill, tensor_parallel=distributed_config is not None)
    if products is not None:
        log.info(products.summary(), main_process_only=True)
    sharding: dict[str, Any] = {}
    model_bytes = weight_bytes(model)
    if mesh is not None:
        sharding["model"] = shard_model(model, mesh, what="model")
    reference, reference_bytes = None, None
    if options.reference is not None:
        if options.reference == "base":
            reference, _ = load_adapted(options, staging, asked, tokenizer, distributed_config)
        elif options.reference == "pretrained":
            reference = load_model(options, staging, asked)
        else:
            reference = load_model(
                options,
                staging,
                asked,
                source=options.reference,
                key="reference",
                distributed_config=distributed_config,
            )
        reference_bytes = weight_bytes(reference)
        if mesh is not None:
            sharding["reference"] = shard_model(reference, mesh, what="reference")
    for shard_report in sharding.values():
        log.info(shard_report.note, main_process_only=True)
    parts.check_fit(options, tokenizer, model, reference)
    max_length = model_max_length(options, model, tokenizer)
    if options.stride is not None and options.stride > max_length:
        raise InputError(
            f"stride={options.stride} is not valid: need 0 < stride <= max_length ({max_length}). "
            "Fix: lower stride or set max_length."
        )
    return Loaded(
        device,
        tokenizer,
        model,
        reference,
        report,
        model_bytes,
        max_length,
        reference_weight_bytes=reference_bytes,
        sharding=sharding,
        load_memory=meter.stop(),
        adapter=adapter,
        stored_quantization=stored,
        int4_products=products,
    )


def _load_given(options: Options, device: torch.device, given: Any, meter: Any) -> Loaded:
    """The caller's model as it is (model/given.py), its tokenizer (given, or loaded), a ``reference=<path>``."""
    from distperp_harness.model.given import place
    from distperp_harness.model.quantize import weight_bytes

    tokenizer = given.tokenizer if given.tokenizer is not None else load_tokenizer(options)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    model = place(given.model, device)
    parts.check_positions(options.max_length, model.config, "pretrained", options.pretrained)
    reference = None
    if options.reference is not None:
        reference = load_model(options, device, torch_dtype(options.dtype), source=options.reference, key="reference")
    parts.check_fit(options, tokenizer, model, reference)
    return Loaded(
        device,
        tokenizer,
        model,
        reference,
        None,
        weight_bytes(model),
        model_max_length(options, model, tokenizer),
        reference_weight_bytes=weight_bytes(reference) if reference is not None else None,
        load_memory=meter.stop(),
    )


def check_prefix_token(token: int, models: list[torch.nn.Module], given: bool) -> None:
    """``token`` (the prefix token id: ``given`` in ``--model_args``, or the tokenizer's BOS/EOS) must index every
    model's embeddings: else it would load, then fail at the first batch (an ``IndexError``; a device-side assert on
    CUDA). Raises ``ValueError`` naming the fix."""
    rows = min(parts.embedding_rows(m) for m in models)
    if not 0 <= token < rows:
        what = "prefix_token_id" if given else "the tokenizer's BOS/EOS id"
        raise InputError(
            f"{what}={token} is not a token of this model: its embeddings hold ids 0..{rows - 1}. "
            f"Fix: pass prefix_token_id=<an id below {rows}> in --model_args (e.g. the BOS id)."
        )
