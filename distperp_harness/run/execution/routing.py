"""Moving tokens to the ranks that compute them and results back to the ranks that asked: point to point, unpadded.

Both moves are one all-to-all each (:meth:`~distperp_harness.distributed.collective.Collective.exchange`) whose sizes
every rank derives from the global table and the plan, so nothing but payload travels:

* :func:`move_tokens`: each unit's lowest holding rank sends its int32 tokens to each rank that may compute it (a
  scoring batch's or a generation lane's owner and helper) and does not hold it already. Receivers re-derive the 128-bit
  key of every unit they receive and fail loudly if it differs from the table's (a collision, or a sender with other
  tokens).
* :func:`return_results`: the rank that computed a batch sends each unit's float64 statistics, a check hash of the
  tokens it used and (with a reference) its per-token KL values to every other rank holding the unit; each receiver
  compares the check hash with its own tokens'.

Per rank this is O(own tokens + computed tokens) bytes, plus index arithmetic over the table (a few bytes per unit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distperp_harness.distributed.protocol import Collective
from distperp_harness.planning.records import FlatUnits, GlobalTable, HashCollision
from distperp_harness.planning.requests import Unit


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
        source, k = self._find(uid)
        return source.unit(k)

    def sequence(self, uid: int) -> tuple[int, ...]:
        """Unit ``uid``'s tokens (a generation prompt, which scores nothing, is no :class:`Unit`)."""
        source, k = self._find(uid)
        return source.sequence(k)

    def _find(self, uid: int) -> tuple[FlatUnits, int]:
        try:
            return self._where[int(uid)]
        except KeyError:
            raise RuntimeError(f"internal error: unit {uid} was planned here but its tokens never arrived") from None

    def check_hashes(self, local_checks: np.ndarray) -> dict[int, int]:
        """Unit id -> check hash of its tokens, for every unit here (``local_checks``: the local units', computed
        once)."""
        out = dict(zip(self.local_ids.tolist(), local_checks.tolist()))
        out.update(zip(self.received_ids.tolist(), self.received.check_hashes().tolist()))
        return out


def _by_rank(ids: np.ndarray, ranks: np.ndarray, world_size: int) -> list[np.ndarray]:
    """``ids`` split by ``ranks`` (one array per rank, ids ascending within each)."""
    order = np.lexsort((ids, ranks))
    bounds = np.searchsorted(ranks[order], np.arange(world_size + 1))
    return [ids[order[bounds[r] : bounds[r + 1]]] for r in range(world_size)]


def _holds(table: GlobalTable, units: np.ndarray, ranks: np.ndarray, world_size: int) -> np.ndarray:
    """Whether rank ``ranks[j]`` holds unit ``units[j]``."""
    counts = np.diff(table.holder_ptr)
    held = np.repeat(np.arange(len(table), dtype=np.int64), counts) * world_size + table.holders
    return np.isin(units.astype(np.int64) * world_size + ranks, held)


