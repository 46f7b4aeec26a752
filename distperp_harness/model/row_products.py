"""Matrix products of at least :data:`MIN_ROWS` rows for every ``nn.Linear`` of a model: what makes a decode step's
rows independent of how many rows it holds.

CPU BLAS takes small-matrix paths below 16 rows whose sums depend on the number of rows (and of threads); from 16
rows on a row's product does not depend on the others (measured with MKL's sgemm; checked once per run by
:mod:`~distperp_harness.run.scoring.engine.invariance`). A scoring forward always has 16 positions; a decode step
has one per running sequence, so within :func:`at_least_rows` an input of fewer rows is padded with zero rows
before each ``Linear`` and its output cut back: a memory-bound product of 16 rows costs about what one of 1 does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

MIN_ROWS = 16
"""Fewest rows a matrix product is given. Below it, CPU BLAS takes small-matrix paths whose sums depend on the number
of rows and of threads (measured with MKL's sgemm: 5 to 11 rows), so a row's bits would depend on its batch and on
how many processes share the machine. Shorter inputs are padded with zero rows."""


@contextlib.contextmanager
def at_least_rows(model: torch.nn.Module, rows: int = MIN_ROWS) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` multiplies at least ``rows`` rows (module doc); the
    outputs are the real rows' only, in their shape."""
    shapes: dict[int, torch.Size] = {}

    def pad(module: torch.nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        m = x.numel() // max(1, x.shape[-1])
        if m >= rows or x.dim() < 1:
            return None
        shapes[id(module)] = x.shape
        flat = x.reshape(m, x.shape[-1])
        return (torch.cat([flat, flat.new_zeros(rows - m, x.shape[-1])]), *args[1:])

    def cut(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        shape = shapes.pop(id(module), None)
        if shape is None:
            return None
        m = shape.numel() // max(1, shape[-1])
        return out[:m].reshape(*shape[:-1], out.shape[-1])

    handles = []
    for module in model.modules():
        if _plain_linear(module):
            handles += [module.register_forward_pre_hook(pad), module.register_forward_hook(cut)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _plain_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` computing as one (a subclass with a forward of its own, e.g. a
    router returning scores and logits, is not padded: its outputs' shapes are its own)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def routed_products(model: torch.nn.Module) -> str | None:
    """Why some of ``model``'s products take a batch-dependent number of rows whatever the padding, or None: routed
    experts multiply the tokens routed to them (how many follows the batch), and ``nn.Linear`` subclasses with a
    forward of their own (routers) are not padded to :data:`MIN_ROWS`."""
    from distperp_harness.model.miniature_keys import EXPERT_KEYS

    config = getattr(model, "config", None)
    configs = [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {})]
    experts = [k for c in configs if c is not None for k in EXPERT_KEYS if (getattr(c, k, 0) or 0) > 1]
    if experts:
        return f"its routed experts ({experts[0]}) multiply the tokens routed to them, as many as the batch sends"
    own = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and not _plain_linear(m)})
    if own:
        return f"its {', '.join(own)} layers multiply with a forward of their own (not padded to {MIN_ROWS} rows)"
    return None
