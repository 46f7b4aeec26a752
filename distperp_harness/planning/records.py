"""Unit records: what ranks exchange to plan together — fixed-size metadata and prefix hashes, never tokens.

Each rank turns its own distinct units (flat int32 tokens, O(own tokens)) into:

* one :data:`UNIT` record per unit: a 128-bit identity ``key`` (blake2b of the tokens and the scored count), the
  hashes of its model input and of its *context* (the tokens before the first scored target), its token count and
  scored count (40 bytes);
* one :data:`INPUT` record per distinct model input and its *ladder*: the hashes of its prefixes of ``BLOCK``,
  ``2 BLOCK``, ... tokens (8 bytes per block), from which the planner sees which inputs share a prefix and about how
  long it is (to a block), without their tokens.

:class:`GlobalTable` merges every rank's records into the one canonical table: units ordered by ``key`` (a function of
the set of units only), with the ranks that hold each one. Identity is the key; a collision is never silent: records
with one key must agree on every field, inputs with one hash on their length and ladder (checked here), and the ranks
that compute a unit send back a second, independent hash of the tokens they used, which each rank that asked compares
with its own (:mod:`distperp_harness.run.execution.routing`). Prefix hashes are planning hints: the rows are built from
the real tokens, and a row longer than its plan says is reported as a collision.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distperp_harness.planning.requests import Unit

BLOCK = 16
"""Tokens per ladder step: the planner knows shared prefixes to within this many tokens."""
CHUNK = 1 << 20
"""Tokens hashed at a time (bounds the temporaries of :meth:`FlatUnits.prefix_hashes`)."""

UNIT = np.dtype([("key", "<u8", (2,)), ("input", "<u8"), ("context", "<u8"), ("length", "<i4"), ("n_score", "<i4")])
INPUT = np.dtype([("hash", "<u8"), ("length", "<i4"), ("blocks", "<i4")])
_HEADER = 3  # int64 counts: units, inputs, ladder entries

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_K_TOKEN, _K_POS, _K_LEN = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93), np.uint64(0xA0761D6478BD642F)
PLAN_SEED, CHECK_SEED = 0x1F2E3D4C5B6A7988, 0x6A09E667F3BCC909


class HashCollision(RuntimeError):
    """Two different token sequences met under one hash: the run stops rather than mix their results."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class FlatUnits:
    """Units as flat arrays: unit ``i`` is ``tokens[offsets[i]:offsets[i+1]]`` scoring its last ``n_score[i]``."""

    tokens: np.ndarray  # int32
    offsets: np.ndarray  # int64 [n + 1]
    n_score: np.ndarray  # int32 [n]

    @classmethod
    def of(cls, units: Sequence[Unit]) -> "FlatUnits":
        return cls.of_sequences([u.tokens for u in units], [u.n_score for u in units])

    @classmethod
    def of_sequences(cls, sequences: Sequence[Sequence[int]], n_score: Sequence[int]) -> "FlatUnits":
        """Token sequences and their scored counts (a generation prompt scores none: 0)."""
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(offsets[-1]))
        return cls(tokens, offsets, np.asarray(n_score, dtype=np.int32).reshape(len(sequences)))

    def __len__(self) -> int:
        return len(self.n_score)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def unit(self, i: int) -> Unit:
        return Unit(self.sequence(i), int(self.n_score[i]))

    def sequence(self, i: int) -> tuple[int, ...]:
        """Unit ``i``'s tokens."""
        return tuple(self.tokens[self.offsets[i] : self.offsets[i + 1]].tolist())

    def keys(self) -> np.ndarray:
        """``uint64 [n, 2]``: blake2b-128 of each unit's int32 tokens and scored count (its identity)."""
        out = np.empty((len(self), 2), dtype=np.uint64)
        raw = self.tokens.astype("<i4", copy=False)
        for i in range(len(self)):
            h = hashlib.blake2b(raw[self.offsets[i] : self.offsets[i + 1]].tobytes(), digest_size=16)
            h.update(int(self.n_score[i]).to_bytes(4, "little"))
            out[i] = np.frombuffer(h.digest(), dtype="<u8")
        return out

    def prefix_hashes(self, unit: np.ndarray, length: np.ndarray, seed: int = PLAN_SEED) -> np.ndarray:
        """``uint64``: the hash of the first ``length[j]`` tokens of unit ``unit[j]`` (never 0), for all ``j`` at once.

        Position-keyed token mixes summed with wrapping arithmetic, then mixed with the length: a function of those
        tokens only, so equal prefixes of different units hash alike. Works through the tokens in chunks of about
        ``CHUNK`` tokens, so its temporaries stay small whatever the rank holds.
        """
        unit, length = np.asarray(unit, dtype=np.int64), np.asarray(length, dtype=np.int64)
        out = np.empty(len(unit), dtype=np.uint64)
        order = np.argsort(unit, kind="stable")
        cuts = np.searchsorted(self.offsets, np.arange(0, int(self.offsets[-1]) + CHUNK, CHUNK), side="right") - 1
        bounds = np.unique(np.concatenate([[0], cuts.clip(0, len(self)), [len(self)]]))
        at = np.searchsorted(unit[order], bounds)
        for lo, hi, q0, q1 in zip(bounds[:-1], bounds[1:], at[:-1], at[1:]):
            if q0 == q1:
                continue
            base = int(self.offsets[lo])
            tokens = self.tokens[base : int(self.offsets[hi])]
            offsets = self.offsets[lo : hi + 1] - base
            with np.errstate(over="ignore"):
                pos = np.arange(len(tokens), dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
                v = _mix(
                    tokens.astype(np.uint64) * _K_TOKEN
                    + (pos.astype(np.uint64) + np.uint64(1)) * _K_POS
                    + np.uint64(seed)
                )
                total = np.concatenate([[np.uint64(0)], np.cumsum(v, dtype=np.uint64)])
                q = order[q0:q1]
                start = offsets[unit[q] - lo]
                s = total[start + length[q]] - total[start]
                out[q] = _mix(s ^ (length[q].astype(np.uint64) * _K_LEN + np.uint64(seed))) | np.uint64(1)
        return out

    def check_hashes(self) -> np.ndarray:
        """A second hash of every unit's whole token sequence (independent of the key), for checks where units meet."""
        return self.prefix_hashes(np.arange(len(self)), self.lengths, CHECK_SEED)


def local_records(flat: FlatUnits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's ``(UNIT records [n], INPUT records [m], ladder uint64)`` for its distinct units ``flat``."""
    n = len(flat)
    idx = np.arange(n)
    lengths = flat.lengths
    units = np.empty(n, dtype=UNIT)
    units["key"] = flat.keys()
    units["input"] = flat.prefix_hashes(idx, lengths - 1)
    units["context"] = flat.prefix_hashes(idx, lengths - flat.n_score)
    units["length"] = lengths
    units["n_score"] = flat.n_score
    _, first = np.unique(units["input"], return_index=True)
    blocks = (lengths[first] - 1) // BLOCK
    inputs = np.empty(len(first), dtype=INPUT)
    inputs["hash"], inputs["length"], inputs["blocks"] = units["input"][first], lengths[first] - 1, blocks
    which = np.repeat(first, blocks)
    steps = np.arange(int(blocks.sum())) - np.repeat(np.cumsum(blocks) - blocks, blocks) + 1
    ladder = flat.prefix_hashes(which, steps * BLOCK)
    return units, inputs, ladder


def encode(units: np.ndarray, inputs: np.ndarray, ladder: np.ndarray) -> np.ndarray:
    """The records as one ``uint8`` payload."""
    head = np.asarray([len(units), len(inputs), len(ladder)], dtype="<i8")
    return np.concatenate(
        [head.view(np.uint8), units.view(np.uint8), inputs.view(np.uint8), ladder.astype("<u8").view(np.uint8)]
    )


def decode(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`encode`."""
    payload = np.ascontiguousarray(payload, dtype=np.uint8)
    n, m, k = (int(x) for x in payload[: 8 * _HEADER].view("<i8"))
    at = 8 * _HEADER
    units = payload[at : at + n * UNIT.itemsize].view(UNIT)
    at += n * UNIT.itemsize
    inputs = payload[at : at + m * INPUT.itemsize].view(INPUT)
    at += m * INPUT.itemsize
    return units, inputs, payload[at : at + 8 * k].view("<u8")


class GlobalTable:
    """Every rank's records merged: the canonical unit table (ordered by key) and the distinct inputs.

    Attributes:
        units: ``UNIT [N]`` in canonical order (a unit's index is its id).
        holder_ptr, holders: CSR lists of the ranks holding each unit (ascending).
        inputs: ``INPUT [M]`` ordered by hash; ``ladder_ptr`` / ``ladder`` their prefix hashes; ``unit_input[i]``
            the input of unit ``i``.
    """

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        units = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, UNIT)
        rank = (
            np.concatenate([np.full(len(p[0]), r, dtype=np.int32) for r, p in enumerate(parts)])
            if parts
            else np.empty(0, np.int32)
        )
        order = np.lexsort((rank, units["key"][:, 1], units["key"][:, 0]))
        units, rank = units[order], rank[order]
        repeated = np.zeros(len(units), dtype=bool)  # one rank listing a unit twice holds it once
        repeated[1:] = (units["key"][1:] == units["key"][:-1]).all(axis=1) & (rank[1:] == rank[:-1])
        units, rank = units[~repeated], rank[~repeated]
        new = np.ones(len(units), dtype=bool)
        new[1:] = (units["key"][1:] != units["key"][:-1]).any(axis=1)
        same = ~new
        if same.any() and (units[1:][same[1:]].tobytes() != units[:-1][same[1:]].tobytes()):
            raise HashCollision(
                "two ranks hold different units under one 128-bit key; the run stops here rather than mix their results"
            )
        self.units = units[new]
        self.holder_ptr = np.append(np.flatnonzero(new), len(units)).astype(np.int64)
        self.holders = rank
        inputs = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, INPUT)
        starts_parts, off = [], 0
        for _, part_inputs, part_ladder in parts:
            blocks = part_inputs["blocks"].astype(np.int64)
            starts_parts.append(off + np.cumsum(blocks) - blocks)
            off += len(part_ladder)
        starts = np.concatenate(starts_parts) if parts else np.empty(0, np.int64)
        flat_ladder = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, np.uint64)
        order = np.argsort(inputs["hash"], kind="stable")
        inputs, starts = inputs[order], starts[order]
        first = np.ones(len(inputs), dtype=bool)
        first[1:] = inputs["hash"][1:] != inputs["hash"][:-1]
        dup = np.flatnonzero(~first)
        if len(dup) and (inputs[dup].tobytes() != inputs[dup - 1].tobytes()):
            raise HashCollision("two different model inputs met under one 64-bit input hash")
        self.inputs = inputs[first]
        blocks = self.inputs["blocks"].astype(np.int64)
        self.ladder_ptr = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
        take = np.repeat(starts[first], blocks) + (
            np.arange(int(blocks.sum())) - np.repeat(self.ladder_ptr[:-1], blocks)
        )
        self.ladder = flat_ladder[take]
        self.unit_input = np.searchsorted(self.inputs["hash"], self.units["input"])

    def __len__(self) -> int:
        return len(self.units)

    def ids(self, keys: np.ndarray) -> np.ndarray:
        """Canonical ids of units given by their keys ``uint64 [n, 2]`` (each must be in the table)."""
        table = self.units["key"]
        ids = np.searchsorted(table[:, 0], keys[:, 0], side="left").astype(np.int64)
        for j in np.flatnonzero((ids >= len(table)) | (table[np.minimum(ids, len(table) - 1), 1] != keys[:, 1])):
            i = ids[j]  # equal first halves of two keys: step to the matching second half
            while i < len(table) and table[i, 0] == keys[j, 0] and table[i, 1] != keys[j, 1]:
                i += 1
            if i >= len(table) or (table[i] != keys[j]).any():
                raise KeyError("a unit is not in the global table")
            ids[j] = i
        return ids

    def first_holder(self) -> np.ndarray:
        """Per unit: the lowest rank holding it (the one that sends its tokens)."""
        return self.holders[self.holder_ptr[:-1]]
