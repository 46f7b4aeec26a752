"""CPU weight prepacking for ``compile=``: the decoder layers' linear layers compute from oneDNN-packed weights.

On CPU, much of what makes inductor's compiled inference faster than eager is not fusion but its *freezing* pass
(measured: ``benchmarks/README.md``, "Compiling"): weights become constants and every ``linear`` turns into oneDNN's
``_linear_pointwise`` on a weight reordered once (``mkldnn._reorder_linear_weight``) into the blocked layout its GEMM
kernels read, instead of a plain ``mm`` on the row-major weight. Freezing compiles one graph per layer, though (the
weights are baked in), which multiplies compile time by the depth of the model, and its graphs are keyed by the weights'
values. This module gives the regional graph of :mod:`~distperp_harness.run.compiling.regional` the same kernels while
one graph still serves every layer: each plain ``nn.Linear`` of a decoder layer calls the custom op
``distperp::packed_linear(x, weight, bias)``, which inductor keeps as an opaque call (it fuses everything around it) and
which computes from the packed copy of ``weight`` (found by the weight's storage address, so the graph takes the
ordinary weight as its input).

The packed layout is chosen for a GEMM of ``hint`` rows (:func:`prepack`; from the warm-up shape, i.e. from
``max_length`` and the batching rule, never from the requests), so every process packs the same way and a batch's
bits depend on its shape alone. The packed copies are held besides the weights (``packed_bytes``: counted in the
memory budget, :func:`packable_bytes`). Weights that are not plain dense float32/bfloat16 tensors (torchao's
quantized tensor subclasses) keep their own kernels. CPU only: on CUDA nothing is packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeGuard

import torch

_PACKED: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
"""Packed weight per (storage address, shape) of the original weight; filled by :func:`prepack`."""

_DTYPES = (torch.float32, torch.bfloat16)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs on this CPU: bfloat16 needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT; without them a
    bfloat16 linear keeps its plain weight (and the eager kernel)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return _DTYPES if bf16 is not None and bf16() else (torch.float32,)


@torch.library.custom_op("distperp::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by oneDNN from the packed copy of ``weight``."""
    packed = _PACKED.get((weight.data_ptr(), tuple(weight.shape)))
    if packed is None:
        raise RuntimeError(
            f"internal error: no packed copy of a {tuple(weight.shape)} weight (was it moved after compile= packed it?)"
        )
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.weight, self.bias)


@dataclass
class Prepacked:
    """What :func:`prepack` did: ``linears`` packed, their ``packed_bytes``; :meth:`restore` undoes it."""

    linears: int = 0
    packed_bytes: int = 0
    hint: int = 0
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        self.linears, self.packed_bytes = 0, 0


def unsupported(device: torch.device) -> str | None:
    """Why nothing is packed on ``device`` (None: pack)."""
    if device.type != "cpu":
        return f"{device.type}: weight prepacking is a CPU (oneDNN) path"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "this torch build has no usable oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no mkldnn._reorder_linear_weight"
    return None


def _packable(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__:  # a hook's wrapper: left alone
        return False
    params = [module.weight] + ([module.bias] if module.bias is not None else [])
    return (
        all(
            type(p) in (torch.Tensor, torch.nn.Parameter)
            and p.layout == torch.strided
            and p.device.type == "cpu"
            and p.dtype == module.weight.dtype
            for p in params
        )
        and module.weight.dtype in packable_dtypes()
    )


def _linears(layers: Sequence[torch.nn.Module]) -> list[torch.nn.Linear]:
    return [m for layer in layers for m in layer.modules() if _packable(m)]


def packable_bytes(layers: Sequence[torch.nn.Module], device: torch.device) -> int:
    """Bytes :func:`prepack` would add for ``layers`` on ``device`` (0 where it packs nothing)."""
    if unsupported(device) is not None:
        return 0
    return sum(m.weight.numel() * m.weight.element_size() for m in _linears(layers))


def prepack(
    layers: Sequence[torch.nn.Module], device: torch.device, hint: int, state: Prepacked | None = None
) -> Prepacked:
    """Route every packable ``nn.Linear`` of ``layers`` through :func:`packed_linear` with weights packed for
    GEMMs of ``hint`` rows. Returns ``state`` (new if None) with what was packed."""
    state = state if state is not None else Prepacked()
    if unsupported(device) is not None:
        return state
    state.hint = hint
    for linear in _linears(layers):
        weight = linear.weight.detach()
        key = (weight.data_ptr(), tuple(weight.shape))
        _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        linear.forward = _packed_forward.__get__(linear)  # type: ignore[method-assign]  # patched on the instance
        state.linears += 1
        state.packed_bytes += weight.numel() * weight.element_size()

        def undo(linear=linear, key=key) -> None:
            linear.__dict__.pop("forward", None)
            _PACKED.pop(key, None)

        state._restore.append(undo)
    return state
