"""torchao weight quantization by scheme name: which config runs on which device, and an honest report.

A scheme name (``quantize=`` in ``--model_args``) maps to a handler in :data:`SCHEMES`. Given the model's device,
weight dtype and group size, the handler returns a :class:`QuantPlan`: the torchao config that
``torchao.quantization.quantize_`` applies, how the weights end up stored, and a per-layer check that lists the
layers the kernel cannot take (instead of failing deep inside torchao).

=========  =======================  ==============================================================================
scheme     device, model dtype      torchao config -> weight storage
=========  =======================  ==============================================================================
``int4``   cuda sm80+, bfloat16     ``Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`` (tinygemm)
                                    -> ``int4-packed`` (two values per byte)
``int4``   cpu, bfloat16, g <= 128  ``PrototypeInt4WeightOnlyConfig`` (``Int4OpaqueTensor``, kernel
                                    ``aten._weight_int4pack_mm_for_cpu``) -> ``int4-packed``
``int4``   any other combination    ``IntxWeightOnlyConfig(int4, PerGroup(g), ASYMMETRIC)``: the same group-wise
                                    int4 numerics, dequantized per matmul -> ``int4-in-int8`` (memory as int8)
``int8``   cpu or cuda, any dtype   ``Int8WeightOnlyConfig()`` (per-row scales; no groups) -> ``int8``
``8da4w``  cpu or cuda, any dtype   ``Int8DynamicActivationIntxWeightConfig(int4, PerGroup(g))``: per-token int8
                                    activations, reference kernel -> ``int4-in-int8``
=========  =======================  ==============================================================================

Packed int4 needs a bfloat16 model: :func:`resolve_model_dtype` picks bfloat16 for ``dtype=auto`` and says so. An
explicit ``dtype=float32`` (or ``float16``) is honoured: int4 weights computed in that dtype through the
``int4-in-int8`` config, reported as such (the packed CPU kernel on float32 runs ~60x slower than plain float32,
so it is never chosen). The dtype is never switched. Devices other than cpu/cuda raise ``ValueError``.

``nn.Embedding`` layers are never quantized; the output embedding (``model.get_output_embeddings()``) only with
``include_lm_head=True``. Importing this module does not import torchao.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distperp_harness.errors import InputError
from distperp_harness.options import DTYPES, GROUP_SIZES, QUANT_SCHEMES

# torchao's wheel loads CUDA-only .so files (cutlass sm90a, mxfp8) at import and logs failures where they cannot
# load; no scheme here uses them. transformers imports torchao as soon as a model class is imported: import this
# module before transformers' model classes for the setting to take effect. Set the variable to 0 to override.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

__all__ = [
    "SCHEMES",
    "QuantPlan",
    "QuantReport",
    "SchemeSpec",
    "quantize_model",
    "register_scheme",
    "resolve_model_dtype",
    "weight_bytes",
]

INT4: torch.dtype = getattr(torch, "int4")  # noqa: B009 - torch.int4 exists at runtime, not in torch's stubs

SkipCheck = Callable[[nn.Linear], "str | None"]
"""Why a Linear cannot be quantized by a plan, or ``None`` when it can."""


@dataclass(frozen=True)
class QuantPlan:
    """What a scheme does for one (device, weight dtype, group size): the torchao ``AOBaseConfig`` (``None`` for
    ``none``); the ``storage`` (``int4-packed``: two values per byte; ``int4-in-int8``: one per byte; ``int8``;
    ``full``); a one-sentence ``note`` (kernel, storage, why); ``skip_reason`` for shapes the kernel cannot take."""

    config: Any
    storage: str
    note: str
    skip_reason: SkipCheck = lambda linear: None


@dataclass(frozen=True)
class SchemeSpec:
    """A registered scheme: whether ``group_size`` applies, the dtype its fast path needs, its plan function."""

    name: str
    uses_group_size: bool
    preferred_dtype: torch.dtype | None
    plan: Callable[[torch.dtype, int, torch.device], QuantPlan]


SCHEMES: dict[str, SchemeSpec] = {}
"""Scheme name -> :class:`SchemeSpec`, one per :class:`~distperp_harness.options.QuantScheme` (checked at import)."""


def register_scheme(name: str, *, uses_group_size: bool, preferred_dtype: torch.dtype | None = None):
    """Decorator registering a plan function ``(dtype, group_size, device) -> QuantPlan`` under ``name``."""

    if name not in QUANT_SCHEMES:
        raise ValueError(f"scheme {name!r} is not a QuantScheme ({', '.join(QUANT_SCHEMES)}): add it there first")

    def wrap(plan: Callable[[torch.dtype, int, torch.device], QuantPlan]):
        SCHEMES[name] = SchemeSpec(name, uses_group_size, preferred_dtype, plan)
        return plan

    return wrap


def _import_torchao() -> None:
    """Import torchao (if not yet imported) with its import-time warnings muted."""
    loggers = {lg: lg.level for lg in map(logging.getLogger, ("torchao", "torch.utils._pytree"))}
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        import torchao  # noqa: F401 - imported for its side effects, with its loggers quieted
    finally:
        for lg, level in loggers.items():
            lg.setLevel(level)


def _k_divisible(group_size: int, n_multiple: int = 1) -> SkipCheck:
    """Skip check: ``in_features % group_size == 0`` and (CPU int4 packing) ``out_features % n_multiple == 0``."""

    def check(linear: nn.Linear) -> str | None:
        k, n = linear.in_features, linear.out_features
        if k % group_size:
            return f"in_features={k} is not divisible by group_size={group_size}"
        return f"out_features={n} is not divisible by {n_multiple} (CPU int4 pack kernel)" if n % n_multiple else None

    return check


def _int4_in_int8(group_size: int, why: str) -> QuantPlan:
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, PerGroup

    config = IntxWeightOnlyConfig(
        weight_dtype=INT4, granularity=PerGroup(group_size), mapping_type=MappingType.ASYMMETRIC
    )
    return QuantPlan(
        config,
        "int4-in-int8",
        f"int4 values stored one per byte (memory as int8), dequantized per matmul, because {why}",
        _k_divisible(group_size),
    )


@register_scheme("none", uses_group_size=False)
def _plan_none(dtype: torch.dtype, group_size: int, device: torch.device) -> QuantPlan:
    return QuantPlan(None, "full", "no quantization")


@register_scheme("int4", uses_group_size=True, preferred_dtype=torch.bfloat16)
def _plan_int4(dtype: torch.dtype, group_size: int, device: torch.device) -> QuantPlan:
    if dtype != torch.bfloat16:
        return _int4_in_int8(
            group_size,
            f"the packed int4 kernels need a bfloat16 model and this one is "
            f"{_name(dtype)} (dtype=auto or dtype=bfloat16 gives packed int4)",
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return _int4_in_int8(
                group_size, f"the tinygemm int4 kernel needs compute capability >= 8.0, this GPU has {capability}"
            )
        from torchao.quantization import Int4WeightOnlyConfig
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        config = Int4WeightOnlyConfig(
            group_size=group_size,
            int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
            int4_tile_packed_ntile=16 if torch.version.hip else 8,
            set_inductor_config=False,
        )
        return QuantPlan(
            config,
            "int4-packed",
            "int4 packed two per byte, tinygemm kernel aten._weight_int4pack_mm",
            _k_divisible(group_size),
        )
    if group_size > 128:
        return _int4_in_int8(group_size, f"the CPU int4 kernel takes group_size 32, 64 or 128, not {group_size}")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    config = PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    return QuantPlan(
        config,
        "int4-packed",
        "int4 packed two per byte, CPU kernel aten._weight_int4pack_mm_for_cpu",
        _k_divisible(group_size, 16),
    )


@register_scheme("int8", uses_group_size=False)
def _plan_int8(dtype: torch.dtype, group_size: int, device: torch.device) -> QuantPlan:
    from torchao.quantization import Int8WeightOnlyConfig

    return QuantPlan(
        Int8WeightOnlyConfig(set_inductor_config=False),
        "int8",
        "int8 weights with per-row scales, matmul in the model dtype",
    )


@register_scheme("8da4w", uses_group_size=True)
def _plan_8da4w(dtype: torch.dtype, group_size: int, device: torch.device) -> QuantPlan:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup

    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=INT4, weight_granularity=PerGroup(group_size))
    return QuantPlan(
        config,
        "int4-in-int8",
        "per-token int8 activations x symmetric group-wise int4 weights, reference "
        "kernel (int4 values stored one per byte; no packed 8da4w kernel for this device in torchao)",
        _k_divisible(group_size),
    )


if tuple(SCHEMES) != QUANT_SCHEMES:  # every QuantScheme has its plan, in the same order
    raise ImportError(f"quantize.py registers {tuple(SCHEMES)}, options.QuantScheme names {QUANT_SCHEMES}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scheme(scheme: str) -> SchemeSpec:
    if scheme not in SCHEMES:
        raise InputError(
            f"quantize={scheme!r} is not a known scheme; allowed: {', '.join(SCHEMES)}. "
            "Fix: e.g. quantize=int4,group_size=128."
        )
    return SCHEMES[scheme]


def _check_device_type(scheme: str, device_type: str) -> None:
    if scheme != "none" and device_type not in ("cpu", "cuda"):
        raise InputError(
            f"quantize={scheme} runs on cpu or cuda devices, not {device_type!r}. "
            "Fix: use device=cpu or device=cuda, or quantize=none."
        )


def resolve_model_dtype(scheme: str, requested: str, device: torch.device | str) -> tuple[torch.dtype | None, str]:
    """The dtype to load the model in for ``scheme``, and a one-line note for the log and results.

    ``requested`` is the user's ``dtype`` option. An explicit dtype is returned unchanged (never switched). For
    ``auto``: the scheme's preferred dtype (``int4``: bfloat16), or ``None`` when it has none (``none``, ``int8``,
    ``8da4w``: the loader's own ``auto`` rule applies). Raises ``ValueError`` for an unknown scheme or dtype, or a
    device type the scheme cannot run on.
    """
    spec = _scheme(scheme)
    if requested not in DTYPES:
        raise InputError(f"dtype={requested!r} is not valid; allowed: {', '.join(DTYPES)}.")
    device = torch.device(device)
    _check_device_type(scheme, device.type)
    preferred = spec.preferred_dtype
    if requested != "auto":
        dtype = getattr(torch, requested)
        if preferred is not None and dtype != preferred:
            return dtype, (
                f"dtype={requested} as asked; quantize={scheme} then stores int4 values one per byte "
                f"(memory as int8) and computes in {requested}: the packed int4 kernels need "
                f"{_name(preferred)} (dtype=auto or dtype={_name(preferred)})"
            )
        return dtype, f"dtype={requested} as asked"
    if preferred is not None:
        return preferred, (
            f"dtype=auto with quantize={scheme} on {device.type}: loading in {_name(preferred)}, "
            f"which the packed {scheme} kernel needs"
        )
    return None, "dtype=auto: the loader's default dtype"


def is_tensor_subclass(t: torch.Tensor) -> bool:
    """True for a tensor subclass that holds inner tensors (torchao's quantized weights, DTensor)."""
    return hasattr(type(t), "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter)


def _storage_bytes(t: torch.Tensor, seen: set[tuple[int, int]]) -> int:
    if is_tensor_subclass(t):
        names, _ = getattr(t, "__tensor_flatten__")()  # noqa: B009 - not in Tensor's stubs; a DTensor also names its device_mesh: tensors only
        return sum(
            _storage_bytes(inner, seen) for inner in (getattr(t, n) for n in names) if isinstance(inner, torch.Tensor)
        )
    key = (t.data_ptr(), t.numel() * t.element_size())
    if key[0] != 0 and key in seen:
        return 0
    seen.add(key)
    return key[1]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as really stored.

    A tensor subclass (torchao's quantized weights) counts the sum of its inner tensors (``__tensor_flatten__``,
    recursively: e.g. ``Int4OpaqueTensor``'s uint8 ``qdata`` plus ``scale_and_zero``); a tensor shared by several
    parameters (tied embeddings) counts once. Buffers (e.g. rotary ``inv_freq``) are not counted. A sharded
    parameter (FSDP2's ``DTensor``) counts its local shard: the bytes this process holds.
    """
    seen: set[tuple[int, int]] = set()
    return sum(_storage_bytes(p, seen) for p in model.parameters())


@dataclass(frozen=True)
class QuantReport:
    """What :func:`quantize_model` did: ``to_dict()`` for the results JSON, ``summary()`` for the rank-0 log.

    Attributes:
        scheme, storage, note: the scheme name and its :class:`QuantPlan`'s storage and note.
        config_name, config: the torchao config class that ran and ``config_to_dict(config)`` (``None``: none).
        device_type, model_dtype: where the weights were and their dtype before quantization (e.g. ``bfloat16``).
        group_size: the group size used, ``None`` when the scheme has no groups.
        include_lm_head: whether the output embedding was eligible.
        weight_format: tensor subclass(es) of the quantized weights, e.g. ``Int4OpaqueTensor``.
        quantized: names of the quantized Linear layers, in module order.
        skipped: Linear layer name -> why it stayed in full precision.
        weight_bytes_before, weight_bytes_after: :func:`weight_bytes` before and after.
        seconds: wall time of ``quantize_``.
        notes: further facts worth a line (e.g. untied embeddings).
    """

    scheme: str
    storage: str
    note: str
    config_name: str | None
    config: dict[str, Any] | None
    device_type: str
    model_dtype: str
    group_size: int | None
    include_lm_head: bool
    weight_format: str | None
    quantized: tuple[str, ...]
    skipped: dict[str, str]
    weight_bytes_before: int
    weight_bytes_after: int
    seconds: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (lists for tuples), plus ``warnings``."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out.update(
            quantized=list(self.quantized), skipped=dict(self.skipped), notes=list(self.notes), warnings=self.warnings
        )
        return out

    @property
    def warnings(self) -> list[str]:
        """A quantize setting that quantized no layer (e.g. every shape indivisible by ``group_size``)."""
        if self.config_name is None or self.quantized:
            return []
        reasons = collections.Counter(self.skipped.values())
        why = "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common(3))
        return [
            f"quantize={self.scheme}{'' if self.group_size is None else f',group_size={self.group_size}'} "
            f"quantized no layer: all {len(self.skipped)} Linear layers were skipped ({why}); the model runs in "
            f"{self.model_dtype}, unquantized. Fix: a group_size that divides the layers' input widths, or "
            f"another scheme."
        ]

    def summary(self) -> str:
        """One line for the rank-0 log."""
        weights = f"weights {self.weight_bytes_before / 1e6:.2f} MB"
        if self.config_name is None:
            return f"quantize=none: {weights} in {self.model_dtype}"
        groups = "" if self.group_size is None else f", group_size={self.group_size}"
        reasons = collections.Counter(self.skipped.values())
        why = "; ".join(f"{n}x {reason}" for reason, n in reasons.items())
        ratio = self.weight_bytes_after / max(self.weight_bytes_before, 1)
        return " ".join(
            [
                f"quantize={self.scheme}: {self.config_name} [{self.storage}] on {self.device_type}, {self.model_dtype}"
                f"{groups}: {len(self.quantized)} Linear layers quantized, {len(self.skipped)} skipped"
                f"{f' ({why})' if why else ''}; {weights} -> {self.weight_bytes_after / 1e6:.2f} MB (x{ratio:.2f}) in "
                f"{self.seconds:.1f} s. {self.note}.",
                *self.notes,
            ]
        )


def _placement(model: nn.Module, scheme: str) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the Linear weights (of all floating parameters when there is no Linear)."""
    params = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    params = params or [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        raise InputError(f"quantize={scheme}: the model has no floating-point weights to quantize.")
    types = sorted({p.device.type for p in params})
    if len(types) > 1:
        raise InputError(
            f"quantize={scheme}: the model's weights are spread over {', '.join(types)}; quantize a "
            "model that sits on one device type (no CPU/disk offload)."
        )
    _check_device_type(scheme, types[0])
    return params[0].device, params[0].dtype


def quantize_model(
    model: nn.Module, scheme: str, *, group_size: int = 128, include_lm_head: bool = False
) -> QuantReport:
    """Quantize ``model``'s Linear layers in place with the torchao config that ``scheme`` picks for its device.

    Args:
        model: a causal LM (or any module) whose weights sit on one cpu or cuda device.
        scheme: a key of :data:`SCHEMES`; ``none`` leaves the model untouched and reports its bytes.
        group_size: one of ``options.GROUP_SIZES``; used by ``int4`` and ``8da4w``.
        include_lm_head: also quantize the output embedding (``model.get_output_embeddings()``). If it is tied
            to the input embedding, the two get untied (the embedding keeps full precision); a note says so.

    Returns:
        A :class:`QuantReport`. Linear layers the kernel cannot take (e.g. ``in_features`` not divisible by
        ``group_size``) are skipped and listed with the reason, as are layers torchao left unquantized.

    Raises:
        ValueError: unknown scheme, group size not allowed, or a device the scheme cannot run on.
    """
    spec = _scheme(scheme)
    if group_size not in GROUP_SIZES:
        raise InputError(
            f"group_size={group_size!r} is not valid; allowed: {', '.join(map(str, GROUP_SIZES))}. "
            "Fix: e.g. group_size=128."
        )
    device, dtype = _placement(model, scheme)
    if scheme != "none":
        _import_torchao()
    plan = spec.plan(dtype, group_size, device)
    before = weight_bytes(model)
    common: dict[str, Any] = dict(
        scheme=scheme,
        storage=plan.storage,
        note=plan.note,
        device_type=device.type,
        model_dtype=_name(dtype),
        include_lm_head=include_lm_head,
        weight_bytes_before=before,
    )
    if plan.config is None:
        return QuantReport(
            config_name=None,
            config=None,
            group_size=None,
            weight_format=None,
            quantized=(),
            skipped={},
            weight_bytes_after=before,
            seconds=0.0,
            **common,
        )

    selection = select_layers(model, plan, include_lm_head)
    chosen = set(selection.selected)
    from torchao.quantization import quantize_

    start = time.perf_counter()
    with torch.no_grad():
        quantize_(model, plan.config, filter_fn=lambda module, fqn: fqn in chosen)
    return finish_report(model, scheme, plan, group_size, selection, common, time.perf_counter() - start)


@dataclass
class LayerSelection:
    """Which Linear layers a plan quantizes, in module order: their names, the skipped ones with the reason, and
    notes for the report (a caller may narrow it further before quantizing)."""

    selected: list[str]
    skipped: dict[str, str]
    notes: list[str]


def select_layers(model: nn.Module, plan: QuantPlan, include_lm_head: bool) -> LayerSelection:
    """Which Linear layers ``plan`` quantizes (:class:`LayerSelection`).

    Reads only module types, shapes and identities, so a ``meta``-device skeleton gives the same answer as the
    loaded model (what :func:`distperp_harness.model.loading.load_quantized` relies on).
    """
    lm_head = getattr(model, "get_output_embeddings", lambda: None)()
    selected: list[str] = []
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason: str | None
        if module is lm_head and not include_lm_head:
            reason = "output embedding kept in full precision by default (quantize_lm_head=true includes it)"
        elif is_tensor_subclass(module.weight):
            reason = f"already quantized ({type(module.weight).__name__})"
        else:
            reason = plan.skip_reason(module)
        if reason is None:
            selected.append(name)
        else:
            skipped[name] = reason
    notes: list[str] = []
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    head_name = next((name for name, module in model.named_modules() if module is lm_head), None)
    if head_name in selected and getattr(embedding, "weight", None) is getattr(lm_head, "weight", None):
        notes.append(
            "The output embedding was tied to the input embedding: quantizing it untied them, and the "
            "input embedding keeps its full-precision copy."
        )
    return LayerSelection(selected, skipped, notes)


def finish_report(
    model: nn.Module,
    scheme: str,
    plan: QuantPlan,
    group_size: int,
    selection: LayerSelection,
    common: dict[str, Any],
    seconds: float,
) -> QuantReport:
    """The :class:`QuantReport` of ``model`` after ``plan`` ran on the ``selection``: a selected layer whose weight
    is still a plain tensor is listed as skipped (left unquantized by torchao)."""
    from torchao.core.config import config_to_dict

    skipped = dict(selection.skipped)
    quantized: list[str] = []
    formats: collections.Counter[str] = collections.Counter()
    modules = dict(model.named_modules())
    for name in selection.selected:
        if is_tensor_subclass(modules[name].weight):
            quantized.append(name)
            formats[type(modules[name].weight).__name__] += 1
        else:
            skipped[name] = "left unquantized by torchao (the weight is a plain tensor after quantize_)"
    return QuantReport(
        config_name=type(plan.config).__name__,
        config=config_to_dict(plan.config),
        group_size=group_size if SCHEMES[scheme].uses_group_size else None,
        weight_format=", ".join(formats) or None,
        quantized=tuple(quantized),
        skipped=skipped,
        weight_bytes_after=weight_bytes(model),
        seconds=seconds,
        notes=tuple(selection.notes),
        **common,
    )
