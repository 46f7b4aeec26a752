"""``compile=``'s decode step: a lane's slots over fixed-shape key/value tensors, one compiled graph per bucket.

With ``compile`` on, :func:`StaticDecoding.decode_lane` replaces :func:`~distperp_harness.run.slots.decode_lane`
(same schedule, same stop rules, same statistics): which prompt enters which slot at which step is decided exactly
as there, only the decode forward differs.

**Buffers.** A lane of ``S`` slots whose longest prompt plus ``max_new`` is ``n`` tokens decodes over transformers'
``StaticCache`` of ``[S, heads, C, head_dim]`` per layer, ``C = capacity_for(longest, max_new)`` (``n`` rounded up
to a multiple of :data:`BUCKET`, so few shapes compile), and a boolean ``[S, C]`` mask
(:class:`~distperp_harness.run.static_cache.StaticBuffers`) of the columns each slot
attends to. Rows are right-aligned at one write column ``w`` shared by all slots (like the eager engine's batch):

* **admit**: prompts are prefilled eager (variable shapes; :func:`~distperp_harness.run.slots.admit`) and each
  kept row's prefill key/value columns (keys rotated with its own positions) and mask are copied **in place** into
  its slot's columns ``[w - L, w)`` (the lowest free slot; ``L`` the prefill's width; when ``w < L`` the live
  columns first move right to make room);
* **decode**: one forward of ``[S, 1]`` tokens, per-row position ids, a 4D mask from ``[S, C]`` (column ``w`` on for
  every slot), writing column ``w`` of every layer (the layers' ``cumulative_length``). A free slot is fed the pad
  token and sees only its own column: harmless, and counted (``padded_positions``);
* **full**: when ``w`` reaches ``C``, the live columns move left in place by the first column any live row uses
  (rare: a row never spans more than ``longest + max_new - 1 < C`` columns, so there is always room after it).

Everything above is a function of the lane's prompts and generated tokens only, so a lane gives the same bits on
any rank and any world size.

**Compiling.** :meth:`StaticDecoding.prepare` compiles the step (``fullgraph``, static shapes) for every ``(S, C)``
bucket the global lane plan needs and has not compiled yet, every rank together, the node's local rank 0 first
(``compiling._in_turn``): the shapes come from the plan (global, the same everywhere), never from timing or rank.
Each warm-up runs the step on zeros. Later steps run under ``fail_on_recompile``; a step the graphs would not cover
runs the same forward eager (counted). If compiling fails on any rank, every rank decodes lanes with the eager
engine from then on (rank 0 says why once); the evaluation never fails for it.

**CUDA.** ``compile=true`` (mode ``default``) compiles the decode step with ``reduce-overhead`` on CUDA: the step's
shapes are static, so CUDA graphs replay it without launch overhead (scoring's layers keep ``default``: their shapes
are dynamic). With CUDA graphs every replay is preceded by ``torch.compiler.cudagraph_mark_step_begin()`` and its
logits are cloned (the next replay overwrites its outputs); the key/value tensors and the mask are static addresses
(``mark_static_address``: no copy per replay).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
from accelerate.logging import get_logger

from distperp_harness.run.kvcache import cache_argument
from distperp_harness.run.static_cache import StaticBuffers, _packed_gqa, kv_shapes
from distperp_harness.run.slots import Lane, LaneStats, PrefixCache, StopRule, _Row, admit, decode_lane, row_rules

log = get_logger(__name__)

BUCKET = 256
"""Capacities are multiples of this: a lane needing ``n`` columns gets ``ceil(n / 256) * 256``."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""torch.compile modes that run CUDA graphs on a CUDA device."""


