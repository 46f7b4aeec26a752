"""``compile=``: the decoder layers of the model (and of the reference) compiled once after loading, with the same
graphs and the same kernels on every process.

**What is compiled, and why.** Every forward distperp makes — scoring's ``model.base_model(...)`` for plain-head
models and ``model(...)`` for the others, the reference pass, the prefix and row forwards of a batch whose rows
share a prefix, generation — goes through the model's stack of decoder layers, and that is where nearly all of the
work besides the output head (which scoring computes itself, in chunks) happens: norms, rotary embedding,
attention, MLP, residuals. So each decoder layer's ``forward`` is compiled (regional compilation), not the whole
model: one graph serves every layer (same code, parameters as inputs), it compiles in seconds where a whole model
takes far longer, and no call path can miss it. Calls that carry a key/value cache (both forwards of a batch whose
rows share a prefix, and generation) run eager: a cache update specializes on the layer index and the cache
length, which would compile one graph per layer and per length; they are counted (``eager_calls``).

**CPU weights.** On CPU the layers' linear layers also compute from oneDNN-packed weights
(:mod:`~distperp_harness.run.compiling.prepack`: what inductor's freezing does, without a graph per layer); measured,
that is most of what compiling gains on CPU.

**Shapes.** ``dynamic=True`` without duck sizing: rows and length are symbolic, so one graph serves batches of
every shape. The graphs are compiled by warm-up forwards of fixed shapes (:func:`warmup_shapes`: from ``max_length``
and the batching rule, never from the requests or the world size): plain rows at load time, and (``share_prefix``
with tree rows) the tree-row mask's graph when the first global plan with tree rows needs it
(:meth:`CompileState.prepare`, every rank together), so a run of rolling windows never pays for it. After a warm-up
nothing compiles again
(``torch.compiler.set_stance("fail_on_recompile")``): a call the warm-up graphs do not cover (a one-row batch when
full-length batches hold several rows, rows of one token) runs eager and is counted. So which kernels compute a batch
depends on its shape alone, on every rank: inductor's size-dependent choices come from the warm-up's sizes (the same
everywhere) and never from timing (``torch._inductor.config.deterministic`` while compiling).

What every rank agrees on, and how a failure turns compiling off for all: :mod:`~.agreement`; what ``compile=`` did,
recorded in ``config.distperp.compile``: :class:`~.state.CompileState`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from accelerate.logging import get_logger

from distperp_harness.distributed.protocol import Collective
from distperp_harness.model.layers import decoder_layers  # tests reach it here too
from distperp_harness.run.compiling.agreement import fake_compile_failure, first_failure, in_turn
from distperp_harness.run.compiling.prepack import packable_bytes, prepack
from distperp_harness.run.compiling.state import CompileState, TreeMask, warming

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)


def warmup_shapes(rows_for: Callable[[int], int], max_length: int) -> list[tuple[int, int]]:
    """``(rows, length)`` of the warm-up forwards, functions of ``max_length`` and the batching rule only: its
    full-length batch. Dynamo keeps batches of one row apart (a graph where rows are 1); that graph is compiled
    too only when the full-length batch is one row (then also two rows of half the length, for the shorter
    batches that hold more rows). Otherwise the odd one-row batch (the end of a plan) runs eager."""
    rows = rows_for(max_length)
    if rows >= 2:
        return [(rows, max_length)]
    return [(1, max_length), (2, max(2, max_length // 2))]


def _carries_cache(args: tuple, kwargs: dict) -> bool:
    from transformers.cache_utils import Cache

    return any(isinstance(v, Cache) for v in (*args, *kwargs.values()))


def _is_recompile(exc: BaseException) -> bool:
    return "fail_on_recompile" in str(exc)


def _dispatch(state: CompileState, eager: Callable, compiled: Callable) -> Callable:
    """A layer's ``forward``: the compiled graph when it covers the call, else eager (counted)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced inside a larger graph (the decode step): inlined, not counted
            return eager(*args, **kwargs)
        if not state.active or _carries_cache(args, kwargs):
            state.eager_calls["kv_cache"] += 1
            return eager(*args, **kwargs)
        if state.is_warming:
            return compiled(*args, **kwargs)
        if state.tree is TreeMask.EAGER and kwargs.get("attention_mask") is not None:
            state.eager_calls["not_covered"] += 1  # the tree-mask graph failed on some rank: eager on all
            return eager(*args, **kwargs)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = compiled(*args, **kwargs)
        except RuntimeError as exc:
            if not _is_recompile(exc):
                raise
            state.eager_calls["not_covered"] += 1
            if state.not_covered_example is None:  # dynamo's guard failures, for config.distperp.compile
                state.not_covered_example = " ".join(str(exc).split("triggered by")[-1].split())[:400]
            return eager(*args, **kwargs)
        state.compiled_calls += 1
        return out

    return forward


