"""Rows planned from records: which units share a row, and about how long each row is, without any tokens.

The same rules as :func:`distperp_harness.planning.rows.plan_rows`, applied to the merged records
(:class:`~distperp_harness.planning.records.GlobalTable`) instead of token sequences:

* ``mode="prefix"``: distinct model inputs are the leaves, ordered by their prefix-hash ladders (a trie order: inputs
  sharing ``k`` blocks are adjacent); the tokens two neighbours share are estimated to the block below, and leaves
  are packed next-fit while sharing pays (:func:`~distperp_harness.planning.rows.worth_merging`) and the estimated row
  fits ``max_row_length``. Rows whose roots share at least ``MIN_SHARED_PREFIX`` tokens form a group, and a batch of a
  group computes its common prefix once (:func:`batch_shared`);
* ``mode="inputs"``: one row per distinct input; an input that is the context of a longer one (a one-token answer
  after the context of multi-token answers) reads along that longer row;
* ``mode="off"``: one row per unit.

With ``keys`` (one per unit, from the model's length rule: ``distperp_harness.model.lengths``), units of different
keys never share a row, a batch or a cached prefix: each key's units are planned on their own and their rows follow
each other as groups; a negative key (units of one input length) means one path per row (``mode="inputs"``: units
with the same input share it, or ``"off"``) for its units.

Estimates are upper bounds on row lengths and lower bounds on shared prefixes; the rank that computes a row builds
its exact tree from the tokens (:func:`distperp_harness.planning.rows.row_of`), a pure function of the row's units. So
rows, batches and bits depend only on the set of units, never on the world size. Pure numpy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from distperp_harness.planning.records import BLOCK, GlobalTable
from distperp_harness.planning.rows import MIN_SHARED_PREFIX, ShareMode, share_mode, worth_merging


@dataclass(frozen=True)
class PlannedRows:
    """Rows in plan order: ``members[r]`` (unit ids, ascending), ``lengths[r]`` (estimated tokens, an upper bound),
    ``scored[r]``; ``group_starts`` as in :class:`~distperp_harness.planning.rows.RowPlan`. ``span[r]`` is the range of
    leaf positions (trie order) row ``r`` covers and ``lcp[k]`` the estimated tokens leaves ``k - 1`` and ``k`` share;
    ``first_scored[r]`` the earliest input position its units score (a prefix computed once stops before it)."""

    members: list[np.ndarray]
    lengths: np.ndarray
    scored: np.ndarray
    group_starts: tuple[int, ...]
    span: np.ndarray
    lcp: np.ndarray
    first_scored: np.ndarray


@dataclass(frozen=True)
class TablePart:
    """The units ``ids`` of a :class:`~distperp_harness.planning.records.GlobalTable` and their inputs, with the
    attributes the planner reads (unit ``i`` here is unit ``ids[i]`` there)."""

    units: np.ndarray
    inputs: np.ndarray
    unit_input: np.ndarray
    ladder: np.ndarray
    ladder_ptr: np.ndarray

    @classmethod
    def of(cls, table: Table, ids: np.ndarray) -> TablePart:
        used, unit_input = np.unique(table.unit_input[ids], return_inverse=True)
        blocks = table.inputs["blocks"][used].astype(np.int64)
        ptr = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
        take = np.repeat(table.ladder_ptr[used], blocks) + (np.arange(int(ptr[-1])) - np.repeat(ptr[:-1], blocks))
        return cls(table.units[ids], table.inputs[used], unit_input.astype(np.int64), table.ladder[take], ptr)

    def __len__(self) -> int:
        return len(self.units)


Table = Union[GlobalTable, TablePart]


def plan_from_records(
    table: Table,
    mode: ShareMode | str = ShareMode.PREFIX,
    max_row_length: int | None = None,
    attention_coef: float = 0.0,
    keys: np.ndarray | None = None,
) -> PlannedRows:
    """Rows for every unit of ``table`` (module docstring); the result depends only on the table (and ``keys``, one
    per unit: units of different keys never share a row or a batch; negative keys: one path per row)."""
    mode = share_mode(mode)
    if keys is not None and len(keys) and (keys.min() < 0 or keys.min() != keys.max()):
        return _by_keys(table, mode, max_row_length, attention_coef, np.asarray(keys, dtype=np.int64))
    units = table.units
    n = len(units)
    n_score = units["n_score"].astype(np.int64)
    first_scored = units["length"].astype(np.int64) - 1 - n_score  # input positions before it feed no target
    if mode == ShareMode.OFF:
        ids = np.arange(n)
        return _ordered(
            ids,
            units["length"].astype(np.int64) - 1,
            first_scored,
            n_score,
            mode,
            span=np.stack([ids, ids], 1),
            lcp=np.zeros(n, np.int64),
        )
    m = len(table.inputs)
    if mode == ShareMode.INPUTS:
        host = _context_hosts(table)
        hosts, row_of_input = np.unique(host, return_inverse=True)
        k = len(hosts)
        return _ordered(
            row_of_input[table.unit_input],
            table.inputs["length"].astype(np.int64)[hosts],
            first_scored,
            n_score,
            mode,
            span=np.stack([np.arange(k)] * 2, 1),
            lcp=np.zeros(k, np.int64),
        )
    order, lcp = _trie_order(table)
    leaf_len = table.inputs["length"].astype(np.int64)[order]
    limit = max_row_length if max_row_length is not None else int(leaf_len.sum())
    pack_of = np.empty(m, dtype=np.int64)  # per trie position
    starts: list[int] = []
    sizes: list[int] = []
    size = 0
    for p, (d, length) in enumerate(zip(lcp.tolist(), leaf_len.tolist())):
        t = length - d
        if starts and size + t <= limit and worth_merging(size, d, t, attention_coef):
            size += t
            sizes[-1] = size
        else:
            starts.append(p)
            size = length
            sizes.append(size)
        pack_of[p] = len(starts) - 1
    position = np.empty(m, dtype=np.int64)
    position[order] = np.arange(m)
    span = np.stack([starts, [*starts[1:], m]], 1).astype(np.int64) - [0, 1] if starts else np.zeros((0, 2), np.int64)
    return _ordered(
        pack_of[position[table.unit_input]],
        np.asarray(sizes, dtype=np.int64),
        first_scored,
        n_score,
        mode,
        span=span,
        lcp=lcp,
    )


def _by_keys(table: Table, mode: ShareMode, max_row_length: int | None, coef: float, keys: np.ndarray) -> PlannedRows:
    """Each key's units planned alone (non-negative keys first, ascending; then negative ones, longest first) and
    their rows concatenated, each part starting a group."""
    parts: list[tuple[np.ndarray, PlannedRows]] = []
    for key in sorted(np.unique(keys).tolist(), key=lambda k: (k < 0, abs(k))):
        ids = np.flatnonzero(keys == key)
        part_mode = mode if key >= 0 or mode == ShareMode.OFF else ShareMode.INPUTS  # only identical inputs share
        parts.append((ids, plan_from_records(TablePart.of(table, ids), part_mode, max_row_length, coef)))
    members: list[np.ndarray] = []
    starts: list[int] = []
    spans: list[np.ndarray] = []
    lcps: list[np.ndarray] = []
    rows = offset = 0
    for ids, part in parts:
        members.extend(ids[m] for m in part.members)
        starts.extend(sorted({rows, *(rows + s for s in part.group_starts)}) if len(part.members) else [])
        spans.append(part.span + offset)
        lcps.append(part.lcp)
        rows += len(part.members)
        offset += len(part.lcp)
    return PlannedRows(
        members,
        np.concatenate([p.lengths for _, p in parts]),
        np.concatenate([p.scored for _, p in parts]),
        tuple(starts),
        np.concatenate(spans).astype(np.int64).reshape(-1, 2),
        np.concatenate(lcps).astype(np.int64),
        np.concatenate([p.first_scored for _, p in parts]),
    )


def _trie_order(table: Table) -> tuple[np.ndarray, np.ndarray]:
    """Distinct inputs in trie order and the tokens each shares with the one before it (``lcp[0] = 0``).

    An input's sort key is its ladder with its *context* inserted after the blocks the context covers: ``[h(B), ..,
    h(kB), h(context), h((k+1)B), .., h(input)]``, where the context is the shortest one among its units (exact, so
    the answers after one question share exactly that question, however short). Neighbours equal in ``j`` leading
    columns share ``j`` blocks, or, past the context column, at least the context.
    """
    m = len(table.inputs)
    units = table.units
    context_len = units["length"].astype(np.int64) - units["n_score"]
    pick = np.lexsort((context_len, table.unit_input))  # per input, its unit with the shortest context first
    first = np.ones(len(pick), dtype=bool)
    first[1:] = table.unit_input[pick][1:] != table.unit_input[pick][:-1]
    ctx_len = np.zeros(m, dtype=np.int64)
    ctx_hash = np.zeros(m, dtype=np.uint64)
    ctx_len[table.unit_input[pick[first]]] = context_len[pick[first]]
    ctx_hash[table.unit_input[pick[first]]] = units["context"][pick[first]]
    blocks = table.inputs["blocks"].astype(np.int64)
    k_ctx = ctx_len // BLOCK
    depth = int(blocks.max()) + 2 if m else 2
    keys = np.zeros((m, depth), dtype=np.uint64)
    row = np.repeat(np.arange(m), blocks)
    col = np.arange(len(table.ladder)) - np.repeat(table.ladder_ptr[:-1], blocks)
    keys[row, col + (col >= k_ctx[row])] = table.ladder
    keys[np.arange(m), k_ctx] = ctx_hash
    keys[:, depth - 1] = table.inputs["hash"]
    order = np.lexsort(keys[:, ::-1].T) if m else np.zeros(0, np.int64)
    lcp = np.zeros(m, dtype=np.int64)
    if m > 1:
        ordered = keys[order, : depth - 1]
        equal = (ordered[1:] == ordered[:-1]) & (ordered[1:] != 0)
        j = np.argmin(np.concatenate([equal, np.zeros((m - 1, 1), bool)], axis=1), axis=1)
        kc = k_ctx[order[1:]]
        past = (j > kc) & (kc == k_ctx[order[:-1]])
        lcp[1:] = np.where(past, np.maximum(ctx_len[order[1:]], (j - 1) * BLOCK), np.minimum(j, kc) * BLOCK)
        lcp[1:] = np.minimum(lcp[1:], np.minimum(table.inputs["length"][order[1:]], table.inputs["length"][order[:-1]]))
    return order, lcp


def _context_hosts(table: Table) -> np.ndarray:
    """Per input: the input whose row it joins (itself, or the longest input whose units have it as context)."""
    units = table.units
    longer = units["n_score"] > 1  # their input extends their context
    host = np.arange(len(table.inputs))
    best: dict[int, int] = {}
    for context, j in zip(units["context"][longer].tolist(), table.unit_input[longer].tolist()):
        if context not in best or table.inputs["length"][j] > table.inputs["length"][best[context]]:
            best[context] = j
    for j, h in enumerate(table.inputs["hash"].tolist()):
        if h in best and best[h] != j:
            host[j] = best[h]
    return host


def _ordered(
    row_of_unit: np.ndarray,
    lengths: np.ndarray,
    first_scored: np.ndarray,
    n_score: np.ndarray,
    mode: ShareMode,
    *,
    span: np.ndarray,
    lcp: np.ndarray,
) -> PlannedRows:
    """Rows (unit ``i`` in row ``row_of_unit[i]``) in plan order: ``mode="prefix"`` groups consecutive rows sharing a
    long prefix (rows sharing none first), each group and the loose rows by (longest first, lowest unit id)."""
    k = len(lengths)
    by_row = np.argsort(row_of_unit, kind="stable")  # unit ids ascending within each row
    bounds = np.searchsorted(row_of_unit[by_row], np.arange(k + 1))
    members = np.split(by_row, bounds[1:-1]) if k else []
    scored = np.bincount(row_of_unit, weights=n_score, minlength=k).astype(np.int64)
    min_scored = np.full(k, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(min_scored, row_of_unit, first_scored)
    first_id = by_row[bounds[:-1]] if k else np.zeros(0, np.int64)
    if mode == ShareMode.PREFIX and k:
        shared = np.minimum(lcp[span[1:, 0]], np.minimum(min_scored[:-1], min_scored[1:]))
        cut = np.flatnonzero(shared < MIN_SHARED_PREFIX) + 1
        spans = np.split(np.arange(k), cut)
    else:
        spans = [np.arange(k)] if k else []
    key = np.lexsort((first_id, -lengths))  # longest first, then the lowest unit id
    rank = np.empty(k, dtype=np.int64)
    rank[key] = np.arange(k)
    if mode == ShareMode.PREFIX:
        loose = np.concatenate([s for s in spans if len(s) == 1] or [np.zeros(0, np.int64)])
        groups = sorted((s[np.argsort(rank[s])] for s in spans if len(s) > 1), key=lambda g: rank[g[0]])
    else:
        loose, groups = np.arange(k), []
    order, starts = [loose[np.argsort(rank[loose])]], [0] if len(loose) else []
    at = len(loose)
    for group in groups:
        starts.append(at)
        order.append(group)
        at += len(group)
    idx = np.concatenate(order).astype(np.int64) if k else np.zeros(0, np.int64)
    return PlannedRows(
        [members[i] for i in idx.tolist()], lengths[idx], scored[idx], tuple(starts), span[idx], lcp, min_scored[idx]
    )


def batch_shared(rows: PlannedRows, start: int, stop: int) -> int:
    """Estimated tokens that rows ``start .. stop-1`` (one batch) share at their start and that the batch computes
    once: a lower bound on the exact :func:`~distperp_harness.planning.rows.shared_prefix` of their built rows; 0 below
    ``MIN_SHARED_PREFIX`` or for one row."""
    if stop - start < 2:
        return 0
    lo, hi = int(rows.span[start:stop, 0].min()), int(rows.span[start:stop, 1].max())
    shared = int(rows.lcp[lo + 1 : hi + 1].min()) if hi > lo else 0
    shared = min(shared, int(rows.first_scored[start:stop].min()))
    return shared if shared >= MIN_SHARED_PREFIX else 0


def group_of(group_starts: Sequence[int], n_rows: int, row: int) -> tuple[int, int]:
    """``(start, stop)`` of the row group (``group_starts``, over ``n_rows`` rows in plan order) that holds ``row``."""
    k = bisect.bisect_right(group_starts, row) - 1
    start = group_starts[k] if k >= 0 else 0
    return start, group_starts[k + 1] if k + 1 < len(group_starts) else n_rows