def capacity_for(longest: int, max_new: int, bucket: int = BUCKET) -> int:
    """Columns of a lane's static cache: its longest prompt plus ``max_new``, rounded up to ``bucket``."""
    need = int(longest) + int(max_new)
    return max(1, -(-need // bucket)) * bucket


def decode_mode(mode: str, device: torch.device) -> str:
    """The torch.compile mode of the decode step for ``compile=mode``: ``default`` (``compile=true``) becomes
    ``reduce-overhead`` (CUDA graphs) on CUDA; ``reduce-overhead`` becomes ``default`` off CUDA (no graphs there)."""
    if device.type == "cuda":
        return "reduce-overhead" if mode == "default" else mode
    return "default" if mode == "reduce-overhead" else mode


def uses_cudagraphs(mode: str, device: torch.device) -> bool:
    return device.type == "cuda" and mode in CUDA_GRAPH_MODES


@dataclass
class DecodeState:
    """What the decode step's compiling did (``config.distperp.compile["decode"]``); counters keep running."""

    mode: str | None = None
    state: str = "not needed yet"
    graphs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    compiled_calls: int = 0
    eager_calls: dict[str, int] = field(default_factory=lambda: {"not_covered": 0, "compile_failed": 0})
    padded_positions: int = 0
    shifts: int = 0
    not_covered_example: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "state": self.state, "graphs": list(self.graphs),
                "compile_seconds": round(self.seconds, 3), "compiled_calls": self.compiled_calls,
                "eager_calls": dict(self.eager_calls), "padded_positions": self.padded_positions,
                "shifts": self.shifts, "not_covered_example": self.not_covered_example}


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the decode step of ``model`` is not compiled (None: it can be)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (the static decode step takes sdpa or eager)"
    return None


class StaticDecoding:
    """The compiled decode step of ``model`` and its buffers; built by :func:`~distperp_harness.run.compiling.
    compile_models`'s caller when compiling is active. ``compile_state``: the run's
    :class:`~distperp_harness.run.compiling.CompileState` (its ``decode`` is this object's :class:`DecodeState`);
    ``bucket``: capacities are its multiples (:func:`capacity_for`)."""

    def __init__(self, model: torch.nn.Module, compile_state: Any, device: torch.device, pad_token_id: int | None,
                 bucket: int = BUCKET) -> None:
        self.bucket = bucket
        self.model, self.compile_state, self.device = model, compile_state, device
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.mode = decode_mode(compile_state.mode, device)
        self.cudagraphs = uses_cudagraphs(self.mode, device)
        self.state = DecodeState(self.mode)
        compile_state.decode = self.state
        self.arg = cache_argument(model)
        self.sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
        self._shapes: list[tuple] | None = None
        self._buffers: dict[tuple[int, int], StaticBuffers] = {}  # the bucket used last (one alive: memory)
        self._compiled_buckets: set[tuple[int, int]] = set()
        self._step = torch.compile(self._forward, mode=self.mode, dynamic=False, fullgraph=True)

    @property
    def active(self) -> bool:
        return self.state.state == "compiled"

    # ------------------------------------------------------------------ compiling
    def prepare(self, collective: Any, lanes: Sequence[Any]) -> None:
        """Compile the step for every ``(slots, capacity)`` bucket of ``lanes`` (:class:`~distperp_harness.run.
        lanes.LanePlan`, the global plan) not compiled yet; every rank calls this together."""
        from distperp_harness.run import compiling

        if self.state.state.startswith("eager"):
            return  # failed once (on some rank): the eager engine on every rank from then on
        needed = sorted({(lane.slots, capacity_for(lane.longest, lane.max_new, self.bucket)) for lane in lanes}
                        - self._compiled_buckets)
        if not needed:
            return  # the same on every rank: the plan is global

        def attempt() -> int:
            t0 = time.perf_counter()
            try:
                with torch.no_grad(), compiling._warming(self.compile_state):  # decode steps run without grad
                    compiling.fail_for_tests("DISTPERP_TEST_DECODE_FAILURE")
                    if self._shapes is None:
                        self._shapes = kv_shapes(self.model, self.device, self.pad)
                    for slots, capacity in needed:
                        buffers = self._bucket(slots, capacity)
                        ids = torch.full((slots, 1), self.pad, dtype=torch.long, device=self.device)
                        for _ in range(3 if self.cudagraphs else 1):  # CUDA graphs: warm up, then record
                            buffers.reset()
                            buffers.allowed[:, 0] = True
                            self._call(buffers, ids, torch.zeros_like(ids))
                        self.state.graphs.append(f"{slots}x{capacity}")
            finally:
                self.state.seconds += time.perf_counter() - t0
            return len(needed)

        reason = unsupported(self.model)
        failure = compiling._first_failure([why for why, _ in compiling._in_turn(collective, "the decode step",
                                                                                  attempt, reason)])
        if failure is None:
            self._compiled_buckets.update(needed)
            self.state.state = "compiled"
            log.info(f"compile={self.compile_state.mode}: decode step compiled (mode {self.mode}) for "
                     f"{', '.join(f'{s} slots x {c}' for s, c in needed)}", main_process_only=True)
        else:
            self.state.state = f"eager: {failure}"
            self._buffers.clear()
            log.warning(f"compile={self.compile_state.mode}: the decode step did not compile, generation decodes "
                        f"eager: {failure}", main_process_only=True)

    def _forward(self, cache, ids: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decode step (what is compiled): ``[S, V]`` logits of ``ids`` ``[S, 1]``."""
        mask = allowed[:, None, None, :]
        if not self.sdpa:  # eager attention adds the mask
            dtype = self.model.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          logits_to_keep=1, **{self.arg: cache}).logits[:, -1, :]

    def _call(self, buffers: StaticBuffers, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One compiled step (outside the warm-up: no recompiling; a step the graphs do not cover runs eager)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten now
        if self.compile_state._warming:
            with _packed_gqa():
                out = self._step(buffers.cache, ids, buffers.allowed, positions)
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"), _packed_gqa():
                    out = self._step(buffers.cache, ids, buffers.allowed, positions)
            except RuntimeError as exc:
                if "fail_on_recompile" not in str(exc):
                    raise
                self.state.eager_calls["not_covered"] += 1
                if self.state.not_covered_example is None:
                    self.state.not_covered_example = " ".join(str(exc).split("triggered by")[-1].split())[:400]
                buffers.set_length(buffers.length)  # the failed call may not have written: same column again
                return self._forward(buffers.cache, ids, buffers.allowed, positions)
            self.state.compiled_calls += 1
        return out.clone() if self.cudagraphs else out

    def _bucket(self, slots: int, capacity: int) -> StaticBuffers:
        key = (slots, capacity)
        if key not in self._buffers:
            self._buffers.clear()  # one bucket's tensors alive at a time
            self._buffers[key] = StaticBuffers(self.model, slots, capacity, self._shapes, self.device)
        return self._buffers[key]

    # ------------------------------------------------------------------ decoding
    def decode_lane(self, model: torch.nn.Module, lane: Lane, rule: StopRule, **kwargs: Any
                    ) -> tuple[list[list[int]], LaneStats]:
        """:func:`~distperp_harness.run.slots.decode_lane`'s contract, over this step when its bucket compiled;
        else (compiling failed, or a lane the plan did not hold) the eager engine itself, its decode forwards counted
        in ``eager_calls``."""
        capacity = capacity_for(max(len(p) for p in lane.prompts), rule.max_new, self.bucket)
        if model is self.model and self.active and (lane.slots, capacity) in self._compiled_buckets:
            return decode_static(self, self._bucket(lane.slots, capacity), lane, rule, **kwargs)
        out, stats = decode_lane(model, lane, rule, **kwargs)
        self.state.eager_calls["compile_failed" if self.state.state.startswith("eager") else "not_covered"] += \
            stats.decode_forwards
        return out, stats


@torch.no_grad()
def decode_static(engine: StaticDecoding, buffers: StaticBuffers, lane: Lane, rule: StopRule, *, tokenizer,
                  device: torch.device, prefixes: PrefixCache | None = None, warpers=None,
                  on_done: Callable[[int, list[int]], None] | None = None,
                  around: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[list[list[int]], LaneStats]:
    """:func:`~distperp_harness.run.slots.decode_lane` over ``buffers`` (module docstring)."""
    model, pad, slots, capacity = engine.model, engine.pad, buffers.slots, buffers.capacity
    decode = tokenizer.decode
    stats = LaneStats(prompts=len(lane.prompts), prompt_tokens=sum(len(p) for p in lane.prompts),
                      shared_tokens=len(lane.prefix), peak_cache_positions=slots * capacity)
    prefix_kv = None
    if any(lane.uses_prefix(i) for i in range(len(lane.prompts))):
        prefix_kv, stats.prefix_computed = (prefixes or PrefixCache()).get(model, lane.prefix, device, around)
        stats.prefill_positions += len(lane.prefix) if stats.prefix_computed else 0
    out: list[list[int] | None] = [None] * len(lane.prompts)
    queue = list(range(len(lane.prompts)))[::-1]
    rows: list[_Row | None] = [None] * slots  # by slot
    position = [0] * slots  # each slot's next position: the tokens its row holds
    start = [0] * slots  # each slot's first column
    buffers.reset()
    w = 0  # the column the next step writes

    choose, ended = row_rules(lane, rule, decode, warpers, out, on_done)

    def live() -> list[int]:
        return [s for s in range(slots) if rows[s] is not None]

    while queue or any(r is not None for r in rows):
        free = [s for s in range(slots) if rows[s] is None]
        admitted = [_Row(queue.pop()) for _ in range(min(len(free), len(queue)))]
        for group, new_cache, new_mask, keep in admit(model, engine.arg, lane, admitted, prefix_kv, pad, device,
                                                      stats, around, choose, ended):
            width = new_mask.shape[1]
            if w < width:  # room on the left for the new rows: the live columns move right
                running = live()
                if running:
                    first = min(start[s] for s in running)
                    buffers.move(first, w, width - w)
                    for s in running:
                        start[s] += width - w
                w = width
                buffers.set_length(w)
            for i in keep:
                s = free.pop(0)
                buffers.write(s, [(layer.keys[i], layer.values[i]) for layer in new_cache.layers], new_mask[i],
                              w - width)
                rows[s], position[s], start[s] = group[i], int(new_mask[i].sum()), w - width
        running = live()
        if not running:
            continue
        if w == capacity:  # full: the live columns move left by the first one any live row uses
            first = min(start[s] for s in running)
            buffers.move(first, w, -first)
            for s in running:
                start[s] -= first
            w -= first
            buffers.set_length(w)
            engine.state.shifts += 1
        ids = torch.tensor([[rows[s].tokens[-1] if rows[s] is not None else pad] for s in range(slots)],
                           dtype=torch.long, device=device)
        positions = torch.tensor([[position[s] if rows[s] is not None else 0] for s in range(slots)],
                                 dtype=torch.long, device=device)
        buffers.allowed[:, w] = True  # every slot sees the column it writes; a free slot only that one
        with around():
            logits = engine._call(buffers, ids, positions)
        buffers.allowed[:, w] = torch.tensor([rows[s] is not None for s in range(slots)], device=device)
        w += 1
        buffers.length = w
        stats.decode_forwards += 1
        stats.decode_positions += len(running)
        stats.padded_positions += slots - len(running)
        engine.state.padded_positions += slots - len(running)
        index = torch.tensor(running, dtype=torch.long, device=device)
        for s, token in zip(running, choose(logits.index_select(0, index), [rows[s] for s in running])):
            rows[s].tokens.append(token)
            position[s] += 1
        for s in running:
            if ended(rows[s]):
                rows[s] = None
                buffers.allowed[s] = False
    stats.generated = sum(len(t) for t in out)
    return out, stats
