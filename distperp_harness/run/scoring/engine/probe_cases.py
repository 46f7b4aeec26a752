"""The probe's cases: what a run's forwards will do, built at the run's own shapes, each with the units it scores.

A :class:`Target` says what the run does: paths of at most ``max_length`` tokens, tree rows of at most
``tree_tokens`` columns (0: none), several rows per batch or one, cached prefixes or not, and the length rule its
rows follow (:class:`~distperp_harness.model.lengths.LengthRule`). The cases exercise each of those within every
*region* of path lengths that share a length key (the planner never mixes keys), up to the probe's caps:

* ``wide tree``: a short root and as many short branches as fit ``tree_tokens`` columns: columns far past the
  positions (a model that reads columns instead of positions, ALiBi or a window sliced by column, shows it);
* ``deep tree``: a long root and two branches reaching the region's longest path (every window and chunk shorter
  than the path hides keys);
* ``padded batch``: plain rows of mixed lengths in the region, the longest one as long as the region allows, padded
  together (a model that reads the batch's length or largest position shows it), with units reading along a longer
  path;
* ``cached prefix``: rows continuing one prefix's key/value cache, prefix and rows in the region;
* ``same length``: rows of one length above the rule's ``exact_above``, batched without padding.

Every unit is compared with its unshared row (:mod:`~distperp_harness.run.scoring.engine.probe`). Pure: no model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from distperp_harness.model.lengths import LengthRule
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row, ShareMode, build_rows, shared_prefix, unit_rows

CASE_SEED = 1234
"""Seed of the cases' token ids (the same cases on every rank and every run)."""
SCORED = 4
"""Targets each path's last unit scores."""
MIN_REGION = 12
"""Shortest range of path lengths a region needs to be probed (shorter: its paths are probed as they come)."""
DEEP = 512
"""Deep trees reach paths of this many tokens (and past every window or chunk); longer paths are probed as plain
padded rows."""


@dataclass(frozen=True)
class Target:
    """What the run's forwards will do (module doc). ``tree_tokens``: the widest tree row (0: no tree rows);
    ``batched``: batches hold several rows; ``cached``: rows may continue a batch's cached prefix; ``lengths``: the
    length rule rows follow; ``spans``: the windows and chunks the model declares (deep trees run past each)."""

    max_length: int
    tree_tokens: int
    batched: bool = True
    cached: bool = True
    lengths: LengthRule = LengthRule()
    spans: tuple[int, ...] = ()

    def capped(self, plain: int, tree: int) -> Target:
        """This target within the probe's caps: paths of at most ``plain`` tokens, trees of ``tree`` columns."""
        return dataclasses.replace(
            self, max_length=min(self.max_length, plain), tree_tokens=min(self.tree_tokens, tree)
        )


@dataclass(frozen=True)
class Case:
    """One thing the run does: ``kind`` (``alone``, ``tree``, ``padded``, ``cached``, ``same length``), a
    description, the batches (rows, and the prefix the batch computes once) and the units they hold, in row order per
    batch;
    ``checked``: the indices of the units compared with their unshared rows (None: every unit)."""

    kind: str
    what: str
    batches: tuple[tuple[tuple[Row, ...], int], ...]
    checked: tuple[int, ...] | None = None

    @property
    def units(self) -> list[Unit]:
        return [u for rows, _ in self.batches for row in rows for u in row.units]

    @property
    def compared(self) -> list[int]:
        """The indices (in :attr:`units`) of the units compared with their unshared rows."""
        return list(range(len(self.units))) if self.checked is None else list(self.checked)

    @property
    def columns(self) -> int:
        """The widest row's columns."""
        return max((row.length for rows, _ in self.batches for row in rows), default=0)


def regions(target: Target) -> list[tuple[int, int]]:
    """Ranges ``(shortest, longest)`` of path lengths that share one length key, within ``target.max_length`` and
    below the rule's ``exact_above`` (each at least :data:`MIN_REGION` long)."""
    top = target.max_length
    if target.lengths.exact_above is not None:
        top = min(top, target.lengths.exact_above)
    bounds = [s for s in target.lengths.sides if s < top] + [top]
    out, low = [], 1
    for high in bounds:
        if high - low + 1 >= MIN_REGION:
            out.append((low, high))
        low = high + 1
    return out


