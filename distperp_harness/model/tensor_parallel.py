"""Tensor parallelism (``tp_size=N``): N consecutive processes of one node hold one copy of a model, each a slice
of every large matrix, through transformers' own tensor-parallel plan (``base_model_tp_plan`` of the model's
config, the ``lm_head`` rule of its class).

The world is a :class:`~torch.distributed.device_mesh.DeviceMesh` ``(dp, tp)`` of shape ``(world // N, N)`` on the
default process group Accelerate made (gloo on CPU, nccl on GPU), its groups bounded by the run's ``timeout``: ranks
``g*N .. g*N+N-1`` form TP group ``g``. transformers builds its own mesh over every rank with default timeouts and,
for ``N`` < world, wraps the model in FSDP replicas; :func:`tp_loading` hands it this mesh instead (the dimensions
it names: ``pp``, ``dp_replicate``, ``fsdp``, ``tp``, the data-parallel one never used by the model), so the
model is tensor-parallel within its group and nothing else. Weights are read slice by slice while loading: no rank
holds a whole copy.

A TP group computes one forward together (column-parallel projections, then an all-reduce of the row-parallel
ones; the output head gathers its vocabulary slices), so every member gets the same logits, bit for bit, and the
group acts as *one* data-parallel worker: the plan gives batches and lanes to workers, the group's first rank
(its leader) claims and decides, the others follow (:mod:`distperp_harness.run.execution.groups`).

torchao quantization while loading (``TorchAoConfig``) quantizes each rank's slice of a weight on its own: the
weights stay torchao tensors of the local slice. A per-row scale of a row-parallel weight then covers half a row,
so quantized results are comparable between runs of the same ``tp_size`` only.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence

import torch

from distperp_harness.errors import InputError
from distperp_harness.model.sharding import ShardReport, mesh_backend
from distperp_harness.options import GROUPS, resolve_group_size


def resolve_tp_size(option: int | str, world_size: int, local_world_size: int) -> int:
    """The TP group size for ``tp_size=option`` (``"node"``/``"auto"``: the processes per node).

    Raises:
        ValueError: when the size does not divide the processes per node (a group's all-reduces run at every
        layer, so it must lie within one node) — with the value, what is allowed and the fix.
    """

    return resolve_group_size("tp_size", option, world_size, local_world_size, GROUPS["tp_size"])


def check_tp_plan(config: Any, tp_size: int, source: str) -> None:
    """``ValueError`` before any weight is read when ``config`` (a transformers config) cannot run on ``tp_size``
    processes: no tensor-parallel plan, or attention heads (query or key/value) that do not divide by it."""
    if tp_size <= 1:
        return
    plan = getattr(config, "base_model_tp_plan", None)
    kind = getattr(config, "model_type", type(config).__name__)
    if not plan:
        raise InputError(
            f"tp_size={tp_size}: {source!r} ({kind}) has no tensor-parallel plan in transformers (its config's "
            f"base_model_tp_plan is empty), so its layers cannot be split over {tp_size} processes. Fix: "
            f"shard_size={tp_size} (FSDP2 works for any model), or tp_size=1."
        )
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is not None and heads is not None and count % tp_size:
            allowed = [d for d in range(2, int(count) + 1) if heads % d == 0 and (kv_heads or heads) % d == 0]
            raise InputError(
                f"tp_size={tp_size}: {source!r} has {name}={count}, which does not divide by tp_size={tp_size} "
                f"(each process takes whole heads). Allowed tp_size for this model: "
                f"{', '.join(map(str, allowed)) or 'none above 1'}. Fix: one of those, or shard_size={tp_size}."
            )


def plan_rules(model: torch.nn.Module, style: str = "") -> list[re.Pattern[str]]:
    """Patterns of the module names transformers' TP plan covers with a style starting with ``style``: the model's
    full plan (``tp_plan``: its class's, its config's base plan, the input embeddings), else the config's."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model.config, "base_model_tp_plan", None) or {})
    return [
        re.compile(r"(^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for pattern, kind in plan.items()
        if str(kind).startswith(style)
    ]


def planned_matrices(model: torch.nn.Module) -> set[int]:
    """``id`` of each matrix (2+ dimensions) of a module the TP plan splits: what a member holds a slice of. The
    rest (norms, biases, modules the plan leaves out) stays whole on every member."""
    rules = plan_rules(model)
    return {
        id(p)
        for name, module in model.named_modules()
        if any(rule.search(name) for rule in rules)
        for p in module.parameters(recurse=False)
        if p.dim() >= 2
    }


def rowwise_slices_too_narrow(
    model: torch.nn.Module, tp_size: int, group_size: int, names: Sequence[str]
) -> dict[str, str]:
    """Of the Linear layers ``names`` (to be quantized in groups of ``group_size`` inputs), those whose input slice
    under the model's TP plan (a ``rowwise`` rule: inputs split over ``tp_size`` processes) does not divide into
    whole groups: ``{name: reason}``. transformers quantizes each slice on its own, so such a layer stays in full
    precision (a group would straddle two processes)."""
    rules = plan_rules(model, "rowwise")
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        inputs = int(getattr(modules[name], "in_features", 0))
        if any(rule.search(name) for rule in rules) and (inputs % tp_size or (inputs // tp_size) % group_size):
            out[name] = (
                f"its {inputs} inputs are split over tp_size={tp_size} processes, and a slice of "
                f"{inputs / tp_size:g} does not divide into groups of {group_size} (group_size=)"
            )
    return out


def make_tp_mesh(device: torch.device, world_size: int, tp_size: int, timeout_s: float):
    """transformers' dense mesh ``(pp, dp_replicate, fsdp, tp)`` of shape ``(1, world // tp_size, 1, tp_size)`` on
    the default group's backend, every group bounded by ``timeout_s``. Every rank must call this together."""
    from torch.distributed.device_mesh import init_device_mesh

    override = mesh_backend(timeout_s)
    names = ("pp", "dp_replicate", "fsdp", "tp")
    return init_device_mesh(
        device.type,
        (1, world_size // tp_size, 1, tp_size),
        mesh_dim_names=names,
        backend_override={n: override for n in names},
    )


@contextlib.contextmanager
def tp_loading(mesh: Any, device: torch.device) -> Iterator[Any]:
    """Within the block, ``from_pretrained(..., distributed_config=<yielded>)`` applies the model's TP plan on
    ``mesh`` (:func:`make_tp_mesh`) and reads each weight's slice onto ``device``; nothing else of transformers'
    parallel machinery (FSDP, pipeline, experts) is used."""
    from transformers.distributed import DistributedConfig, mixin
    from transformers.distributed.utils import TransformersDeviceMesh

    config = DistributedConfig(tp_size=int(mesh.size(-1)))
    built = TransformersDeviceMesh(mesh, mesh)  # no expert parallelism: the expert view is never asked for
    original = mixin.initialize_distributed_mesh

    def ours(distributed_config):
        if distributed_config is not config:
            return original(distributed_config)
        return device, built

    mixin.initialize_distributed_mesh = ours
    try:
        yield config
    finally:
        mixin.initialize_distributed_mesh = original


def is_tensor_parallel(model: torch.nn.Module | None) -> bool:
    """True for a model loaded with a TP plan over more than one process."""
    return model is not None and int(getattr(model, "_tp_size", None) or 1) > 1


def _layout(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, bool]]:
    """``(name, parameter, sliced)`` of each parameter: a DTensor not replicated everywhere, or a torchao weight of
    a layer transformers quantized slice by slice (``_hf_quantized_needs_local_tp``), is split over the group."""
    from torch.distributed.tensor import DTensor

    for module_name, module in model.named_modules():
        local_slices = bool(getattr(module, "_hf_quantized_needs_local_tp", False))
        for name, p in module.named_parameters(recurse=False):
            split = isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
            yield f"{module_name}.{name}" if module_name else name, p, split or local_slices


def tp_report(model: torch.nn.Module, tp_size: int, what: str = "model") -> ShardReport:
    """Which of ``model``'s parameters the TP plan split and which stay whole on every member (``replicated``)."""
    layout = list(_layout(model))
    whole = tuple(name for name, _, split in layout if not split)
    note = (
        f"{what}: tensor-parallel over {tp_size} processes (transformers' TP plan): {len(layout) - len(whole)} "
        f"weight tensors split, {len(whole)} whole on every process (norms, and what the plan leaves out)"
    )
    return ShardReport(tp_size, whole, note)


def whole_bytes(model: torch.nn.Module, tp_size: int) -> int:
    """Stored bytes of one whole copy of a tensor-parallel ``model``: a DTensor's global size, a local torchao
    slice times ``tp_size``, a replicated tensor once."""
    from torch.distributed.tensor import DTensor

    from distperp_harness.model.quantize import _storage_bytes

    total = 0
    seen: set[tuple[int, int]] = set()
    counted: set[int] = set()
    for _, p, split in _layout(model):
        if id(p) in counted:  # tied weights count once
            continue
        counted.add(id(p))
        if isinstance(p, DTensor):
            total += p.numel() * p.element_size()
        else:
            total += _storage_bytes(p, seen) * (tp_size if split else 1)
    return total
