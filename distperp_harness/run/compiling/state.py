"""What ``compile=`` did and does (:class:`CompileState`, recorded in ``config.distperp.compile``): whether the
layers run compiled, the tree-mask graph's state (:class:`TreeMask`), the warm-ups, graphs and cache hits, and the
compiled and eager calls counted during the run; and :func:`warming`, the compile settings of every warm-up
(deterministic kernels, no duck sizing). After a warm-up nothing compiles again: :meth:`CompileState.recompilations`
counts from dynamo's own counter."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
from accelerate.logging import get_logger

from distperp_harness.distributed.protocol import Collective
from distperp_harness.run.compiling.agreement import fake_compile_failure, first_failure, in_turn
from distperp_harness.run.compiling.prepack import Prepacked

log = get_logger(__name__)


class TreeMask(str, Enum):
    """The tree-mask graph: compiled when the first plan with tree rows needs it, or eager on every rank after a
    failure on any."""

    NOT_NEEDED_YET = "not needed yet"
    COMPILED = "compiled"
    EAGER = "eager"


@dataclass
class CompileState:
    """What ``compile=`` did: recorded in ``config.distperp.compile``. Counters keep running during the run."""

    mode: str | None
    active: bool = False
    reason: str | None = None
    seconds: float = 0.0
    layers: int = 0
    warmup: list[str] = field(default_factory=list)
    graphs: int = 0
    compiled_calls: int = 0
    eager_calls: dict[str, int] = field(default_factory=lambda: {"kv_cache": 0, "not_covered": 0})
    cache: dict[str, Any] = field(default_factory=dict)
    not_covered_example: str | None = None
    prepacked: Prepacked = field(default_factory=Prepacked)
    tree: TreeMask | None = None
    tree_failure: str | None = None
    decode: Any = None
    _tree: Callable[[], list[str]] | None = field(default=None, repr=False)
    _graphs_at_ready: int = field(default=0, repr=False)
    _warming: bool = field(default=False, repr=False)
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def is_warming(self) -> bool:
        """True inside :func:`warming` (warm-up forwards may compile; later calls may not)."""
        return self._warming

    @property
    def tree_mask(self) -> str | None:
        """The tree-mask graph as the record says it: None (no tree rows possible), ``not needed yet``,
        ``compiled``, or ``eager: <why>``."""
        if self.tree is TreeMask.EAGER:
            return f"eager: {self.tree_failure}"
        return None if self.tree is None else self.tree.value

    @property
    def active_mode(self) -> str | None:
        """The mode the run computes with (None: eager); part of the resume key."""
        return self.mode if self.active else None

    def recompilations(self) -> int:
        """Graphs compiled since the warm-up ended (0 by construction; counted from dynamo's own counter)."""
        return max(0, unique_graphs() - self._graphs_at_ready) if self.active else 0

    def restore(self) -> None:
        """Put every layer's eager ``forward`` back."""
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        self.prepacked.restore()
        self.active, self.layers, self.graphs = False, 0, 0
        self.tree, self.tree_failure, self._tree = None, None, None

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Have :meth:`restore` call ``undo`` (the last registered first)."""
        self._restore.append(undo)

    def defer_tree(self, warm_up: Callable[[], list[str]]) -> None:
        """Tree rows are possible: ``warm_up()`` compiles the tree-mask graph when the first plan with tree rows
        needs it (:meth:`prepare`), and returns the warm-ups it ran."""
        self.tree = TreeMask.NOT_NEEDED_YET
        self._tree = warm_up

    def prepare(self, collective: Collective, tree_rows: bool) -> None:
        """Before a scoring call whose global plan has ``tree_rows``: compile the tree-mask graph at its fixed warm-up
        shapes if that has not happened yet (every rank calls this together; the node's local rank 0 first, the
        others then load its kernels). If that fails on any rank, calls with a tree mask run eager on every rank."""
        if not (tree_rows and self.active and self._tree is not None):
            return  # the same on every rank: activity is agreed and the plan is global
        warm_up, self._tree = self._tree, None

        def attempt() -> None:
            with warming(self):
                fake_compile_failure("DISTPERP_TEST_TREE_MASK_FAILURE")
                self.warmup += warm_up()

        failure = first_failure([why for why, _ in in_turn(collective, "the tree-mask graph", attempt)])
        self.tree, self.tree_failure = (TreeMask.COMPILED, None) if failure is None else (TreeMask.EAGER, failure)
        if failure is not None:
            log.warning(
                f"compile={self.mode}: the tree-mask graph did not compile, rows with a tree mask run eager: {failure}",
                main_process_only=True,
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "active": self.active,
            "reason": self.reason,
            "compile_seconds": round(self.seconds, 3),
            "layers": self.layers,
            "warmup": self.warmup,
            "graphs": self.graphs,
            "recompilations": self.recompilations(),
            "tree_mask": self.tree_mask,
            "compiled_calls": self.compiled_calls,
            "eager_calls": dict(self.eager_calls),
            "not_covered_example": self.not_covered_example,
            "cache": self.cache,
            "decode": self.decode.to_dict() if self.decode is not None else None,
            "prepacked": {
                "linears": self.prepacked.linears,
                "bytes": self.prepacked.packed_bytes,
                "rows_hint": self.prepacked.hint,
            },
        }


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def warming(state: CompileState):
    """Compile settings for warm-ups (deterministic kernels, no duck sizing); adds the seconds, graphs and cache
    hits and misses of the block to ``state``, and restarts the recompilation count after it."""
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.utils import counters

    before = (unique_graphs(), counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
    t0 = time.perf_counter()
    state._warming = True
    try:
        # use_duck_shape=False: a warm-up size equal to a weight's (hidden size, heads) must not fix rows or length.
        with (
            torch._inductor.config.patch(_known(torch._inductor.config, deterministic=True)),
            torch._dynamo.config.patch(_known(torch._dynamo.config, recompile_limit=64)),
            fx_config.patch(  # type: ignore[attr-defined]  # torch gives every config module patch() at import
                _known(fx_config, use_duck_shape=False)
            ),
        ):
            yield
    finally:
        state._warming = False
        state.seconds += time.perf_counter() - t0
        state.graphs += unique_graphs() - before[0]
        state._graphs_at_ready = unique_graphs()
        state.cache = {
            "fx_graph_cache": bool(torch._inductor.config.fx_graph_cache),
            "dir": _cache_dir(),
            "hits": state.cache.get("hits", 0) + counters["inductor"]["fxgraph_cache_hit"] - before[1],
            "misses": (state.cache.get("misses", 0) + counters["inductor"]["fxgraph_cache_miss"] - before[2]),
        }


def _known(config: Any, **values: Any) -> dict[str, Any]:
    """The ``values`` this torch build's ``config`` module has (older builds lack some)."""
    return {k: v for k, v in values.items() if hasattr(config, k)}


def _cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # only reported
        return None
