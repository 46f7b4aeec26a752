"""Matrix products whose rows' bits do not depend on how many rows they hold, for every plain ``nn.Linear`` of a
model: what makes a decode step's rows independent of how many rows it holds.

CPU BLAS takes small-matrix paths below 16 rows whose sums depend on the number of rows (and of threads); from 16
rows on a row's product does not depend on the others (measured with MKL's sgemm; checked once per run by
:mod:`~distperp_harness.run.scoring.engine.invariance`). A scoring forward always has 16 positions; a decode step
has one per running sequence, so within :func:`at_least_rows` an input of fewer rows is padded with zero rows
before each ``Linear`` and its output cut back. Some sizes below 16 already compute as 16 rows do (MKL here: 4, 8 and
12 to 15 rows, at 1 to 8 threads); :func:`measure_row_sizes` finds them once per run on the model's own products,
dtype and device (:class:`RowSizes`), and a product is padded only to the next of them: a decode step of 2 rows
padded to 16 cost 1.10x the step unpadded, padded to 4 it costs less than unpadded (MKL's 2-row path is slower).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

MIN_ROWS = 16
"""Fewest rows a matrix product is given. Below it, CPU BLAS takes small-matrix paths whose sums depend on the number
of rows and of threads (measured with MKL's sgemm: 5 to 11 rows), so a row's bits would depend on its batch and on
how many processes share the machine. Shorter inputs are padded with zero rows (to the next size of
:class:`RowSizes` that computes as this many do)."""

MEASURE_SEED = 977
"""Seed of the rows :func:`measure_row_sizes` multiplies (the same on every rank)."""


@dataclass(frozen=True)
class RowSizes:
    """Sizes below :data:`MIN_ROWS` whose products give each row the bits a product of :data:`MIN_ROWS` rows gives
    it, for every plain ``Linear`` of a model on its device (``exact``; none: every product is padded to
    :data:`MIN_ROWS`, what holds without a measurement)."""

    exact: frozenset[int] = frozenset()

    def target(self, rows: int) -> int:
        """How many rows a product of ``rows`` rows is given: ``rows`` from :data:`MIN_ROWS` on, else the next exact
        size (:data:`MIN_ROWS` if none)."""
        if rows >= MIN_ROWS:
            return rows
        return min((s for s in self.exact if s >= rows), default=MIN_ROWS)

    def merged(self, other: RowSizes) -> RowSizes:
        """The sizes exact for both (ranks whose kernels differ agree on what is exact for all)."""
        return RowSizes(self.exact & other.exact)

    def describe(self) -> str:
        """One line: which products are padded to how many rows."""
        if not self.exact:
            return f"products of fewer than {MIN_ROWS} rows padded to {MIN_ROWS}"
        return f"products of fewer than {MIN_ROWS} rows computed at {sorted(self.exact)} rows or {MIN_ROWS}"


_SIZES: weakref.WeakKeyDictionary[torch.nn.Module, RowSizes] = weakref.WeakKeyDictionary()
_LINEARS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Linear]] = weakref.WeakKeyDictionary()


def record_row_sizes(model: torch.nn.Module, sizes: RowSizes) -> None:
    """Keep ``sizes`` as ``model``'s for every later :func:`at_least_rows` (the run's measured, merged sizes)."""
    _SIZES[model] = sizes


def row_sizes_of(model: torch.nn.Module) -> RowSizes:
    """``model``'s recorded :class:`RowSizes`, or none exact (every product padded to :data:`MIN_ROWS`)."""
    try:
        return _SIZES.get(model, RowSizes())
    except TypeError:
        return RowSizes()


def measure_row_sizes(model: torch.nn.Module) -> RowSizes:
    """The sizes below :data:`MIN_ROWS` at which every plain ``Linear`` of ``model`` gives each row the bits of a
    :data:`MIN_ROWS`-row product: one module per distinct kind (shapes, dtype, weight type, bias, device), seeded
    rows in its weight's dtype, each candidate size tried on the first rows and on the last (the rows at other
    places), every bit compared; the cheapest modules first, so the widest (the head) tries only the sizes left.
    None exact where a weight is a ``DTensor`` (a tensor-parallel slice: its products are collectives, which ranks
    must call alike, and its sums are the group's)."""
    from torch.distributed.tensor import DTensor

    kinds: dict[tuple, torch.nn.Linear] = {}
    for module in _plain_linears(model):
        w = module.weight
        if isinstance(w, DTensor):
            return RowSizes()
        key = (module.in_features, module.out_features, w.dtype, type(w), w.device, module.bias is not None)
        kinds.setdefault(key, module)
    left = set(range(1, MIN_ROWS))
    g = torch.Generator().manual_seed(MEASURE_SEED)
    with torch.no_grad():
        for module in sorted(kinds.values(), key=lambda m: m.in_features * m.out_features):
            if not left:
                break
            dtype = module.weight.dtype if module.weight.dtype.is_floating_point else torch.float32
            x = torch.randn(MIN_ROWS, module.in_features, generator=g).to(module.weight.device, dtype)
            whole = module(x)
            left = {
                n
                for n in left
                if torch.equal(module(x[:n]), whole[:n])
                and torch.equal(module(x[MIN_ROWS - n :]), whole[MIN_ROWS - n :])
            }
    return RowSizes(frozenset(left))


@contextlib.contextmanager
def at_least_rows(model: torch.nn.Module, sizes: RowSizes | None = None) -> Iterator[None]:
    """Within the block, every plain ``nn.Linear`` of ``model`` multiplies a number of rows that computes as
    :data:`MIN_ROWS` rows do (``sizes``, by default the model's recorded :func:`row_sizes_of`; module doc), padded
    with zero rows; the outputs are the real rows' only, in their shape."""
    sizes = row_sizes_of(model) if sizes is None else sizes
    shapes: dict[int, torch.Size] = {}

    def pad(module: torch.nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        if x.dim() < 1:
            return None
        m = x.numel() // max(1, x.shape[-1])
        rows = sizes.target(m)
        if rows == m:
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
    for module in _plain_linears(model):
        handles += [module.register_forward_pre_hook(pad), module.register_forward_hook(cut)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """``model``'s plain ``nn.Linear`` modules (:func:`_plain_linear`), listed once per model (a decode step enters
    :func:`at_least_rows` once per forward)."""
    try:
        found = _LINEARS.get(model)
    except TypeError:
        found = None
    if found is None:
        found = [m for m in model.modules() if _plain_linear(m)]  # type: ignore[misc]
        with contextlib.suppress(TypeError):
            _LINEARS[model] = found
    return found


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
    experts = [k for c in configs if c is not None for k in sorted(EXPERT_KEYS) if (getattr(c, k, 0) or 0) > 1]
    if experts:
        return f"its routed experts ({experts[0]}) multiply the tokens routed to them, as many as the batch sends"
    own = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and not _plain_linear(m)})
    if own:
        return f"its {', '.join(own)} layers multiply with a forward of their own (not padded to {MIN_ROWS} rows)"
    return None
