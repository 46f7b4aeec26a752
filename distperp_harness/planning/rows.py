"""Rows: the sequences the model really computes, each a *tree of token runs* holding one or more scoring units.

A :class:`Row` is a list of runs in depth-first order; ``parents[r]`` is the run that run ``r`` continues (``-1`` for
the root, run 0). A run's tokens take the positions that follow its parent's; a token attends to the earlier tokens
of its own run and to every token of its ancestor runs, nothing else. A unit reads along one root-to-run path: its
model input ``tokens[:-1]`` is exactly the tokens of that path (up to its length), so it is computed as if alone.

::

    runs     [ few-shot block ......... ][ question 1 ....][ B ][ C ]  [ question 2 ....]
    parents    -1                          0                 1    1     0
    positions  0 ..................... 699 700 ........ 840 841  841   700 ........ 836
    mask       a token sees its run's earlier tokens and its ancestors' runs: question 2 never sees question 1,
               answer C never sees answer B; all of them see the few-shot block

A scoring call plans which units share a row from unit records (:mod:`distperp_harness.planning.rowplan`, the same rules
without tokens), and the rank that computes a row builds it with :func:`row_of`. :func:`plan_rows` applies the rules
to token sequences directly (a unit's index in ``units`` is its id), the reference the records planner follows:

* units with the same model input are one *input class*, computed once; a class whose input is a prefix of another
  class's input reads along that longer path (a one-token answer after the context of multi-token ones);
* ``mode="prefix"``: the maximal inputs (the trie's leaves) are taken in lexicographic order and packed next-fit
  into rows of at most ``max_row_length`` tokens while the row's cost goes down (:func:`worth_merging`: the tokens
  shared with the previous leaf against the extra dense-attention work of a longer row). Answers after one context
  and questions after one few-shot block become one tree;
* rows whose roots share at least :data:`MIN_SHARED_PREFIX` tokens form a *group*: batches never mix groups, and a
  batch of two or more rows computes the prefix its rows share once (:func:`shared_prefix`, the key/value cache of one
  forward reused by every row; :mod:`distperp_harness.run.scoring.engine.forward`). A thousand questions after one
  700-token few-shot block thus cost their own tokens plus 700 per batch;
* ``mode="inputs"`` (models that cannot take a custom mask): one path per row, input classes still shared;
* ``mode="off"``: one row per unit.

Everything is a pure function of the ordered unit table, so rows and groups never depend on the world size.
Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from distperp_harness.options import Word
from distperp_harness.planning.requests import Unit


class ShareMode(Word):
    """How units share rows (module docstring); a ``str`` enum, so records and logs show its value."""

    OFF = "off"
    INPUTS = "inputs"
    PREFIX = "prefix"


SHARE_MODES = tuple(m.value for m in ShareMode)


def share_mode(mode: ShareMode | str) -> ShareMode:
    """``mode`` as a :class:`ShareMode` (its value accepted too); ``ValueError`` for anything else."""
    try:
        return ShareMode(mode)
    except ValueError:
        raise ValueError(f"share mode {mode!r} is not one of {', '.join(SHARE_MODES)}") from None


MIN_SHARED_PREFIX = 32
"""Shortest prefix a batch computes once for all its rows (below it, one more forward call costs more than the
tokens it saves)."""


@dataclass(frozen=True)
class Row:
    """One computed sequence: ``runs`` in depth-first order, ``parents[r] < r`` (``-1`` for the root); ``units[i]``
    (canonical id ``unit_ids[i]``) ends its input in run ``placement[i]``."""

    runs: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    units: tuple[Unit, ...]
    unit_ids: tuple[int, ...]
    placement: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens this row computes."""
        return sum(map(len, self.runs))

    @property
    def root(self) -> tuple[int, ...]:
        return self.runs[0]

    @property
    def packed(self) -> bool:
        """True when the row needs the tree attention mask (two or more runs)."""
        return len(self.runs) > 1

    @property
    def scored(self) -> int:
        return sum(u.n_score for u in self.units)

    @functools.cached_property
    def _starts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per run: its first position (depth) and its first column in the row."""
        depth: list[int] = []
        column: list[int] = []
        col = 0
        for run, parent in zip(self.runs, self.parents):
            depth.append(0 if parent < 0 else depth[parent] + len(self.runs[parent]))
            column.append(col)
            col += len(run)
        return tuple(depth), tuple(column)

    def tokens(self) -> list[int]:
        return list(itertools.chain.from_iterable(self.runs))

    def run_ids(self) -> list[int]:
        """Per column: the run it belongs to."""
        return [r for r, run in enumerate(self.runs) for _ in run]

    def position_ids(self) -> list[int]:
        """Per column: its position in the inputs it belongs to (each run continues its parent's positions)."""
        depth, _ = self._starts
        return list(itertools.chain.from_iterable(range(d, d + len(run)) for d, run in zip(depth, self.runs)))

    def ancestors(self) -> np.ndarray:
        """``bool [runs, runs]``: ``[r, s]`` is True when run ``s`` is ``r`` or one of its ancestors."""
        n = len(self.runs)
        anc = np.eye(n, dtype=bool)
        for r, parent in enumerate(self.parents):
            if parent >= 0:
                anc[r] |= anc[parent]
        return anc

    def path(self, run: int) -> list[int]:
        """Runs from the root to ``run``."""
        out = []
        while run >= 0:
            out.append(run)
            run = self.parents[run]
        return out[::-1]

    def columns(self, i: int) -> list[int]:
        """Row columns holding the scored positions of ``units[i]``, in order (targets ``units[i].tokens[-n:]``)."""
        unit = self.units[i]
        depth, column = self._starts
        cols: list[int] = []
        for r in self.path(self.placement[i]):
            cols.extend(range(column[r], column[r] + len(self.runs[r])))
        return cols[unit.input_length - unit.n_score : unit.input_length]

    def key(self) -> bytes:
        """Identity of the row's layout and units (for saved batches)."""
        parts = [
            np.asarray(
                [len(self.runs), *map(len, self.runs), *self.parents, *self.placement], dtype=np.int64
            ).tobytes(),
            np.asarray(self.tokens(), dtype=np.int64).tobytes(),
        ]
        return b"|".join(parts + [u.key() for u in self.units])


@dataclass(frozen=True)
class RowPlan:
    """Rows in plan order and the groups batches must not mix: rows ``group_starts[g] ..`` up to the next start
    share a prefix of at least :data:`MIN_SHARED_PREFIX` tokens (the first group may be the rows that share none)."""

    rows: list[Row]
    group_starts: tuple[int, ...]


def unit_rows(units: Sequence[Unit], first_id: int = 0) -> list[Row]:
    """One row per unit (its input as the only run): the unshared layout."""
    return [Row((u.tokens[:-1],), (-1,), (u,), (first_id + i,), (0,)) for i, u in enumerate(units)]


def build_rows(
    units: Sequence[Unit],
    mode: ShareMode | str = ShareMode.PREFIX,
    max_row_length: int | None = None,
    attention_coef: float = 0.0,
) -> list[Row]:
    """The rows of :func:`plan_rows`, in plan order."""
    return plan_rows(units, mode, max_row_length, attention_coef).rows


def plan_rows(
    units: Sequence[Unit],
    mode: ShareMode | str = ShareMode.PREFIX,
    max_row_length: int | None = None,
    attention_coef: float = 0.0,
) -> RowPlan:
    """Rows for ``units`` (the canonical table: a unit's index is its id) and their groups.

    Args:
        mode: a :class:`ShareMode` (or its value: ``"prefix"``, ``"inputs"``, ``"off"``; module docstring).
        max_row_length: a row holds at most this many tokens (None: no limit); a longer unit input gets its own row.
        attention_coef: the plan's attention weight (:func:`distperp_harness.run.runtime.attention_coefficient`):
            rows only grow while the tokens they share outweigh their extra dense-attention work.

    Every unit is in exactly one row; the result depends only on the arguments. Rows come in canonical order within
    each group (longest first, then by the lowest unit id), the rows that share no long prefix first.
    """
    mode = share_mode(mode)
    if mode == ShareMode.OFF:
        rows = unit_rows(units)
        return RowPlan(sorted(rows, key=_order), (0,) if rows else ())
    leaves, readers, classes = _leaves(units)
    lcps = [0] + [common_prefix_length(a, b) for a, b in zip(leaves, leaves[1:])]
    limit = max_row_length if max_row_length is not None else sum(map(len, leaves))
    packs: list[list[int]] = []
    size = 0
    for j, leaf in enumerate(leaves):
        d = lcps[j]
        t = len(leaf) - d
        if mode == ShareMode.PREFIX and packs and size + t <= limit and worth_merging(size, d, t, attention_coef):
            packs[-1].append(j)
            size += t
        else:
            packs.append([j])
            size = len(leaf)
    rows = [
        _tree_row([leaves[j] for j in pack], [lcps[j] for j in pack[1:]], readers, classes, units) for pack in packs
    ]
    if mode == ShareMode.INPUTS:
        return RowPlan(sorted(rows, key=_order), (0,) if rows else ())
    return _grouped(rows, [lcps[p[0]] for p in packs[1:]])


def _leaves(units: Sequence[Unit]) -> tuple[list[tuple[int, ...]], dict, dict]:
    """``(leaves, readers, classes)``: the maximal distinct inputs in lexicographic order, the inputs that are a
    prefix of each leaf (read along its path), and the unit indices of each input."""
    classes: dict[tuple[int, ...], list[int]] = {}
    for i, unit in enumerate(units):
        classes.setdefault(unit.tokens[:-1], []).append(i)
    inputs = sorted(classes)
    leaves: list[tuple[int, ...]] = []
    readers: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    waiting: list[tuple[int, ...]] = []  # prefixes of the next leaf in lexicographic order
    for k, inp in enumerate(inputs):
        if k + 1 < len(inputs) and len(inp) <= len(inputs[k + 1]) and inputs[k + 1][: len(inp)] == inp:
            waiting.append(inp)
            continue
        leaves.append(inp)
        readers[inp] = waiting
        waiting = []
    return leaves, readers, classes


def row_of(units: Sequence[Unit], ids: Sequence[int] | np.ndarray) -> Row:
    """The exact tree row holding ``units`` (canonical ids ``ids``, ascending): every distinct input once, inputs
    that are a prefix of another read along its path, siblings after their common prefix. A pure function of the set
    of units: how the rank that computes a planned row (:mod:`distperp_harness.planning.rowplan`) builds it.

    Raises:
        ValueError: if two neighbouring inputs share no token (a row must be one tree; the plan never asks for that
            unless its prefix hashes collided).
    """
    leaves, readers, classes = _leaves(units)
    lcps = [common_prefix_length(a, b) for a, b in zip(leaves, leaves[1:])]
    if any(d == 0 for d in lcps):
        raise ValueError("a planned row holds inputs that share no prefix: the planner's prefix hashes collided")
    row = _tree_row(leaves, lcps, readers, classes, units)
    return dataclasses.replace(row, unit_ids=tuple(int(ids[i]) for i in row.unit_ids))


def _order(row: Row) -> tuple[int, int]:
    return -row.length, min(row.unit_ids)


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (of one sequence type; binary search on C-level slice
    comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def worth_merging(length: int, shared: int, own: int, attention_coef: float) -> bool:
    """Whether a leaf sharing ``shared`` tokens with a row of ``length`` tokens (adding ``own``) joins it.

    With a row costing ``L (1 + a L)`` (linear work plus dense attention), joining changes the cost by
    ``-shared + a (2 own (length - shared) - shared**2)`` against a row of its own; join when that is negative.
    """
    return -shared + attention_coef * (2 * own * (length - shared) - shared * shared) < 0


def _tree_row(
    leaves: list[tuple[int, ...]], lcps: list[int], readers: dict, classes: dict, units: Sequence[Unit]
) -> Row:
    """The row of ``leaves`` (lexicographic order, ``lcps[k]`` shared by leaves ``k`` and ``k + 1``): the radix
    tree of their paths in depth-first order, each leaf's classes and reader classes placed on its path."""
    runs: list[tuple[int, ...]] = []
    parents: list[int] = []
    leaf_run: list[int] = []

    stack = [(0, len(leaves), 0, -1)]  # (leaf range, depth, parent run), popped in depth-first order
    while stack:
        lo, hi, start, parent = stack.pop()
        end = len(leaves[lo]) if hi - lo == 1 else min(lcps[lo : hi - 1])
        me = len(runs)
        runs.append(leaves[lo][start:end])
        parents.append(parent)
        if hi - lo == 1:
            leaf_run.append(me)
            continue
        cuts = [lo] + [k + 1 for k in range(lo, hi - 1) if lcps[k] == end] + [hi]
        stack.extend((a, b, end, me) for a, b in reversed(list(zip(cuts, cuts[1:]))))
    depth = [0] * len(runs)
    for r in range(1, len(runs)):
        depth[r] = depth[parents[r]] + len(runs[parents[r]])
    ids: list[tuple[int, int]] = []  # (unit id, run)
    for leaf, run in zip(leaves, leaf_run):
        path = []
        r = run
        while r >= 0:
            path.append(r)
            r = parents[r]
        for inp in [*readers[leaf], leaf]:
            end_run = next(p for p in path if depth[p] <= len(inp) - 1)  # deepest run holding its last input token
            ids.extend((i, end_run) for i in classes[inp])
    ids.sort()
    return Row(
        tuple(runs), tuple(parents), tuple(units[i] for i, _ in ids), tuple(i for i, _ in ids), tuple(r for _, r in ids)
    )


def _grouped(rows: list[Row], boundaries: list[int]) -> RowPlan:
    """Rows (lexicographic order; ``boundaries[k]`` tokens shared by rows ``k`` and ``k + 1``) in plan order: runs of
    consecutive rows sharing a long prefix form groups, every other row goes to the first group."""
    spans: list[list[Row]] = [[rows[0]]] if rows else []
    for row, shared in zip(rows[1:], boundaries):
        if shared >= MIN_SHARED_PREFIX and shared_prefix([spans[-1][-1], row]) >= MIN_SHARED_PREFIX:
            spans[-1].append(row)
        else:
            spans.append([row])
    loose = sorted((r for span in spans if len(span) == 1 for r in span), key=_order)
    groups = sorted((sorted(span, key=_order) for span in spans if len(span) > 1), key=lambda g: _order(g[0]))
    ordered, starts = list(loose), [0] if loose else []
    for group in groups:
        starts.append(len(ordered))
        ordered.extend(group)
    return RowPlan(ordered, tuple(starts))


def shared_prefix(rows: Sequence[Row]) -> int:
    """Tokens at the start of every row of ``rows`` that a batch computes once (0: none).

    The common prefix of the rows' root runs, cut before the first scored position of any unit (a position computed
    once has no row to read its output from); 0 when it is shorter than :data:`MIN_SHARED_PREFIX` or there are fewer
    than two rows.
    """
    if len(rows) < 2:
        return 0
    shared = unscored_common_prefix(rows)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def unscored_common_prefix(rows: Sequence[Row]) -> int:
    """Tokens at the start of every row of ``rows`` (one row: its own), cut before the first scored position of any
    unit."""
    shared = min(len(r.root) for r in rows)
    first = rows[0].root
    for row in rows[1:]:
        shared = min(shared, common_prefix_length(first[:shared], row.root[:shared]))
    return min([shared] + [u.input_length - u.n_score for r in rows for u in r.units])
