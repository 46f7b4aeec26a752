"""Know before loading: does the run fit each device? An estimate from the model's config alone, made at start.

Per rank, in bytes (:class:`Need`): the stored weights of the model (after ``quantize=``) and of the reference,
divided by ``shard_size`` where FSDP2 shards them (torchao-quantized weights stay whole on every rank); what a
sharded forward gathers on top of that (the embeddings and head for a whole batch, plus one decoder layer); and
the activations of the largest batch the batching rule allows (``batch_size=N``: N full-length rows;
``auto``: at least one full-length row, the rest is sized from memory). Shapes come from a ``meta``-device
skeleton: nothing is read or allocated. A checkpoint saved already quantized (a stored ``quantization_config``)
is sized from the bytes of its weight files instead of its full-precision skeleton.

:func:`check_fits` compares that with the free memory of every rank (on the CPU, the processes of a node share
it) and, where it does not fit, raises a ``ValueError`` on every rank with the numbers and the options that
would make it fit (a larger ``shard_size``, ``quantize=int4``, a smaller ``batch_size``), before any weight is
read: never an out-of-memory error mid-run.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from distperp_harness.errors import InputError
from distperp_harness.model.layers import decoder_layers
from distperp_harness.model.memory import activation_bytes_per_token, first_float_dtype, free_memory_bytes
from distperp_harness.options import Options, QuantScheme

if TYPE_CHECKING:
    from distperp_harness.distributed.protocol import Collective

log = logging.getLogger(__name__)

GiB = 2**30
# Stored bytes per weight element by quantized storage (scales: :func:`_scales`).
_PER_ELEMENT = {"int4-packed": 0.5, "int4-in-int8": 1.0, "int8": 1.0}


# NCCL's own buffers (channels, proxies; outside torch's allocator) for the shard group's communicator on CUDA:
# a stated margin, not a measurement (NCCL_BUFFSIZE 4 MiB per channel and peer, up to 32 channels).
COMM_MARGIN_CUDA = 1 * GiB


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs (module doc), each part named as :mod:`benchmarks.shard_check` measures it: weights it
    keeps; weights it gathers during a forward; one batch's activations; the logits chunks of scoring; a margin
    for communication buffers."""

    model: int
    reference: int
    gathered: int
    activations: int
    logits: int = 0
    comm: int = 0

    @property
    def total(self) -> int:
        return self.model + self.reference + self.gathered + self.activations + self.logits + self.comm

    def describe(self) -> str:
        parts = [
            f"model weights {self.model / GiB:.2f}",
            f"reference {self.reference / GiB:.2f}",
            f"gathered while computing {self.gathered / GiB:.2f}",
            f"activations of one batch {self.activations / GiB:.2f}",
            f"logits chunks {self.logits / GiB:.2f}",
        ]
        if self.comm:
            parts.append(f"communication buffers {self.comm / GiB:.2f}")
        return f"{' + '.join(parts)} = {self.total / GiB:.2f} GiB"


CPU = torch.device("cpu")
"""The device the estimate assumes when none is given."""


def _scales(storage: str, weight: torch.Tensor, group_size: int) -> float:
    """Bytes of the scales and zero points torchao stores next to a quantized weight (as its tensors hold them)."""
    if storage == "int8":  # per row: float32 scale, int8 zero point
        return weight.shape[0] * (4 + 1)
    groups = weight.numel() / group_size
    if storage == "int4-packed":  # scale and zero point per group, in the model dtype
        return groups * 2 * weight.element_size()
    return groups * (weight.element_size() + 1)  # int4-in-int8: model-dtype scale, int8 zero point


