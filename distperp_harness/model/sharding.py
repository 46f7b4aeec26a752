"""Sharded weights (``shard_size=N|node``): N processes hold one copy of a model through torch's FSDP2.

The world is a 2D :class:`~torch.distributed.device_mesh.DeviceMesh` ``(replicate, shard)`` of shape
``(world_size // N, N)`` on the default process group's backend (gloo on CPU, nccl on GPU): ranks ``g*N .. g*N+N-1``
form shard group ``g`` and, as global ranks are numbered node by node and ``N`` divides the processes per node,
every group lies within one node. Each decoder layer and then the whole model get ``fully_shard`` (HSDP on the 2D
mesh) with no :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` and nothing else: parameters are stored as
row shards and all-gathered in their own dtype before use, never reduced, so a sharded forward multiplies exactly
the same numbers as an unsharded one and gives the same bits.

torchao's quantized weights (tensor subclasses without FSDP's all-gather extension points) cannot be sharded: they
are passed as ``ignored_params`` and stay replicated on every rank; the rest of that model (embeddings, output
head, norms) is sharded. :class:`ShardReport` says which.

Scoring does not call the root module: it runs ``model.base_model`` and applies the output head per chunk of positions.
:func:`gathered` therefore all-gathers the root's own group (embeddings, final norm, head) for a whole batch, and each
decoder layer gathers and frees its shard in its own forward hooks. Every forward issues the same sequence of gathers,
so all ranks of a group must make the same number of forward calls: the group walks through its batches in steps
(:class:`distperp_harness.run.execution.claims.GroupSteps`), and a rank with fewer calls in a step pads with forwards of
a one-token batch whose results are dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from distperp_harness.errors import InputError
from distperp_harness.model.layers import decoder_layers
from distperp_harness.model.quantize import is_tensor_subclass
from distperp_harness.options import GROUPS, resolve_group_size


def resolve_shard_size(option: int | str, world_size: int, local_world_size: int) -> int:
    """The shard group size for ``shard_size=option``: an int, or ``"node"`` (= ``local_world_size``).

    Raises:
        ValueError: when the size does not divide the processes per node (groups must not span nodes; every rank
        must belong to exactly one group) — with the value, what is allowed and the fix.
    """
    return resolve_group_size("shard_size", option, world_size, local_world_size, GROUPS["shard_size"])


def check_groups_within_hosts(hosts: Sequence[str], shard_size: int, key: str = "shard_size") -> None:
    """``ValueError`` when a group of ``shard_size`` consecutive ranks (``key``: the option that asked for it, a
    shard group or a tensor-parallel group) would span machines (``hosts[r]``: rank ``r``'s host name), e.g. when
    a launcher did not set ``LOCAL_WORLD_SIZE`` and ``node`` was taken to mean the whole world."""
    for group in shard_groups(len(hosts), shard_size):
        names = sorted({hosts[r] for r in group})
        if len(names) > 1:
            raise InputError(
                f"{key}={shard_size}: the group of ranks {group[0]}..{group[-1]} spans the hosts "
                f"{', '.join(names)}; a group must lie within one node (it communicates at every forward). Fix: "
                f"launch with accelerate launch or torchrun (they set LOCAL_WORLD_SIZE), or give {key}=<a "
                f"divisor of the processes per node>."
            )


def shard_groups(world_size: int, shard_size: int) -> list[list[int]]:
    """Ranks of each shard group, in order: ``[[0..N-1], [N..2N-1], ...]`` (the rows of the mesh)."""
    return [list(range(g, g + shard_size)) for g in range(0, world_size, shard_size)]


def make_mesh(device: torch.device, world_size: int, shard_size: int, timeout_s: float):
    """The ``(replicate, shard)`` device mesh on the default group's backend, its groups bounded by ``timeout_s`` (a
    gather that waits longer for a dead or hung rank fails, see
    :func:`distperp_harness.distributed.collective.naming_failures`). Every rank must call this together (it creates
    process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    override = mesh_backend(timeout_s)
    return init_device_mesh(
        device.type,
        (world_size // shard_size, shard_size),
        mesh_dim_names=("replicate", "shard"),
        backend_override={"replicate": override, "shard": override},
    )


def mesh_backend(timeout_s: float) -> tuple[str, Any]:
    """``(backend, options)`` for a device mesh's groups: NCCL where the default group has it (also in a combined
    ``"cuda:nccl,cpu:gloo"`` one, as Accelerate makes for some FSDP settings), else gloo; each group's collectives
    bounded by ``timeout_s`` (DeviceMesh passes the options' timeout on to ``new_group``)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()):
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 - private, not in the stubs
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


@dataclass(frozen=True)
class ShardReport:
    """How a model was laid out: ``shard_size``; ``replicated``: names of parameters every rank holds whole
    (torchao-quantized weights FSDP cannot shard); ``note``: one sentence for the log and results."""

    shard_size: int
    replicated: tuple[str, ...]
    note: str


def shard_model(model: nn.Module, mesh, *, what: str = "model") -> ShardReport:
    """Apply FSDP2 to ``model`` in place on ``mesh``: each decoder layer, then the root (embeddings, norm, head).

    Parameters are moved to the mesh's device one FSDP unit at a time (a layer's unsharded weights at most, then
    its shard), so a model loaded on the CPU never sits whole on the device. Ends with one forward of a one-token
    input through the root, which every rank of the world runs together: it makes the root the FSDP root
    (lazy initialisation) before scoring calls its submodules directly.
    """
    from torch.distributed.fsdp import fully_shard

    ignored = {p for p in model.parameters() if is_tensor_subclass(p)}
    replicated = tuple(n for n, p in model.named_parameters() if p in ignored)
    shard_size = int(mesh.size(-1))
    for layer in decoder_layers(model):
        mine = {p for p in layer.parameters() if p in ignored}
        if any(p not in mine for p in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True, ignored_params=mine or None)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=ignored or None)
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    if replicated:
        note = (
            f"{what}: {len(replicated)} torchao-quantized weight tensor(s) stay replicated on every rank "
            f"(FSDP2 cannot shard torchao's quantized tensors); its other weights are sharded over "
            f"{shard_size} processes"
        )
    else:
        note = f"{what}: all weights sharded over {shard_size} processes (FSDP2, gathered in their own dtype)"
    return ShardReport(shard_size, replicated, note)


def is_sharded(model: nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(*models: nn.Module | None) -> Iterator[None]:
    """Within the block, the root FSDP group of each sharded model (embeddings, final norm, output head) is
    all-gathered; decoder layers gather themselves in their forward. A no-op for unsharded models (and None)."""
    roots: list[Any] = [m for m in models if is_sharded(m)]  # FSDP2 modules: unshard/reshard
    for m in roots:
        m.unshard()
    try:
        yield
    finally:
        for m in roots:
            m.reshard()


def regather(*models: nn.Module | None) -> None:
    """Reshard, then gather again, the root group of each sharded model: inside :func:`gathered`, what ends one
    forward call and begins the next exactly as two ``gathered`` blocks would (same collectives, same order)."""
    roots: list[Any] = [m for m in models if is_sharded(m)]  # FSDP2 modules: unshard/reshard
    for m in roots:
        m.reshard()
    for m in roots:
        m.unshard()


def sharding_report(
    shard_size: int, reports: dict, per_rank: Sequence[dict], world_size: int, tp_size: int = 1
) -> dict:
    """``config.distperp.sharding``: the layout and the weight bytes each rank holds.

    ``tp_size`` > 1: ``engine`` says so, ``mesh`` is ``[dp, tp]`` and ``groups`` are the tensor-parallel groups;
    ``replicated`` then lists the parameters every member holds whole (norms and what the TP plan leaves out).

    ``model_bytes_per_rank`` / ``reference_bytes_per_rank``: stored weight bytes resident on each rank, in rank
    order (local shards plus replicated weights; parameters gathered only during a forward are not counted;
    ``None`` without a reference). ``replicated``: weights every rank holds whole, per model.
    """
    size = tp_size if tp_size > 1 else shard_size
    engine = (
        "transformers tensor-parallel plan (DTensor) on a (dp, tp) DeviceMesh"
        if tp_size > 1
        else "torch FSDP2 fully_shard, no mixed precision"
    )
    return {
        "shard_size": 1 if tp_size > 1 else shard_size,
        "tp_size": tp_size,
        "engine": engine if size > 1 else None,
        "mesh": [world_size // size, size] if size > 1 else None,
        "groups": shard_groups(world_size, size) if size > 1 else None,
        "model_bytes_per_rank": [r["model_bytes"] for r in per_rank],
        "reference_bytes_per_rank": [r["reference_bytes"] for r in per_rank],
        "replicated": {what: list(r.replicated) for what, r in reports.items()},
        "notes": [r.note for r in reports.values()],
    }