def _patch(state: CompileState, model: torch.nn.Module, mode: str | None) -> int:
    """Route every decoder layer of ``model`` through a compiled ``forward``; returns how many."""
    layers = decoder_layers(model)
    if not layers:
        raise RuntimeError(f"{type(model).__name__} has no stack of decoder layers to compile")
    for layer in layers:
        before = layer.__dict__.get("forward")  # an instance attribute (a hook's wrapper, or an earlier run's patch)
        eager = getattr(layer.forward, "distperp_eager", layer.forward)  # a model compiled by an earlier run
        compiled = torch.compile(eager, dynamic=True, mode=mode)
        layer.forward = _dispatch(state, eager, compiled)
        layer.forward.distperp_eager = eager  # type: ignore[attr-defined]  # a function attribute; later runs read it

        def undo(layer=layer, before=before) -> None:
            if before is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = before

        state.on_restore(undo)
    return len(layers)


@torch.no_grad()
def _warm_up(
    model: PreTrainedModel, shapes: Sequence[tuple[int, int]], tree: bool, pad_token_id: int, device: torch.device
) -> list[str]:
    """Forwards of ``shapes`` through ``model``'s base model as scoring makes them: plain causal rows, or with ``tree``
    tree rows (a 4D mask and position ids, as :class:`~distperp_harness.run.scoring.engine.masks.Packing` hands
    them: one mask per layer type where the model's layout has several)."""
    from distperp_harness.run.scoring.engine.kvcache import body_of
    from distperp_harness.run.scoring.engine.masks import Packing
    from distperp_harness.run.scoring.engine.support import paths_of

    done = []
    layout = paths_of(model).layout
    for rows, length in shapes:
        ids = torch.full((rows, length), pad_token_id, dtype=torch.long, device=device)
        extra = Packing.causal(rows, length, device).kwargs(model, layout) if tree else {}
        body_of(model)(input_ids=ids, use_cache=False, **extra)
        done.append(f"{rows}x{length}" + (" tree mask" if tree else ""))
    return done


def _compile(
    state: CompileState,
    models: Sequence[PreTrainedModel],
    shapes: Sequence[tuple[int, int]],
    packed: bool,
    pad_token_id: int,
    device: torch.device,
) -> None:
    """Patch and warm up every model for plain rows (raises on any failure; the caller restores); with ``packed``,
    the tree-mask warm-up waits for the first plan that has tree rows (:meth:`CompileState.prepare`)."""
    state.active = True
    with warming(state):
        for model in models:
            prepack(decoder_layers(model), device, shapes[0][0] * shapes[0][1], state.prepacked)
            state.layers += _patch(state, model, state.mode)
        fake_compile_failure()  # where inductor fails: at the warm-up's first compiled call, after patching
        for model in models:
            state.warmup = _warm_up(model, shapes, False, pad_token_id, device)
    if packed:
        state.defer_tree(
            lambda: [done for model in models for done in _warm_up(model, shapes, True, pad_token_id, device)]
        )