def _quantized_bytes(storage: str, weight: torch.Tensor, group_size: int, device: torch.device) -> float:
    """Stored bytes of one quantized ``[N, K]`` weight. CUDA's tinygemm layout (``Int4TilePackedTo4dTensor``)
    first pads K up to a multiple of 1024 and N up to a multiple of 8 (16 on ROCm), and stores the padding too."""
    if storage == "int4-packed" and device.type == "cuda":
        ntile = 16 if torch.version.hip else 8
        n, k = weight.shape[0], weight.shape[-1]
        n, k = -(-n // ntile) * ntile, -(-k // 1024) * 1024
        weight = torch.empty((n, k), dtype=weight.dtype, device="meta")
    return weight.numel() * _PER_ELEMENT[storage] + _scales(storage, weight, group_size)


def _stored(
    model: nn.Module, scheme: str, group_size: int, include_lm_head: bool, device: torch.device
) -> tuple[dict[int, float], set[int]]:
    """Stored bytes per parameter (by id) after ``scheme``, and the ids that torchao quantizes (kept whole)."""
    from distperp_harness.model.quantize import SCHEMES, select_layers

    dtype = next(model.parameters()).dtype
    sizes = {id(p): float(p.numel() * p.element_size()) for p in model.parameters()}
    if scheme == "none":
        return sizes, set()
    plan = SCHEMES[scheme].plan(dtype, group_size, device)
    selected = select_layers(model, plan, include_lm_head).selected
    modules = dict(model.named_modules())
    quantized = set()
    for name in selected:
        weight = modules[name].weight
        sizes[id(weight)] = _quantized_bytes(plan.storage, weight, group_size, device)
        quantized.add(id(weight))
    return sizes, quantized


def _parts(
    model: nn.Module,
    shard_size: int,
    *,
    scheme: str = "none",
    group_size: int = 128,
    include_lm_head: bool = False,
    device: torch.device = CPU,
    tensor_parallel: bool = False,
) -> tuple[int, int, int]:
    """``(resident bytes per rank, root group bytes, largest decoder layer bytes)``; the last two are what FSDP
    gathers (0 when unsharded; torchao-quantized weights are never gathered: they stay whole on every rank).
    ``tensor_parallel``: ``shard_size`` is a TP group's size: every matrix the TP plan covers (projections,
    embeddings, head; quantized or not) is split over it, the rest stays whole, nothing is gathered."""
    sizes, quantized = _stored(model, scheme, group_size, include_lm_head, device)
    if tensor_parallel and shard_size > 1:
        from distperp_harness.model.tensor_parallel import planned_matrices

        split = planned_matrices(model)
        return int(sum(b / shard_size if pid in split else b for pid, b in sizes.items())), 0, 0
    if shard_size <= 1:
        return int(sum(sizes.values())), 0, 0
    resident = sum(b if pid in quantized else b / shard_size for pid, b in sizes.items())
    in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    root = sum(b for pid, b in sizes.items() if pid not in in_layers and pid not in quantized)
    layer = max(
        (sum(sizes[id(p)] for p in lay.parameters() if id(p) not in quantized) for lay in decoder_layers(model)),
        default=0,
    )
    return int(resident), int(root), int(layer)


def weights_per_rank(
    model: nn.Module,
    shard_size: int,
    *,
    scheme: str = "none",
    group_size: int = 128,
    include_lm_head: bool = False,
    device: torch.device = CPU,
) -> tuple[int, int]:
    """``(resident bytes per rank, peak bytes gathered during a forward)`` of ``model`` (a meta skeleton) under
    ``scheme`` and ``shard_size`` (see :mod:`distperp_harness.model.sharding` for the layout). The root group
    (embeddings, final norm, head) stays gathered for a whole batch; a decoder layer counts twice while gathered:
    FSDP2 all-gathers into one flat buffer and then copies each parameter out of it."""
    resident, root, layer = _parts(
        model, shard_size, scheme=scheme, group_size=group_size, include_lm_head=include_lm_head, device=device
    )
    return resident, root + 2 * layer


def estimate(  # noqa: PLR0913 - the facts an estimate reads before loading, the last three defaulted
    options: Options,
    model: nn.Module,
    reference: nn.Module | None,
    shard_size: int,
    max_length: int,
    device: torch.device,
    batch_rows: int | None = None,
    stored_bytes: int | None = None,
    tensor_parallel: bool = False,
) -> Need:
    """What one rank needs (module doc); ``model``/``reference`` are meta skeletons in their load dtypes.
    ``tensor_parallel``: ``shard_size`` is the ``tp_size`` (matrices split, nothing gathered).

    ``stored_bytes``: for a checkpoint saved already quantized, the bytes of its weight files: its weights are
    sized from them (kept whole on every rank, as torchao weights are), not from the full-precision skeleton.

    Gathered: both roots (held for the whole batch) plus twice the largest decoder layer of either (the model's layers
    are released before the reference's forward). Activations: :func:`activation_bytes_per_token` in each model's
    compute dtype and attention implementation, for ``rows`` full-length rows. Logits:
    :func:`~distperp_harness.run.scoring.engine.forward.chunk_bytes`. Communication: :data:`COMM_MARGIN_CUDA` when
    sharded on CUDA (gloo's buffers on CPU are negligible).
    """
    from distperp_harness.run.scoring.engine.forward import chunk_bytes

    kept, root, layer = _parts(
        model,
        shard_size,
        scheme=options.quantize,
        group_size=options.group_size,
        include_lm_head=options.quantize_lm_head,
        device=device,
        tensor_parallel=tensor_parallel,
    )
    if stored_bytes is not None:  # torchao weights stay whole on an FSDP rank; a TP member reads its slices
        kept, root, layer = (stored_bytes // shard_size if tensor_parallel else stored_bytes), 0, 0
    ref_kept, ref_root, ref_layer = (
        (0, 0, 0) if reference is None else _parts(reference, shard_size, tensor_parallel=tensor_parallel)
    )
    rows = batch_rows if batch_rows is not None else (1 if options.auto_batch else int(options.batch_size))
    per_token = max(activation_bytes_per_token(m, max_length) for m in (model, reference) if m is not None)
    vocab = max(int(getattr(m.config, "vocab_size", 0) or 0) for m in (model, reference) if m is not None)
    logits = chunk_bytes(
        device.type, first_float_dtype(model), first_float_dtype(reference), positions=rows * max_length, vocab=vocab
    )
    comm = COMM_MARGIN_CUDA if device.type == "cuda" and shard_size > 1 else 0
    return Need(
        kept, ref_kept, root + ref_root + 2 * max(layer, ref_layer), rows * max_length * per_token, logits, comm
    )


def _fixes(  # noqa: PLR0913 - the bounds each candidate option is tried within, defaulted
    options: Options,
    need_for,
    room: int,
    shard_size: int,
    local_world: int,
    stored: bool = False,
    key: str = "shard_size",
    runs_on=lambda size: True,
) -> list[str]:
    """Options that would make the estimate fit ``room``, each with its total (``stored``: a pre-quantized
    checkpoint, which ``quantize=`` cannot apply to; ``key``: the group option in use, shard_size or tp_size;
    ``runs_on(size)``: whether the model runs on groups of that size)."""
    fixes = []
    for size in range(shard_size + 1, local_world + 1):
        if local_world % size == 0 and runs_on(size) and need_for(options, size, None).total <= room:
            fixes.append(f"{key}={size} ({need_for(options, size, None).total / GiB:.2f} GiB)")
            break
    if options.quantize == "none" and not stored:
        int4 = dataclasses.replace(options, quantize=QuantScheme.INT4)
        if need_for(int4, shard_size, None).total <= room:
            fixes.append(f"quantize=int4 ({need_for(int4, shard_size, None).total / GiB:.2f} GiB)")
    if not options.auto_batch and int(options.batch_size) > 1:
        for rows in range(int(options.batch_size) - 1, 0, -1):
            if need_for(options, shard_size, rows).total <= room:
                fixes.append(f"batch_size={rows} ({need_for(options, shard_size, rows).total / GiB:.2f} GiB)")
                break
    return fixes


def _tp_runs_on(config, tp_size: int) -> bool:
    """Whether the model's heads divide over ``tp_size`` processes (a ``tp_size=`` worth suggesting)."""
    from distperp_harness.model.tensor_parallel import check_tp_plan

    try:
        check_tp_plan(config, tp_size, "")
    except ValueError:
        return False
    return True


def _skeletons(options: Options, device: torch.device) -> tuple[nn.Module, nn.Module | None]:
    """Meta skeletons of the model (in the dtype ``quantize=`` loads it in) and of the reference (or None)."""
    from distperp_harness.model.loading import skeleton, torch_dtype
    from distperp_harness.model.quantize import resolve_model_dtype

    asked = torch_dtype(options.dtype)
    dtype = resolve_model_dtype(options.quantize, options.dtype, device)[0] if options.quantize != "none" else None
    model = skeleton(options, asked if dtype is None else dtype)
    if options.reference is None:
        return model, None
    if options.reference in ("base", "pretrained"):  # the same shapes: with or without an adapter, unquantized
        return model, model if dtype is None else skeleton(options, asked)
    return model, skeleton(options, asked, source=options.reference, key="reference")


def check_fits(
    collective: "Collective",
    options: Options,
    device: torch.device,
    shard_size: int,
    local_world: int,
    tp_size: int = 1,
) -> Need | None:
    """Rank 0's estimate against every rank's free memory; ``ValueError`` on every rank when it cannot fit.

    Every rank calls this together, before loading. On the CPU the ``local_world`` processes of a node share its
    memory, so the need is multiplied by them. Returns rank 0's :class:`Need` (None when the model's skeleton
    could not be built: then loading goes ahead without a verdict, logged).
    """
    free = collective.all_gather_object(free_memory_bytes(device), "gather free memory")
    problem = need = None
    if collective.is_main:
        try:
            problem, need = _verdict(options, device, shard_size, local_world, free, tp_size)
        except ValueError as exc:  # a bad path or config: the same error every rank would meet while loading
            problem = str(exc)
        except Exception as exc:  # a model the meta skeleton cannot build: load without a verdict
            log.warning(f"distperp: no memory estimate before loading ({type(exc).__name__}: {exc}); loading anyway")
    problem, need = collective.all_gather_object((problem, need), "agree on the memory estimate")[0]
    if problem:
        raise InputError(problem, same_on_every_rank=True)
    return need


def _verdict(
    options: Options, device: torch.device, shard_size: int, local_world: int, free: list[int], tp_size: int = 1
) -> tuple[str | None, Need]:
    """``(why the run cannot fit, or None; rank 0's need)`` (see :func:`check_fits`)."""
    from distperp_harness.model.checkpoint import refuse_on_stored, stored_quantization, stored_weight_bytes
    from distperp_harness.model.loading import load_config, load_tokenizer, model_max_length

    saved_config = stored_quantization(load_config(options))
    refuse_on_stored(options, saved_config)  # the error loading would give, before the estimate
    stored = saved_config is not None
    stored_bytes = stored_weight_bytes(options) if stored else None
    cache: dict = {options.quantize: _skeletons(options, device)}
    max_length = model_max_length(options, cache[options.quantize][0], load_tokenizer(options))
    key, size = ("tp_size", tp_size) if tp_size > 1 else ("shard_size", shard_size)

    def need_for(opts: Options, size: int, rows: int | None) -> Need:
        if opts.quantize not in cache:
            cache[opts.quantize] = _skeletons(opts, device)
        model, reference = cache[opts.quantize]
        return estimate(
            opts,
            model,
            reference,
            size,
            max_length,
            device,
            rows,
            stored_bytes=stored_bytes,
            tensor_parallel=key == "tp_size",
        )

    need = need_for(options, size, None)
    sharing = local_world if device.type == "cpu" else 1
    room = min(free) // sharing
    if need.total <= room:
        return None, need
    worst = min(range(len(free)), key=free.__getitem__)
    fixes = _fixes(
        options,
        need_for,
        room,
        size,
        local_world,
        stored,
        key,
        lambda n: key != "tp_size" or _tp_runs_on(cache[options.quantize][0].config, n),
    )
    source = "the stored weight files and the model config" if stored_bytes else "the model config"
    return (
        f"the run does not fit: each rank needs about {need.describe()} (estimated from {source}, "
        f"{key}={size}, quantize={options.quantize}, batch_size={options.batch_size}, "
        f"max_length={max_length}), but rank {worst} has {free[worst] / GiB:.2f} GiB free on {device.type}"
        f"{f' shared by {sharing} processes' if sharing > 1 else ''}. Fix: "
        + (
            ", or ".join(fixes)
            if fixes
            else "more devices per shard group, a smaller model, or max_length=<fewer tokens>"
        )
        + "."
    ), need
