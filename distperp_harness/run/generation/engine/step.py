"""The fixed-shape decode step of :class:`~.static_batch.StaticKVBatch`: eager (:class:`StaticStep`, the default
wherever the model takes a 4D mask), compiled (:class:`CompiledStep`, ``compile`` on) or replayed as CUDA graphs
(:class:`~.cudagraphs.GraphStep`, the default on CUDA). Each reads its inputs from the bucket's fixed buffers
(:class:`~.static_batch.StaticBuffers`) and reads nothing back. Lanes no fixed-shape step serves decode with
:class:`~.kv_batch.DynamicKVBatch`'s eager forward.

**Compiling.** :meth:`CompiledStep.prepare` compiles the step (``fullgraph``, static shapes) for every ``(slots,
capacity)`` bucket the global lane plan needs and has not compiled yet, every rank together, the node's local rank
0 first (:func:`~distperp_harness.run.compiling.agreement.in_turn`): the shapes come from the plan (global, the same
everywhere), never from timing or rank. Each warm-up runs the step on zeros. Later steps run under
``fail_on_recompile``; a step the graphs would not cover runs the same forward eager (counted). If compiling fails
on any rank, every rank decodes lanes with the eager engine from then on (rank 0 says why once); the evaluation
never fails for it.

**CUDA.** ``compile=true`` (mode ``default``) compiles the decode step with ``reduce-overhead`` on CUDA: the step's
shapes are static, so CUDA graphs replay it without launch overhead (scoring's layers keep ``default``: their shapes
are dynamic). With CUDA graphs every replay is preceded by ``torch.compiler.cudagraph_mark_step_begin()`` and its
logits are cloned (the next replay overwrites its outputs); the key/value tensors and the mask are static addresses
(``mark_static_address``: no copy per replay).
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from accelerate.logging import get_logger

from distperp_harness.distributed.protocol import Collective
from distperp_harness.run.compiling.agreement import fake_compile_failure, first_failure, in_turn
from distperp_harness.run.compiling.state import CompileState, warming
from distperp_harness.run.generation.engine.masks import implementation, layer_masks, mask_layout, slots_refused
from distperp_harness.run.generation.engine.prefill import last_logits, plain_layers
from distperp_harness.run.generation.engine.static_batch import StaticBuffers
from distperp_harness.run.scoring.engine.kvcache import cache_argument, whole_cache
from distperp_harness.run.scoring.engine.support import DENSE_IMPLEMENTATIONS, paths_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from distperp_harness.model.attention import AttentionLayout

log = get_logger(__name__)

BUCKET = 256
"""Capacities are multiples of this: a lane needing ``n`` columns gets ``ceil(n / 256) * 256``."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""torch.compile modes that run CUDA graphs on a CUDA device."""


class StepState(enum.Enum):
    """Where the compiled step stands: nothing compiled yet, graphs ready, or eager for the rest of the run."""

    NOT_NEEDED_YET = "not needed yet"
    COMPILED = "compiled"
    EAGER = "eager"


