"""Bytes a model's forwards move between processes, counted from the collectives themselves.

While :func:`counting` is active every collective is counted, whoever calls it, at the two doors collectives go
through: the eager ``torch.distributed`` functions (FSDP2's ``all_gather_single``, the ``all_reduce`` of transformers'
tensor-parallel hooks, ...), wrapped for the block, and the functional collectives DTensor issues (``_c10d_functional``
ops), seen by a ``TorchDispatchMode``. For each it records the *payload* (the whole tensor the collective produces or
reduces: an all-gather's output, an all-reduce's tensor) and the bytes each rank *receives* on a ring, the
algorithm NCCL and gloo use for large messages: ``2 (n-1)/n`` of the payload for an all-reduce, ``(n-1)/n`` for an
all-gather, reduce-scatter or all-to-all, the payload for a broadcast.

:func:`forward_traffic` runs a few forwards (``run/execution/probes.py`` gives a loaded model's) of a loaded model under
it, every rank together (they are collective with sharded or tensor-parallel weights), and fits bytes as ``fixed +
per_unit * units``: per decode step (``rows`` one-token rows) and per scored token. A forward without collectives (one
process holding the whole model) counts zero. The mode slows every op while active, so only these probe forwards run
under it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, ContextManager, Iterator, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _group_size(args: tuple, kwargs: dict) -> int:
    """The size of a functional collective's group, from its group name argument."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for value in (*args, *kwargs.values()):
        if isinstance(value, str):
            try:
                return int(_resolve_process_group(cast(Any, value)).size())
            except Exception:  # a reduce op name or tag, not a group name
                continue
    return 1


_EAGER = {  # torch.distributed function -> (kind, index of the payload argument)
    "all_reduce": ("reduce", 0),
    "all_gather_single": ("gather", 0),
    "all_gather_into_tensor": ("gather", 0),
    "all_gather": ("gather", 0),
    "reduce_scatter_single": ("scatter", 1),
    "reduce_scatter_tensor": ("scatter", 1),
    "broadcast": ("broadcast", 0),
    "all_to_all_single": ("scatter", 1),
}


class CollectiveBytes(TorchDispatchMode):
    """Counts collectives while active (see :func:`counting`): ``calls``, ``payload`` and ``received`` bytes
    (module doc), and ``by_op`` payload per collective name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.payload = 0
        self.received = 0.0
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first: its collectives come back here as functional ops
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait"):
            name = func.__name__.split(".")[0]
            n = max(1, _group_size(args, kwargs))
            sizes = [_tensor_bytes(a) for a in args]
            payload = sizes[0] * n if name.startswith("all_gather") else max(sizes, default=0)
            kind = (
                "reduce"
                if name.startswith("all_reduce")
                else "gather"
                if name.startswith("all_gather")
                else "broadcast"
                if name.startswith("broadcast")
                else "scatter"
            )
            self.add(name, kind, payload, n)
        return func(*args, **kwargs)

    def add(self, name: str, kind: str, payload: int, n: int) -> None:
        """Count one collective of ``payload`` bytes over ``n`` ranks (nothing for a group of one)."""
        if n <= 1:
            return
        factor = {"reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(kind, (n - 1) / n)
        self.calls += 1
        self.payload += payload
        self.received += factor * payload
        self.by_op[name] += payload


def _eager(counter: CollectiveBytes, name: str, kind: str, index: int, original: Callable) -> Callable:
    import torch.distributed as dist

    def counted(*args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        payload = _tensor_bytes(args[index] if len(args) > index else next(iter(kwargs.values()), None))
        counter.add(name, kind, payload, dist.get_world_size(group))
        return original(*args, **kwargs)

    return counted


@contextlib.contextmanager
def counting() -> Iterator[CollectiveBytes]:
    """``with counting() as c:`` counts the block's collectives in ``c`` (not thread-safe: one block at a time)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counter = CollectiveBytes()
    saved = {name: getattr(dist, name) for name in _EAGER if hasattr(dist, name)}
    for name, original in saved.items():
        wrapped = _eager(counter, name, *_EAGER[name], original)
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)
    try:
        with counter:
            yield counter
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """``(fixed, per unit)`` of a line through two ``{units: bytes}`` points."""
    (a, ya), (b, yb) = sorted(points.items())
    per = (yb - ya) / (b - a)
    return ya - per * a, per


def forward_traffic(
    decode: Callable[[int], None],
    score: Callable[[int], None],
    around: Callable[[], ContextManager],
    rows: tuple[int, int] = (1, 8),
    tokens: tuple[int, int] = (32, 64),
) -> dict:
    """Bytes per rank of a decode step and of scoring, from the collectives of real forwards (every rank together).

    ``decode(r)``: one generation forward of ``r`` one-token rows; ``score(t)``: one scoring forward of a row of
    ``t`` tokens, every position scored; ``around()``: the context each forward needs (a shard group's root
    weights gathered). Returns received and payload bytes at each size, and the fitted
    ``decode_step_received_bytes`` ``{"fixed", "per_row"}`` and ``scoring_received_bytes`` ``{"fixed",
    "per_token"}``.
    """
    out: dict[str, Any] = {"decode": {}, "scoring": {}}
    for r in rows:
        with counting() as c, around():
            decode(r)
        out["decode"][r] = {
            "received": round(c.received),
            "payload": c.payload,
            "calls": c.calls,
            "by_op": dict(c.by_op),
        }
    for t in tokens:
        with counting() as c, around():
            score(t)
        out["scoring"][t] = {
            "received": round(c.received),
            "payload": c.payload,
            "calls": c.calls,
            "by_op": dict(c.by_op),
        }
    fixed, per_row = _fit({r: v["received"] for r, v in out["decode"].items()})
    out["decode_step_received_bytes"] = {"fixed": round(fixed), "per_row": round(per_row)}
    fixed, per_token = _fit({t: v["received"] for t, v in out["scoring"].items()})
    out["scoring_received_bytes"] = {"fixed": round(fixed), "per_token": round(per_token)}
    return out
