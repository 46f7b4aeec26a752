"""Moving tokens to the ranks that compute them and results back to the ranks that asked: point to point, unpadded.

Both moves are one all-to-all each (:meth:`~distperp_harness.collective.Collective.exchange`) whose sizes every rank
derives from the global table and the plan, so nothing but payload travels:

* :func:`move_tokens`: each unit's lowest holding rank sends its int32 tokens to each rank that may compute it (the
  batch's owner and helper) and does not hold it already. Receivers re-derive the 128-bit key of every unit they
  receive and fail loudly if it differs from the table's (a collision, or a sender with other tokens).
* :func:`return_results`: the rank that computed a batch sends each unit's float64 statistics, a check hash of the
  tokens it used and (with a reference) its per-token KL values to every other rank holding the unit; each receiver
  compares the check hash with its own tokens'.

Per rank this is O(own tokens + computed tokens) bytes, plus index arithmetic over the table (a few bytes per unit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distperp_harness.collective import Collective
from distperp_harness.records import FlatUnits, GlobalTable, HashCollision
from distperp_harness.requests import Unit


@dataclass
class Available:
    """The units a rank can compute: its own (``local``) and those it received; ``unit(id)`` builds one."""

    local: FlatUnits
    local_ids: np.ndarray
    received: FlatUnits
    received_ids: np.ndarray

    def __post_init__(self) -> None:
        self._where = {int(i): (self.local, k) for k, i in enumerate(self.local_ids)}
        self._where.update({int(i): (self.received, k) for k, i in enumerate(self.received_ids)})

    def unit(self, uid: int) -> Unit:
        try:
            source, k = self._where[int(uid)]
        except KeyError:
            raise RuntimeError(f"internal error: unit {uid} was planned here but its tokens never arrived") from None
        return source.unit(k)

    def check_hashes(self) -> dict[int, int]:
        out = dict(zip(self.local_ids.tolist(), self.local.check_hashes().tolist()))
        out.update(zip(self.received_ids.tolist(), self.received.check_hashes().tolist()))
        return out


def _by_rank(ids: np.ndarray, ranks: np.ndarray, world_size: int) -> list[np.ndarray]:
    """``ids`` split by ``ranks`` (one array per rank, ids ascending within each)."""
    order = np.lexsort((ids, ranks))
    bounds = np.searchsorted(ranks[order], np.arange(world_size + 1))
    return [ids[order[bounds[r]: bounds[r + 1]]] for r in range(world_size)]


def _holds(table: GlobalTable, units: np.ndarray, ranks: np.ndarray, world_size: int) -> np.ndarray:
    """Whether rank ``ranks[j]`` holds unit ``units[j]``."""
    counts = np.diff(table.holder_ptr)
    held = np.repeat(np.arange(len(table), dtype=np.int64), counts) * world_size + table.holders
    return np.isin(units.astype(np.int64) * world_size + ranks, held)


def move_tokens(collective: Collective, table: GlobalTable, unit_batch: np.ndarray, batch_ranks: np.ndarray,
                local: FlatUnits, local_ids: np.ndarray) -> Available:
    """Send and receive the tokens of every unit a rank may compute.

    Args:
        unit_batch: the batch of every unit of the table. batch_ranks: ``int [batches, k]``, the ranks that may compute
            each batch (owner, then helper; ``-1``: none).
        local, local_ids: this rank's distinct units and their canonical ids.
    """
    me, world = collective.rank, collective.world_size
    n = len(table)
    sender = table.first_holder()
    lengths = table.units["length"].astype(np.int64)
    uid = np.repeat(np.arange(n, dtype=np.int64), batch_ranks.shape[1])
    dest = batch_ranks[unit_batch].reshape(-1)
    keep = dest >= 0
    uid, dest = uid[keep], dest[keep]
    need = ~_holds(table, uid, dest, world)
    uid, dest = uid[need], dest[need]
    uid, dest = np.unique(np.stack([dest, uid], 1), axis=0).T[::-1] if len(uid) else (uid, dest)
    position = np.full(n, -1, dtype=np.int64)
    position[local_ids] = np.arange(len(local_ids))
    parts = []
    for ids in _by_rank(uid[sender[uid] == me], dest[sender[uid] == me], world):
        pos = position[ids]
        parts.append(np.concatenate([local.tokens[local.offsets[p]: local.offsets[p + 1]] for p in pos])
                     if len(pos) else np.zeros(0, np.int32))
    expect = _by_rank(uid[dest == me], sender[uid[dest == me]], world)
    received = collective.exchange(parts, [int(lengths[ids].sum()) for ids in expect],
                                   "send tokens to the ranks that compute them")
    ids = np.concatenate(expect).astype(np.int64)
    flat = FlatUnits(np.concatenate(received).astype(np.int32) if received else np.zeros(0, np.int32),
                     np.concatenate([[0], np.cumsum(lengths[ids])]).astype(np.int64),
                     table.units["n_score"][ids].astype(np.int32))
    if len(ids) and not np.array_equal(flat.keys(), table.units["key"][ids]):
        bad = int(ids[np.flatnonzero((flat.keys() != table.units["key"][ids]).any(axis=1))[0]])
        raise HashCollision(f"rank {me} received tokens for unit {bad} from rank {int(sender[bad])} whose 128-bit key "
                            "differs from the one in the plan: two different sequences met under one key")
    return Available(local, local_ids, flat, ids)


def return_results(collective: Collective, table: GlobalTable, unit_batch: np.ndarray, computer: np.ndarray,
                   computed: dict[int, tuple[np.ndarray, int, np.ndarray | None]], local_ids: np.ndarray,
                   local_checks: np.ndarray, n_columns: int, with_kl: bool
                   ) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
    """Every local unit's ``(statistics float64 [n_columns], KL values or None)``, from whichever rank computed it.

    Args:
        computer: the rank that computed each batch. computed: this rank's results, ``id -> (stats, check, kl)``.
        local_checks: check hashes of this rank's units (aligned with ``local_ids``).
    """
    me, world = collective.rank, collective.world_size
    n_score = table.units["n_score"].astype(np.int64)
    width = n_columns + 1 + (n_score if with_kl else 0)
    counts = np.diff(table.holder_ptr)
    uid = np.repeat(np.arange(len(table), dtype=np.int64), counts)
    holder = table.holders.astype(np.int64)
    source = computer[unit_batch[uid]]
    moving = source != holder
    uid, holder, source = uid[moving], holder[moving], source[moving]
    parts = []
    for ids in _by_rank(uid[source == me], holder[source == me], world):
        blocks = []
        for i in ids.tolist():
            stats, check, kl = computed[i]
            blocks += [stats, np.asarray([check], dtype=np.uint64).view(np.float64)]
            if with_kl:
                blocks.append(kl)
        parts.append(np.concatenate(blocks) if blocks else np.zeros(0, np.float64))
    expect = _by_rank(uid[holder == me], source[holder == me], world)
    sizes = width if with_kl else np.full(len(table), width, dtype=np.int64)
    received = collective.exchange(parts, [int(sizes[ids].sum()) for ids in expect], "send scores to the ranks that asked")
    checks = dict(zip(local_ids.tolist(), local_checks.tolist()))
    out: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    for i in local_ids.tolist():
        if i in computed:
            stats, _, kl = computed[i]
            out[i] = (stats, kl)
    for s, (ids, values) in enumerate(zip(expect, received)):
        at = 0
        for i in ids.tolist():
            stats = values[at: at + n_columns]
            check = int(values[at + n_columns: at + n_columns + 1].view(np.uint64)[0])
            at += n_columns + 1
            kl = None
            if with_kl:
                kl = values[at: at + n_score[i]]
                at += int(n_score[i])
            if check != checks[i]:
                raise HashCollision(f"rank {s} computed unit {i} from other tokens than rank {me} holds under the "
                                    "same 128-bit key; the run stops rather than report mixed results")
            out[i] = (stats, kl)
    return out
