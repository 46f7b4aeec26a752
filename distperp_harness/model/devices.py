"""Which device a process computes on, what that device is, and whether every rank runs the same thing.

* :func:`resolve_device` picks ``cuda:<local rank mod visible GPUs>`` (so one GPU per process, as SLURM's
  per-task GPUs give, works as well as all GPUs visible to every process) or the CPU, and always makes a CUDA
  device the current one (``torch.cuda.set_device``).
* :func:`device_identity` is what decides which kernels run, hence the bits: GPU name, compute capability, SM
  count, CUDA/cuDNN versions (or the CPU's instruction set), and torch's precision flags
  (:func:`numerics_flags`). It is part of the rank agreement check and of the ``resume_dir`` key.
* :func:`find_disagreement` and :func:`find_shared_gpus` are pure checks over what every rank reported; the lm
  face raises their messages at start, before any model is loaded.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any, Mapping, Sequence

import torch
from accelerate.logging import get_logger

from distperp_harness.errors import InputError
from distperp_harness.options import CLI_DEFAULT_DEVICE, Options

log = get_logger(__name__)


def resolve_device(options: Options, local_rank: int, world_size: int = 1) -> torch.device:
    """The device this process computes on; a CUDA device is also made current.

    Unset or ``auto``: ``cuda:<local_rank % device_count>`` when CUDA is available, else the CPU. ``cuda`` or
    ``cuda:N`` with several processes: the local rank's GPU (``local_rank % device_count``); with one process,
    ``cuda:N`` itself. On a machine without CUDA, lm-eval's CLI default ``cuda:0`` falls back to the CPU (logged);
    any CUDA device the user asked for explicitly is an error.
    """
    requested = (options.device or "").strip().lower()
    has_cuda = torch.cuda.is_available()
    if requested in ("", "auto"):
        return _use_cuda(local_rank % torch.cuda.device_count()) if has_cuda else torch.device("cpu")
    if requested.startswith("cuda"):
        if not has_cuda:
            if options.device_from_cli and requested == CLI_DEFAULT_DEVICE:
                log.info(
                    "device=cuda:0 (lm-eval's default) but this machine has no CUDA: using the CPU",
                    main_process_only=True,
                )
                return torch.device("cpu")
            raise InputError(
                f"device={options.device!r} was asked for, but this machine has no CUDA device "
                "(torch.cuda.is_available() is False). Fix: device=cpu, or run on a GPU machine."
            )
        count = torch.cuda.device_count()
        if world_size > 1 or requested == "cuda":
            return _use_cuda(local_rank % count)
        try:
            index = int(requested.split(":")[1]) if ":" in requested else 0
        except ValueError:
            raise InputError(f"device={options.device!r} is not a device; allowed: cpu, cuda, cuda:N, auto") from None
        if not 0 <= index < count:
            raise InputError(
                f"device={options.device!r}: this process sees {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}). Fix: device=cuda:0, or check CUDA_VISIBLE_DEVICES."
            )
        return _use_cuda(index)
    if requested == "cpu":
        return torch.device("cpu")
    try:
        return torch.device(requested)  # other accelerators torch knows (mps, xpu, ...)
    except RuntimeError:
        raise InputError(f"device={options.device!r} is not a device; allowed: cpu, cuda, cuda:N, auto") from None


def _use_cuda(index: int) -> torch.device:
    device = torch.device(f"cuda:{index}")
    torch.cuda.set_device(device)  # streams, NCCL and caching-allocator defaults follow the current device
    return device


def numerics_flags() -> dict[str, Any]:
    """torch settings that change which kernels or which accumulation a matmul uses."""
    matmul = torch.backends.cuda.matmul
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "cuda_fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
        "cuda_bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }


def device_identity(device: torch.device) -> dict[str, Any]:
    """What kind of device computes, as far as the kernels (and so the bits) depend on it, plus :func:`numerics_flags`.

    CUDA: GPU name, compute capability, SM count, CUDA and cuDNN versions. CPU: the architecture and the vector
    instruction set torch dispatches to. Memory size is *not* part of it (it does not choose kernels).
    """
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": int(props.multi_processor_count),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
    else:
        kind = {"type": device.type, "machine": platform.machine(), "capability": _cpu_capability()}
    return {**kind, "numerics": numerics_flags()}


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older builds
        return "unknown"


def physical_device(device: torch.device) -> dict[str, Any]:
    """Where this process computes: host name and, on CUDA, the GPU's UUID (for :func:`find_shared_gpus`)."""
    where: dict[str, Any] = {"host": socket.gethostname(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where["gpu"] = str(
            getattr(props, "uuid", "")
            or f"{getattr(props, 'pci_domain_id', 0)}:"
            f"{getattr(props, 'pci_bus_id', 0)}:{getattr(props, 'pci_device_id', 0)}"
        )
    return where


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def find_disagreement(everyone: Sequence[Mapping[str, Any]]) -> str | None:
    """``None`` when every rank reported the same, else a message naming the first differing rank and fields.

    ``everyone[r]`` is rank ``r``'s report (nested dicts: configuration, versions, :func:`device_identity`).
    """
    base = _flatten(everyone[0])
    for rank, theirs in enumerate(everyone[1:], start=1):
        flat = _flatten(theirs)
        fields = sorted(k for k in base.keys() | flat.keys() if base.get(k, "<missing>") != flat.get(k, "<missing>"))
        if fields:
            shown = "; ".join(
                f"{k}: {base.get(k, '<missing>')!r} on rank 0 vs {flat.get(k, '<missing>')!r}" for k in fields[:6]
            )
            more = f" (and {len(fields) - 6} more)" if len(fields) > 6 else ""
            return (
                f"rank {rank} does not run what rank 0 runs: {shown}{more}. Results computed by different "
                "kernels, settings or versions would be mixed into one result. Fix: the same GPU model, torch "
                "precision settings, library versions and --model_args on every process and node."
            )
    return None


def find_shared_gpus(everyone: Sequence[Mapping[str, Any]]) -> str | None:
    """``None`` when no two ranks compute on the same GPU, else a message naming them (from :func:`physical_device`)."""
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, where in enumerate(everyone):
        if where.get("gpu"):
            owners.setdefault((where["host"], where["gpu"]), []).append(rank)
    for (host, gpu), ranks in owners.items():
        if len(ranks) > 1:
            device = everyone[ranks[0]]["device"]
            return (
                f"ranks {ranks} on host {host} all compute on the same GPU ({device}, {gpu}): more processes "
                "per node than GPUs they can see. Fix: start at most one process per GPU (accelerate launch "
                "--num_processes = number of GPUs, or srun --gpus-per-task=1), or check CUDA_VISIBLE_DEVICES."
            )
    return None


def local_world_size(world_size: int) -> int:
    """Processes on this node, as the launcher says (``LOCAL_WORLD_SIZE``), else ``world_size``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