CUDA_REFUSAL = (
    "not offered on CUDA: compiled scoring measured slower than eager there (0.75x in bfloat16, 0.19x with int4 "
    "weights, one H200); generation's decode step replays CUDA graphs without compiling (cuda_graphs=true)"
)


def unsupported(models: Sequence[torch.nn.Module], shard_size: int, device: torch.device | None = None) -> str | None:
    """Why these models are not compiled at all (None: try)."""
    if device is not None and device.type == "cuda":
        return CUDA_REFUSAL
    if not hasattr(torch.compiler, "set_stance"):
        return f"torch {torch.__version__} has no torch.compiler.set_stance (needs torch >= 2.6)"
    if shard_size > 1:
        return (
            "sharded weights (shard_size > 1) are gathered by FSDP hooks around each layer; compiling them is "
            "not supported here"
        )
    from distperp_harness.model.tensor_parallel import is_tensor_parallel

    if any(is_tensor_parallel(m) for m in models):
        return (
            "tensor-parallel weights (tp_size > 1) are DTensor slices whose all-reduces run in transformers' TP "
            "hooks; compiling them is not supported here"
        )
    for model in models:
        if not decoder_layers(model):
            return f"{type(model).__name__} has no stack of decoder layers to compile"
    return None


def compile_extra_bytes(
    mode: str | None, models: Sequence[torch.nn.Module | None], device: torch.device, shard_size: int = 1
) -> int:
    """Bytes that compiling ``models`` with ``mode`` will hold besides their weights: the packed copies of their decoder
    layers' linear weights on CPU (:mod:`~distperp_harness.run.compiling.prepack`); 0 when nothing is compiled."""
    from distperp_harness.model.tensor_parallel import is_tensor_parallel

    if mode is None or shard_size > 1 or any(is_tensor_parallel(m) for m in models):
        return 0
    return sum(packable_bytes(decoder_layers(m), device) for m in models if m is not None)


def compile_models(  # noqa: PLR0913 - each input fixes the warm-up shapes or where they run (keyword-only)
    mode: str | None,
    models: Sequence[PreTrainedModel | None],
    *,
    collective: Collective,
    rows_for: Callable[[int], int],
    max_length: int,
    packed: bool,
    pad_token_id: int,
    device: torch.device,
    shard_size: int = 1,
) -> CompileState:
    """Compile the decoder layers of ``models`` (None entries skipped) with ``mode`` (None: nothing to do) and warm
    them up; every rank must call this together. Returns the :class:`CompileState` (``active`` False, with a
    ``reason``, when any rank could not compile: all ranks then run eager)."""
    state = CompileState(mode)
    if mode is None:
        return state
    present = [m for m in models if m is not None]
    reason = unsupported(present, shard_size, device)
    shapes = warmup_shapes(rows_for, max_length)

    def attempt() -> int:
        _compile(state, present, shapes, packed, pad_token_id, device)
        return state.prepacked.linears

    agreed = in_turn(collective, "the decoder layers", attempt, reason)
    reasons = [why for why, _ in agreed]
    linears = [n for why, n in agreed if why is None]
    if not any(reasons) and len(set(linears)) > 1:  # one kernel choice for all: else one rank's bits would differ
        reasons[0] = f"processes packed different numbers of linear weights for oneDNN: {linears}"
    state.reason = first_failure(reasons)
    if state.reason is not None:
        state.restore()
        log.warning(f"compile={mode}: not compiled, running eager: {state.reason}", main_process_only=True)
    else:
        log.info(
            f"compile={mode}: {state.layers} decoder layers compiled in {state.seconds:.1f} s "
            f"({state.graphs} graphs; warm-up {', '.join(state.warmup)}; on-disk cache hits "
            f"{state.cache.get('hits')}, misses {state.cache.get('misses')}; "
            f"{state.prepacked.linears} linear weights packed for oneDNN"
            + ("; tree-mask graph when a plan has tree rows" if state.tree_mask else "")
            + ")",
            main_process_only=True,
        )
    return state