def token_routes(
    table: GlobalTable, unit_ranks: np.ndarray, rank: int, world_size: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(send, expect)``: the unit ids ``rank`` sends to each rank and receives from each rank (ascending).

    Each unit's lowest holding rank sends it to each rank of ``unit_ranks[unit]`` (``int [units, k]``: the ranks that
    may compute it, e.g. its batch's owner and helper; ``-1`` none; a rank listed twice receives it once) that does
    not hold it.
    """
    n = len(table)
    sender = table.first_holder()
    uid = np.repeat(np.arange(n, dtype=np.int64), unit_ranks.shape[1])
    dest = np.asarray(unit_ranks, dtype=np.int64).reshape(-1)
    keep = dest >= 0
    pair = np.unique(uid[keep] * world_size + dest[keep])
    uid, dest = pair // world_size, pair % world_size
    need = ~_holds(table, uid, dest, world_size)
    uid, dest = uid[need], dest[need]
    out = sender[uid] == rank
    send = _by_rank(uid[out], dest[out], world_size)
    inc = dest == rank
    expect = _by_rank(uid[inc], sender[uid[inc]], world_size)
    return send, expect


def move_tokens(
    collective: Collective, table: GlobalTable, unit_ranks: np.ndarray, local: FlatUnits, local_ids: np.ndarray
) -> Available:
    """Send and receive the tokens of every unit a rank may compute (:func:`token_routes`).

    Args:
        unit_ranks: ``int [units, k]``, the ranks that may compute each unit of the table (for scoring its batch's
            owner and helper, ``batch_ranks[unit_batch]``; ``-1``: none).
        local, local_ids: this rank's distinct units and their canonical ids.
    """
    me, world = collective.rank, collective.world_size
    send, expect = token_routes(table, unit_ranks, me, world)
    position = np.full(len(table), -1, dtype=np.int64)
    position[local_ids] = np.arange(len(local_ids))
    parts = [front_coded(local, position[ids], ids) for ids in send]
    sizes = collective.exchange(
        [np.asarray([len(p)], np.int64) for p in parts], [1] * world, "sizes of the token messages"
    )
    received = collective.exchange(parts, [int(x[0]) for x in sizes], "send tokens to the ranks that compute them")
    got: dict[int, np.ndarray] = {}
    for message in received:
        got.update(_front_decoded(message))
    ids = np.concatenate(expect).astype(np.int64) if expect else np.zeros(0, np.int64)
    ids.sort()
    if sorted(got) != ids.tolist():
        raise RuntimeError(f"internal error: rank {me} received the tokens of other units than the plan says")
    lengths = np.asarray([len(got[i]) for i in ids.tolist()], dtype=np.int64)
    flat = FlatUnits(
        np.concatenate([got[i] for i in ids.tolist()]).astype(np.int32) if len(ids) else np.zeros(0, np.int32),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        table.units["n_score"][ids].astype(np.int32),
    )
    if len(ids) and not np.array_equal(flat.keys(), table.units["key"][ids]):
        bad = int(ids[np.flatnonzero((flat.keys() != table.units["key"][ids]).any(axis=1))[0]])
        raise HashCollision(
            f"rank {me} received tokens for unit {bad} from rank {int(table.first_holder()[bad])} "
            "whose 128-bit key differs from the one in the plan: two different sequences met under "
            "one key"
        )
    return Available(local, local_ids, flat, ids)


def front_coded(local: FlatUnits, positions: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The units at ``positions`` of ``local``, named ``ids``, as the one int32 message :func:`move_tokens` sends: in
    token order, each as ``[id, shared, n, n tokens]``: ``shared`` tokens of the unit before it, then its own ``n``
    (a few-shot block travels once per message, not once per unit). Its length is what a rank receives for those
    units (``benchmarks/scale.py`` counts it); empty ``positions`` give an empty message."""
    seqs = [local.tokens[local.offsets[p] : local.offsets[p + 1]] for p in positions]
    order = sorted(range(len(seqs)), key=lambda k: seqs[k].astype(">i4").tobytes())
    out: list[np.ndarray] = []
    previous = np.zeros(0, np.int32)
    for k in order:
        seq = seqs[k]
        m = min(len(seq), len(previous))
        differ = np.flatnonzero(seq[:m] != previous[:m])
        shared = int(differ[0]) if len(differ) else m
        out += [np.asarray([ids[k], shared, len(seq) - shared], np.int32), seq[shared:]]
        previous = seq
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


def _front_decoded(message: np.ndarray) -> dict[int, np.ndarray]:
    """Inverse of :func:`front_coded`: unit id -> tokens."""
    out: dict[int, np.ndarray] = {}
    previous = np.zeros(0, np.int32)
    at = 0
    while at < len(message):
        uid, shared, n = (int(x) for x in message[at : at + 3])
        seq = np.concatenate([previous[:shared], message[at + 3 : at + 3 + n]])
        out[uid] = seq
        previous = seq
        at += 3 + n
    return out


def result_routes(
    table: GlobalTable, unit_batch: np.ndarray, computer: np.ndarray, rank: int, world_size: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(send, expect)``: the unit ids whose results ``rank`` sends to each rank (it computed them, that rank holds
    them) and receives from each rank (ascending)."""
    counts = np.diff(table.holder_ptr)
    uid = np.repeat(np.arange(len(table), dtype=np.int64), counts)
    holder = table.holders.astype(np.int64)
    source = computer[unit_batch[uid]]
    moving = source != holder
    uid, holder, source = uid[moving], holder[moving], source[moving]
    return (
        _by_rank(uid[source == rank], holder[source == rank], world_size),
        _by_rank(uid[holder == rank], source[holder == rank], world_size),
    )


def return_results(  # noqa: PLR0913 - the plan's arrays the return routes are computed from
    collective: Collective,
    table: GlobalTable,
    unit_batch: np.ndarray,
    computer: np.ndarray,
    computed: dict[int, tuple[np.ndarray, int, np.ndarray | None]],
    local_ids: np.ndarray,
    local_checks: np.ndarray,
    n_columns: int,
    with_kl: bool,
) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
    """Every local unit's ``(statistics float64 [n_columns], KL values or None)``, from whichever rank computed it.

    Args:
        computer: the rank that computed each batch. computed: this rank's results, ``id -> (stats, check, kl)``.
        local_checks: check hashes of this rank's units (aligned with ``local_ids``).
    """
    me, world = collective.rank, collective.world_size
    n_score = table.units["n_score"].astype(np.int64)
    width = n_columns + 1  # statistics and check hash; with KL, then one value per scored token
    send, expect = result_routes(table, unit_batch, computer, me, world)
    parts = []
    for ids in send:
        blocks = []
        for i in ids.tolist():
            stats, check, kl = computed[i]
            blocks += [stats, np.asarray([check], dtype=np.uint64).view(np.float64)]
            if with_kl:
                if kl is None:
                    raise ValueError(f"internal error: unit {i} was scored without KL values, with a reference")
                blocks.append(kl)
        parts.append(np.concatenate(blocks) if blocks else np.zeros(0, np.float64))
    sizes = width + n_score if with_kl else np.full(len(table), width, dtype=np.int64)
    received = collective.exchange(
        parts, [int(sizes[ids].sum()) for ids in expect], "send scores to the ranks that asked"
    )
    checks = dict(zip(local_ids.tolist(), local_checks.tolist()))
    out: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    for i in local_ids.tolist():
        if i in computed:
            stats, _, kl = computed[i]
            out[i] = (stats, kl)
    for s, (ids, values) in enumerate(zip(expect, received)):
        at = 0
        for i in ids.tolist():
            stats = values[at : at + n_columns]
            check = int(values[at + n_columns : at + n_columns + 1].view(np.uint64)[0])
            at += n_columns + 1
            kl = None
            if with_kl:
                kl = values[at : at + n_score[i]]
                at += int(n_score[i])
            if check != checks[i]:
                raise HashCollision(
                    f"rank {s} computed unit {i} from other tokens than rank {me} holds under the "
                    "same 128-bit key; the run stops rather than report mixed results"
                )
            out[i] = (stats, kl)
    return out
