"""int4 weights at prefill sizes: a product of many rows dequantizes the layer's weights and multiplies densely.

torchao's packed int4 kernels (tinygemm ``aten._weight_int4pack_mm`` on CUDA, ``aten._weight_int4pack_mm_for_cpu``)
are decode kernels: fast for a few rows, several times slower than a dense product for thousands (measured: 0.13x
of bf16 scoring on an H200; 2x slower than dequantize + dense product at 4,096 rows on a CPU). :func:`install` gives
each Linear holding such a weight a forward that, for an input of at least ``rows`` rows, rebuilds the layer's
weights in the model dtype from the packed nibbles and its scales and zeros (a transient tensor, one layer at a
time) and calls the dense ``F.linear``; fewer rows keep torchao's kernel. The choice depends only on the product's
shape, and batches never depend on the world size: the same bits on any number of processes.

The packed layouts are torchao's and torch's business, so none is written down here. :func:`derive_layout` learns
one by packing the digits of each position's index through the packer itself (the same ``aten`` op torchao calls)
and reading where each digit lands; a layout must be a permutation of nibbles within blocks of rows. Every weight is
then checked against the kernel's own dequantized values (its product with rows of the identity, exact: one
non-zero term per output): all columns for the first weight of each shape, which also picks the rounding that
matches (``fp32``: ``(q - 8) * scale + zero`` in float32 then rounded, as the CPU kernel does; ``fp64``: correctly
rounded, as the CUDA kernel's bf16 fused multiply-add), 64 columns for the others. Any mismatch keeps the kernel for
every layer, with one line saying why: the dense path is the kernel's numbers multiplied another way, never other
weights.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from distperp_harness.options import Int4Prefill, Word

__all__ = ["AUTO_ROWS", "Int4Products", "Layout", "Rounding", "dense_weight", "derive_layout", "install"]

AUTO_ROWS = {"cpu": 512, "cuda": 64}
"""``int4_prefill=auto``: the fewest rows of a product that dequantizes, per device type. CPU: the crossover measured
on SmolLM2-135M's shapes (2 cores: the kernel 2.6 ms vs 3.8 ms at 256 rows, 10.6 vs 7.5 at 1,024). CUDA: the
tinygemm kernel's time grows with rows past ~16-32 (a decode kernel) while dequantizing costs one pass over the
layer; not yet measured on a GPU."""

CHUNK_ELEMENTS = 1 << 24
"""Weights dequantized per step: bounds the float intermediates (64 MiB in float32) for any layer size."""

SAMPLED_COLUMNS = 64


class Rounding(Word):
    """How ``(q - 8) * scale + zero`` reaches the model dtype: through float32 (two roundings) or float64 (one)."""

    FP32 = "fp32"
    FP64 = "fp64"


@dataclass(frozen=True)
class Layout:
    """A packed int4 layout: blocks of ``block_rows`` rows, each a permutation of its nibbles. ``gather[i]`` is the
    nibble (in a block's packed bytes, low nibble first) that holds the block's value at ``row * k + column``. A
    weight whose rows are not a whole number of blocks ends in ``tail_rows`` rows packed as a weight of their own
    (``tail_gather``; the CPU packer's blocks of 64 rows do so)."""

    block_rows: int
    gather: torch.Tensor
    tail_rows: int = 0
    tail_gather: torch.Tensor | None = None


class PackedInt4(Protocol):
    """What a torchao packed int4 weight (``Int4OpaqueTensor``, ``Int4TilePackedTo4dTensor``) holds: the packed
    nibbles, scales and zeros as ``[in / group, out, 2]``, the group as ``block_size[-1]``, its ``[out, in]`` shape."""

    qdata: torch.Tensor
    scale_and_zero: torch.Tensor
    block_size: list[int]
    shape: torch.Size


def packed(linear: nn.Linear) -> PackedInt4:
    """``linear``'s weight as the packed int4 tensor it holds (the caller checked its type)."""
    return cast(PackedInt4, linear.weight)


@dataclass(frozen=True)
class _Format:
    """One torchao int4 tensor type: its packer (``int32 [n, k]`` values 0..15 -> packed tensor)."""

    name: str
    pack: Callable[[torch.Tensor, PackedInt4], torch.Tensor]


def _pack_cpu(values: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)


def _pack_tiles(values: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
    pairs = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(pairs, int(weight.qdata.shape[-1]) * 2)


_FORMATS = {"Int4OpaqueTensor": _Format("Int4OpaqueTensor", _pack_cpu)}
_FORMATS["Int4TilePackedTo4dTensor"] = _Format("Int4TilePackedTo4dTensor", _pack_tiles)


def _format(weight: PackedInt4) -> tuple[_Format | None, str]:
    """The weight's format, or None and why it keeps the kernel."""
    fmt = _FORMATS.get(type(weight).__name__)
    if fmt is None:
        return None, f"{type(weight).__name__} weights"
    if getattr(weight, "act_pre_scale", None) is not None or len(weight.block_size) != 2:
        return None, "weights with activation pre-scales or more than two dimensions"
    return fmt, ""


def _pack_with(fmt: _Format, weight: PackedInt4, values: torch.Tensor) -> torch.Tensor:
    return fmt.pack(values, weight)


def nibbles(data: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of ``data``'s bytes, low nibble first, as a flat ``uint8`` tensor."""
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack((raw & 15, raw >> 4), dim=-1).reshape(-1)


def _positions(pack: Callable[[torch.Tensor], torch.Tensor], rows: int, k: int, device: torch.device):
    """For each nibble of the packing of a ``rows x k`` weight, the position (``row * k + column``) it holds."""
    n = rows * k
    index = torch.arange(n, device=device).reshape(rows, k)
    where = torch.zeros(n, dtype=torch.int64, device=device)
    shift = 0
    while shift == 0 or (1 << shift) < n:
        try:
            packed = pack(((index >> shift) & 15).to(torch.int32))
        except RuntimeError:  # a shape the packer refuses: no layout at this block size
            return None
        digits = nibbles(packed)
        if digits.numel() != n:
            return None
        where |= digits.long() << shift
        shift += 4
    return where


def derive_layout(
    pack: Callable[[torch.Tensor], torch.Tensor], k: int, device: torch.device, rows: int, max_rows: int = 1024
) -> Layout | None:
    """The layout ``pack`` gives a weight of ``rows`` x ``k``: the smallest block of rows (8, 16, ... ``max_rows``)
    whose packing of two blocks is the packing of one block twice over, each a permutation, and the packing of the
    leftover rows alone; None when there is none."""
    block = 8
    while block <= max_rows:
        where = _positions(pack, 2 * block, k, device)
        if where is not None:
            gather = _gather(where[: block * k])
            if gather is not None and torch.equal(where[block * k :], where[: block * k] + block * k):
                tail = rows % block
                if not tail:
                    return Layout(block, gather)
                last = _positions(pack, tail, k, device)
                tail_gather = None if last is None else _gather(last)
                return None if tail_gather is None else Layout(block, gather, tail, tail_gather)
        block *= 2
    return None


def _gather(where: torch.Tensor) -> torch.Tensor | None:
    """The inverse of ``where`` (nibble -> position) when it is a permutation, else None."""
    size = where.numel()
    if not torch.equal(torch.sort(where).values, torch.arange(size, device=where.device)):
        return None
    gather = torch.empty_like(where)
    gather[where] = torch.arange(size, device=where.device)
    return gather


def dense_weight(weight: PackedInt4, layout: Layout, rounding: Rounding, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (a torchao int4 tensor in ``layout``) as a dense ``[out, in]`` tensor in ``dtype``, built from its
    packed nibbles, scales and zeros ``CHUNK_ELEMENTS`` at a time."""
    group = int(weight.block_size[-1])
    scale_zero = weight.scale_and_zero  # [k_pad / group, n_pad, 2]
    k_pad, n_pad = scale_zero.shape[0] * group, scale_zero.shape[1]
    n, k = weight.shape
    raw = weight.qdata.contiguous().view(torch.uint8).reshape(-1)
    wide = torch.float32 if rounding is Rounding.FP32 else torch.float64
    scale = scale_zero[..., 0].t().to(wide).unsqueeze(-1)  # [n_pad, k_pad / group, 1]
    zero = scale_zero[..., 1].t().to(wide).unsqueeze(-1)
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    per_block = layout.block_rows * k_pad
    blocks = n_pad // layout.block_rows
    pieces = [(raw[: blocks * per_block // 2].view(blocks, per_block // 2), layout.block_rows, layout.gather)]
    if layout.tail_rows and layout.tail_gather is not None:
        pieces.append((raw[blocks * per_block // 2 :].view(1, -1), layout.tail_rows, layout.tail_gather))
    top = 0
    for part, block_rows, gather in pieces:
        step = max(1, CHUNK_ELEMENTS // (block_rows * k_pad))
        for first in range(0, part.shape[0], step):
            if top >= n:
                return out
            values = nibbles(part[first : first + step]).view(-1, block_rows * k_pad).index_select(1, gather)
            values = values.view(-1, k_pad // group, group)
            rows = values.shape[0]
            full = values.to(wide).sub_(8).mul_(scale[top : top + rows]).add_(zero[top : top + rows])
            bottom = min(n, top + rows)
            out[top:bottom] = full.view(rows, k_pad)[: bottom - top, :k]
            top += rows
    return out


def kernel_columns(weight: PackedInt4, columns: torch.Tensor) -> torch.Tensor:
    """The kernel's own dequantized values of ``weight`` at ``columns`` (``[out, len(columns)]``): its product with
    those rows of the identity, which sums one non-zero term per output."""
    eye = torch.zeros(columns.numel(), weight.shape[1], dtype=torch.bfloat16, device=weight.qdata.device)
    eye[torch.arange(columns.numel(), device=eye.device), columns] = 1
    return F.linear(eye, cast(torch.Tensor, weight)).t()


def _matches(weight: PackedInt4, dense: torch.Tensor, columns: torch.Tensor) -> bool:
    for chunk in columns.split(1024):
        if not torch.equal(kernel_columns(weight, chunk).to(dense.dtype), dense[:, chunk]):
            return False
    return True


@dataclass(frozen=True)
class Int4Products:
    """What :func:`install` did: ``rows`` (products of at least this many rows dequantize; None: the kernel
    everywhere), ``layers`` given the dense path, ``rounding`` and ``block_rows`` per format, ``reason`` (one line),
    ``transient_bytes`` (the largest layer's dense weights and one chunk of its intermediates: the extra memory of a
    forward), ``seconds``."""

    setting: str
    rows: int | None
    layers: int
    reason: str
    rounding: dict[str, str] = field(default_factory=dict)
    block_rows: dict[str, int] = field(default_factory=dict)
    transient_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def summary(self) -> str:
        return f"int4_prefill={self.setting}: {self.reason}"


def _rows(setting: Int4Prefill | int, device_type: str) -> int | None:
    if setting is Int4Prefill.KERNEL:
        return None
    if setting is Int4Prefill.AUTO:
        return AUTO_ROWS.get(device_type)
    return int(setting)


def install(model: nn.Module, setting: Int4Prefill | int, tensor_parallel: bool = False) -> Int4Products | None:
    """Give every Linear of ``model`` holding a packed torchao int4 weight the dense path for products of at least
    ``rows`` rows (``setting``: :class:`Int4Prefill` or a row count); None when the model holds no such weight.

    A tensor-parallel model (``tensor_parallel``: its plan wraps layers' forwards and moves their inputs and outputs
    across ranks) and any layer whose forward something else already replaced keep torchao's kernel."""
    start = time.perf_counter()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and type(m.weight).__name__ in _FORMATS]
    if not linears:
        return None
    text = setting.value if isinstance(setting, Int4Prefill) else str(setting)
    device_type = packed(linears[0]).qdata.device.type
    rows = _rows(setting, device_type)
    replaced = [m for m in linears if "forward" in vars(m)]
    if rows is not None and (tensor_parallel or replaced):
        why = "tensor-parallel layers" if tensor_parallel else f"{len(replaced)} layers whose forward was replaced"
        return Int4Products(text, None, 0, f"torchao's int4 kernel for every product ({why})")
    if rows is None:
        why = "as asked" if setting is Int4Prefill.KERNEL else f"no dense path on {device_type}"
        return Int4Products(text, None, 0, f"torchao's int4 kernel for every product ({why})")
    plans, failure = _plan(linears)
    if failure:
        return Int4Products(text, None, 0, f"torchao's int4 kernel for every product: {failure}")
    for linear, (layout, rounding) in zip(linears, plans):
        linear.forward = _dense_forward(linear, rows, layout, rounding)  # type: ignore[method-assign]
    formats = {type(m.weight).__name__: plan for m, plan in zip(linears, plans)}
    largest = max(m.weight.shape[0] * m.weight.shape[1] for m in linears) * 2  # the dense bf16 weight
    widest = max(torch.finfo(torch.float32 if r is Rounding.FP32 else torch.float64).bits // 8 for _, r in plans)
    largest += min(CHUNK_ELEMENTS, largest // 2) * (widest + 3)  # one chunk's values: float, nibbles, gathered
    return Int4Products(
        text,
        rows,
        len(linears),
        f"products of >= {rows} rows dequantize the layer's int4 weights and multiply densely, fewer use "
        f"torchao's kernel ({len(linears)} layers, each checked against the kernel's own values)",
        rounding={name: plan[1].value for name, plan in formats.items()},
        block_rows={name: plan[0].block_rows for name, plan in formats.items()},
        transient_bytes=largest,
        seconds=time.perf_counter() - start,
    )


def _plan(linears: list[nn.Linear]) -> tuple[list[tuple[Layout, Rounding]], str]:
    """Each layer's layout and rounding, every weight checked; or ``[]`` and why the kernel stays."""
    layouts: dict[tuple[str, int, int, str], Layout | None] = {}
    roundings: dict[tuple[str, tuple[int, ...], int], Rounding] = {}
    plans = []
    for linear in linears:
        weight = packed(linear)
        fmt, why = _format(weight)
        if fmt is None:
            return [], why
        k_pad = weight.scale_and_zero.shape[0] * int(weight.block_size[-1])
        n_pad = int(weight.scale_and_zero.shape[1])
        device = weight.qdata.device
        key = (fmt.name, k_pad, n_pad, str(device))
        if key not in layouts:
            layouts[key] = derive_layout(functools.partial(_pack_with, fmt, weight), k_pad, device, n_pad)
        layout = layouts[key]
        if layout is None:
            return [], f"the {fmt.name} packing is not a permutation of nibbles within blocks of rows"
        shape_key = (fmt.name, tuple(weight.shape), int(weight.block_size[-1]))
        if shape_key not in roundings:
            everything = torch.arange(weight.shape[1], device=device)
            chosen = next(
                (r for r in Rounding if _matches(weight, dense_weight(weight, layout, r, torch.bfloat16), everything)),
                None,
            )
            if chosen is None:
                return [], f"dequantizing {fmt.name} {tuple(weight.shape)} does not reproduce the kernel's values"
            roundings[shape_key] = chosen
        rounding = roundings[shape_key]
        if not _matches(weight, dense_weight(weight, layout, rounding, torch.bfloat16), _sample(weight, device)):
            return [], f"dequantizing a {fmt.name} {tuple(weight.shape)} weight does not reproduce the kernel's values"
        plans.append((layout, rounding))
    return plans, ""


def _sample(weight: PackedInt4, device: torch.device) -> torch.Tensor:
    """Up to ``SAMPLED_COLUMNS`` columns: the first and last, a group's edges, the rest spread evenly."""
    k, group = int(weight.shape[1]), int(weight.block_size[-1])
    picks = {0, k - 1, min(group - 1, k - 1), min(group, k - 1)}
    picks.update(torch.linspace(0, k - 1, SAMPLED_COLUMNS - len(picks)).long().tolist())
    return torch.tensor(sorted(picks), device=device)


def _dense_forward(linear: nn.Linear, rows: int, layout: Layout, rounding: Rounding):
    """``linear``'s forward: dense for inputs of at least ``rows`` rows, torchao's kernel below."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() < rows * x.shape[-1]:
            return F.linear(x, linear.weight, linear.bias)
        dense = dense_weight(packed(linear), layout, rounding, torch.bfloat16)
        out = F.linear(x.to(torch.bfloat16), dense)
        if linear.bias is not None:
            out += linear.bias.to(out.dtype)
        return out.to(x.dtype)

    return forward