class CaseTokens:
    """Random token ids from one seeded generator (ids from 3 on: the low ids are often special tokens)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.generator = vocab, torch.Generator().manual_seed(CASE_SEED)

    def __call__(self, n: int) -> list[int]:
        low = min(3, max(0, self.vocab - 1))
        return torch.randint(low, max(low + 1, self.vocab), (n,), generator=self.generator).tolist()


def _path_units(path: list[int], extra: int, low: int) -> list[Unit]:
    """The unit scoring the last :data:`SCORED` targets of ``path`` (its input: all but the last token) and one
    reading along it, ``extra`` tokens shorter (0: none), if its input still has at least ``low`` tokens."""
    units = [Unit(tuple(path), min(SCORED, len(path) - 1))]
    if extra and len(path) - extra > max(2, low):
        units.append(Unit(tuple(path[: len(path) - extra]), 1))
    return units


def _tree(tokens: CaseTokens, root: int, branches: list[int], width: int, low: int) -> tuple[Row, ...]:
    shared = tokens(root)
    units = [u for n in branches for u in _path_units(shared + tokens(n + 1), n // 2, low)]
    return tuple(build_rows(units, ShareMode.PREFIX, max_row_length=width))


def tree_cases(tokens: CaseTokens, low: int, high: int, width: int, spans: tuple[int, ...] = ()) -> list[Case]:
    """The wide tree of the region ``low .. high`` within ``width`` columns, and deep trees whose paths run past
    each of ``spans`` (windows, chunks) and to :data:`DEEP` tokens, within the region and the width (module doc)."""
    cases = []
    root = max(2, min(low, high - 8))
    branch = max(2, min(high - root, 24))
    count = max(2, (width - root) // branch)
    if root + 2 * branch <= width:
        rows = _tree(tokens, root, [branch - (k % 3) for k in range(count)], width, low)
        widest = sorted(
            ((max(row.columns(k)), i) for i, (row, k) in enumerate((r, k) for r in rows for k in range(len(r.units)))),
            reverse=True,
        )
        checked = tuple(sorted({0, 1, *(i for _, i in widest[:4])}))  # the first branch; the widest columns
        what = f"a root of {root} tokens and {count} branches in {width} columns"
        cases.append(Case("tree", what, ((rows, 0),), checked))
    for deep in sorted({min(high, width // 2, DEEP), *(s + 8 for s in spans if s + 8 <= min(high, width // 2))}):
        root = max(low, deep - max(4, deep // 4))
        if deep > root >= 2 and root + 2 * (deep - root) <= width:
            rows = _tree(tokens, root, [deep - root, deep - root - 1], width, low)
            cases.append(Case("tree", f"paths of {deep} tokens after a root of {root}", ((rows, 0),)))
    return cases


def padded_case(tokens: CaseTokens, low: int, high: int) -> Case:
    """Plain rows of the region's longest and a short length, and one between where the region is short, padded
    together."""
    middle = {max(low, (low + high) // 2)} if high <= DEEP else set()
    lengths = sorted({high, low + 1, *middle}, reverse=True)
    units = [u for n in lengths for u in _path_units(tokens(n + 1), max(1, n // 3), low)]
    rows = tuple(build_rows(units, ShareMode.INPUTS))
    longest = set(rows[0].units) if len(lengths) > 1 and high > DEEP else set()  # padded nowhere; alone it costs most
    checked = tuple(i for i, u in enumerate(u for row in rows for u in row.units) if u not in longest)
    return Case("padded", f"rows of {', '.join(map(str, lengths))} tokens in one batch", ((rows, 0),), checked)


def cached_case(tokens: CaseTokens, low: int, high: int, width: int, trees: bool) -> Case | None:
    """Rows continuing one prefix of the region (tree rows when ``trees``), or None where none fits."""
    prefix = max(low, min(high - 6, 40))
    if prefix < 2 or high - prefix < 4:
        return None
    shared = tokens(prefix)
    tails = [min(high - prefix, 12) - k for k in range(3)]
    units = [u for n in tails if n >= 2 for u in _path_units(shared + tokens(n + 1), 1 if trees else 0, low)]
    rows = tuple(build_rows(units, ShareMode.PREFIX if trees else ShareMode.INPUTS, max_row_length=max(width, high)))
    if len(rows) < 2:
        rows = tuple(unit_rows(units))
    common = shared_prefix(rows)
    if common < 2:
        return None
    return Case("cached", f"rows continuing a cached prefix of {common} tokens", ((rows, common),))


def same_length_case(tokens: CaseTokens, length: int) -> Case:
    """Two rows of one length above ``exact_above``, in one batch (no padding)."""
    units = [Unit(tuple(tokens(length + 1)), SCORED) for _ in range(2)]
    return Case("same length", f"two rows of {length} tokens in one batch", ((tuple(unit_rows(units)), 0),))


ALONE = 10
"""Input tokens of the :func:`alone_case` row: fewer than the 16 positions every forward has (right-padded)."""


def alone_case(tokens: CaseTokens) -> Case:
    """One short row alone, as every run computes some: right-padded to 16 positions by the engine. A model whose
    positions read the columns after them (not causal) fails here, and no run of it can be exact."""
    units = [Unit(tuple(tokens(ALONE + 1)), SCORED)]
    return Case("alone", f"a row of {ALONE} tokens alone, right-padded", ((tuple(unit_rows(units)), 0),))


def cases(target: Target, vocab: int) -> list[Case]:
    """Every case of ``target`` (module doc), deterministic."""
    tokens = CaseTokens(vocab)
    out: list[Case] = [alone_case(tokens)]
    for low, high in regions(target):
        if target.tree_tokens:
            out.extend(tree_cases(tokens, low, high, target.tree_tokens, target.spans))
        if target.batched:
            out.append(padded_case(tokens, low, high))
        if target.cached:
            cached = cached_case(tokens, low, high, target.tree_tokens, bool(target.tree_tokens))
            if cached is not None:
                out.append(cached)
    exact = target.lengths.exact_above
    if target.batched and exact is not None and exact < target.max_length:
        out.append(same_length_case(tokens, min(target.max_length, exact + 5)))
    return out