def capacity_for(longest: int, max_new: int, bucket: int = BUCKET) -> int:
    """Columns of a lane's static cache: its longest prompt plus ``max_new``, rounded up to ``bucket``."""
    need = int(longest) + int(max_new)
    return max(1, -(-need // bucket)) * bucket


def decode_mode(mode: str | None, device: torch.device) -> str | None:
    """The torch.compile mode of the decode step for ``compile=mode``: ``default`` (``compile=true``) becomes
    ``reduce-overhead`` (CUDA graphs) on CUDA; ``reduce-overhead`` becomes ``default`` off CUDA (no graphs there)."""
    if device.type == "cuda":
        return "reduce-overhead" if mode == "default" else mode
    return "default" if mode == "reduce-overhead" else mode


def uses_cudagraphs(mode: str | None, device: torch.device) -> bool:
    return device.type == "cuda" and mode in CUDA_GRAPH_MODES


def unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` does not decode with a fixed-shape step (None: it can): the step passes its own 4D masks (one
    per layer type's rule, :mod:`.masks`), which sdpa and eager attention take on a model whose decided paths take
    them (:func:`~distperp_harness.run.scoring.engine.support.paths_of`), and slots must serve the model at all
    (:func:`~.masks.slots_refused`: no recurrent layers; windows applied by position over whole ``StaticLayer``s)."""
    impl = implementation(model)
    if impl not in DENSE_IMPLEMENTATIONS:
        return f"attention implementation {impl!r} (the static decode step takes sdpa or eager)"
    if mask_layout(model) is None:
        paths = paths_of(model)
        return f"the model does not take distperp's 4D attention masks ({paths.packed_rows or 'no attention layout'})"
    return slots_refused(model)


@dataclass
class DecodeState:
    """What the decode step's compiling did (``config.distperp.compile["decode"]``); counters keep running.
    ``failure``: why compiling failed (then every lane decodes eager)."""

    mode: str | None = None
    step: StepState = StepState.NOT_NEEDED_YET
    failure: str | None = None
    graphs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    compiled_calls: int = 0
    eager_calls: dict[str, int] = field(default_factory=lambda: {"not_covered": 0, "compile_failed": 0})
    padded_positions: int = 0
    shifts: int = 0
    not_covered_example: str | None = None

    @property
    def state(self) -> str:
        """The recorded text: ``not needed yet``, ``compiled`` or ``eager: <why>``."""
        return f"eager: {self.failure}" if self.step is StepState.EAGER else self.step.value

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "state": self.state,
            "graphs": list(self.graphs),
            "compile_seconds": round(self.seconds, 3),
            "compiled_calls": self.compiled_calls,
            "eager_calls": dict(self.eager_calls),
            "padded_positions": self.padded_positions,
            "shifts": self.shifts,
            "not_covered_example": self.not_covered_example,
        }


def kv_shapes(model: PreTrainedModel, device: torch.device, pad: int, cache=None) -> list[tuple]:
    """``(kv heads, key dim, value dim, dtype)`` per layer, read from ``cache`` (a prefill's ``DynamicCache``) or,
    when none is given, from a one-token forward's."""
    if cache is None:
        cache = whole_cache()
        last_logits(model, cache, torch.tensor([[pad]], device=device))
    return [
        (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
        for layer in plain_layers(cache)
    ]


def _not_compiling() -> bool:
    return False


@contextlib.contextmanager
def packed_gqa():
    """transformers' sdpa attention of one query token with grouped key/value heads reshapes the query to the
    key/value heads (``pack_gqa``) in eager, but under dynamo repeats every cached key and value to every head
    (``repeat_kv``): a copy of the whole static cache per layer and step, measured 1.15-1.5x slower than eager on
    CPU. Around the compiled step its "compiling?" check answers no, so the graph takes the eager path's reshape
    (the same value at trace time and at every call: the guard on it holds)."""
    from transformers.integrations import sdpa_attention

    before = getattr(sdpa_attention, "is_torchdynamo_compiling", None)
    if before is None:
        yield
        return
    sdpa_attention.is_torchdynamo_compiling = _not_compiling
    try:
        yield
    finally:
        sdpa_attention.is_torchdynamo_compiling = before


class StaticStep:
    """The eager fixed-shape decode step of ``model`` and its bucket's buffers (one bucket alive at a time).

    ``run(buffers)``: ``[slots, vocab]`` logits of one step over ``buffers`` (their ``ids``, ``positions``,
    ``allowed`` and, for a layout with windows, ``key_positions``); the forward writes each slot's keys and values
    at the buffers' write column. ``covers(slots, capacity)``: whether a lane of that bucket decodes over this step.
    ``state``: counters (padded positions, moves left) and, for the compiled and graph steps, what compiling or
    capturing did. ``kind``: the name the generation record gives it. The masks' layout is the model's when the step
    is made (:func:`~.masks.mask_layout`)."""

    kind = "static"

    def __init__(
        self, model: PreTrainedModel, device: torch.device, pad_token_id: int | None, bucket: int = BUCKET
    ) -> None:
        self.bucket = bucket
        self.model, self.device = model, device
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.state = DecodeState()
        self._layout = mask_layout(model)
        self._windowed = bool(self._layout is not None and self._layout.span)
        self._shapes: list[tuple] | None = None
        self._buffers: dict[tuple[int, int], StaticBuffers] = {}  # the bucket used last (one alive: memory)

    def covers(self, slots: int, capacity: int) -> bool:
        return True

    def prepare(self, collective: Collective, lanes: Sequence[Any]) -> None:
        """Nothing to prepare for the eager step (the compiled step compiles the plan's buckets here)."""

    @property
    def layout(self) -> AttentionLayout:
        """The layout of the step's masks (:func:`~.masks.mask_layout`, taken when the step was made: a constant of
        the compiled and captured step).

        Raises:
            ValueError: naming why, for a model the fixed-shape step does not serve (:func:`unsupported`).
        """
        if self._layout is None:
            raise ValueError(f"the fixed-shape decode step cannot decode this model: {unsupported(self.model)}")
        return self._layout

    def forward(
        self, cache, ids: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor:
        """The decode step: ``[S, V]`` logits of ``ids`` ``[S, 1]`` at ``positions`` ``[S, 1]``, attending to the
        columns ``allowed`` (``[S, C]``) within each layer type's window by ``key_positions`` (``[S, C]``, read
        only where the layout has a window or chunk); what is compiled or captured."""
        window = (positions, key_positions) if self._windowed else None  # read outside the graph: a constant
        mask = layer_masks(self.model, self.layout, allowed[:, None, None, :], window)
        return last_logits(self.model, cache, ids, attention_mask=mask, position_ids=positions)

    def run(self, buffers: StaticBuffers) -> torch.Tensor:
        return self.forward(buffers.cache, buffers.ids, buffers.allowed, buffers.positions, buffers.key_positions)

    def buffers_for(self, slots: int, capacity: int, cache=None) -> StaticBuffers:
        """The bucket's buffers (allocated on first use, their shapes read from ``cache``, a prefill's
        ``DynamicCache``, when not known yet; one bucket's tensors alive at a time)."""
        key = (slots, capacity)
        if key not in self._buffers:
            self._buffers.clear()
            if self._shapes is None:
                self._shapes = kv_shapes(self.model, self.device, self.pad, cache)
            self._buffers[key] = StaticBuffers(self.model, slots, capacity, self._shapes, self.device, self._windowed)
            self.allocated(self._buffers[key])
        return self._buffers[key]

    def allocated(self, buffers: StaticBuffers) -> None:
        """Called once per newly allocated bucket, before any row joins it (the graph step captures here)."""

    def count_eager(self, forwards: int) -> None:
        """``forwards`` decode forwards of a lane this step did not serve ran on the dynamic batch."""

    def release(self) -> None:
        """Free the buffers (and graphs): nothing of this step stays allocated after a run."""
        self._buffers.clear()


class CompiledStep(StaticStep):
    """The compiled decode step of ``model`` and its buffers, built when compiling is active. ``compile_state``:
    the run's :class:`~distperp_harness.run.compiling.state.CompileState` (its ``decode`` is this object's
    :class:`DecodeState`); ``bucket``: capacities are its multiples (:func:`capacity_for`)."""

    kind = "compiled"

    def __init__(
        self,
        model: PreTrainedModel,
        compile_state: CompileState,
        device: torch.device,
        pad_token_id: int | None,
        bucket: int = BUCKET,
    ) -> None:
        super().__init__(model, device, pad_token_id, bucket)
        self.compile_state = compile_state
        self.mode = decode_mode(compile_state.mode, device)
        self.cudagraphs = uses_cudagraphs(self.mode, device)
        self.state = DecodeState(self.mode)
        compile_state.decode = self.state
        self.arg = cache_argument(model)
        self._compiled_buckets: set[tuple[int, int]] = set()
        self._step = torch.compile(self.forward, mode=self.mode, dynamic=False, fullgraph=True)

    @property
    def active(self) -> bool:
        return self.state.step is StepState.COMPILED

    def covers(self, slots: int, capacity: int) -> bool:
        """Whether a lane of ``slots`` slots and ``capacity`` columns decodes over a compiled graph."""
        return self.active and (slots, capacity) in self._compiled_buckets

    def prepare(self, collective: Collective, lanes: Sequence[Any]) -> None:
        """Compile the step for every ``(slots, capacity)`` bucket of ``lanes`` (:class:`~.lanes.LanePlan`, the
        global plan) not compiled yet; every rank calls this together."""
        if self.state.step is StepState.EAGER:
            return  # failed once (on some rank): the eager engine on every rank from then on
        needed = sorted(
            {(lane.slots, capacity_for(lane.longest, lane.max_new, self.bucket)) for lane in lanes}
            - self._compiled_buckets
        )
        if not needed:
            return  # the same on every rank: the plan is global

        def attempt() -> int:
            t0 = time.perf_counter()
            try:
                with torch.no_grad(), warming(self.compile_state):  # decode steps run without grad
                    fake_compile_failure("DISTPERP_TEST_DECODE_FAILURE")
                    if self._shapes is None:
                        self._shapes = kv_shapes(self.model, self.device, self.pad)
                    for slots, capacity in needed:
                        buffers = self.buffers_for(slots, capacity)
                        for _ in range(3 if self.cudagraphs else 1):  # CUDA graphs: warm up, then record
                            buffers.reset()
                            buffers.inputs[0].fill_(self.pad)
                            buffers.allowed[:, 0] = True
                            self.run(buffers)
                        self.state.graphs.append(f"{slots}x{capacity}")
            finally:
                self.state.seconds += time.perf_counter() - t0
            return len(needed)

        reasons = [why for why, _ in in_turn(collective, "the decode step", attempt, unsupported(self.model))]
        failure = first_failure(reasons)
        if failure is None:
            self._compiled_buckets.update(needed)
            self.state.step = StepState.COMPILED
            log.info(
                f"compile={self.compile_state.mode}: decode step compiled (mode {self.mode}) for "
                f"{', '.join(f'{s} slots x {c}' for s, c in needed)}",
                main_process_only=True,
            )
        else:
            self.state.step, self.state.failure = StepState.EAGER, failure
            self._buffers.clear()
            log.warning(
                f"compile={self.compile_state.mode}: the decode step did not compile, generation decodes "
                f"eager: {failure}",
                main_process_only=True,
            )

    def run(self, buffers: StaticBuffers) -> torch.Tensor:
        """One compiled step (outside the warm-up: no recompiling; a step the graphs do not cover runs eager)."""
        ids, positions = buffers.ids, buffers.positions
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten now
        if self.compile_state.is_warming:
            with packed_gqa():
                out = self._step(buffers.cache, ids, buffers.allowed, positions, buffers.key_positions)
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"), packed_gqa():
                    out = self._step(buffers.cache, ids, buffers.allowed, positions, buffers.key_positions)
            except RuntimeError as exc:
                if "fail_on_recompile" not in str(exc):
                    raise
                self.state.eager_calls["not_covered"] += 1
                if self.state.not_covered_example is None:
                    self.state.not_covered_example = " ".join(str(exc).split("triggered by")[-1].split())[:400]
                buffers.set_length(buffers.length)  # the failed call may not have written: same column again
                return self.forward(buffers.cache, ids, buffers.allowed, positions, buffers.key_positions)
            self.state.compiled_calls += 1
        return out.clone() if self.cudagraphs else out

    def count_eager(self, forwards: int) -> None:
        """``forwards`` decode forwards of a lane the graphs did not serve (compiling failed, or a bucket the plan
        did not hold) ran eager."""
        self.state.eager_calls["compile_failed" if self.state.step is StepState.EAGER else "not_covered"] += forwards
