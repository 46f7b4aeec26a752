"""``compare --same-bits A B``: whether two runs' per-document results are the same bits, in one line.

Two sources, both read from the results folders: the fingerprints (``config.distperp.fingerprint``, a hash of every
document's float64 results: equal exactly when the per-document results are) and, where both runs wrote
``--log_samples``, every document's ``filtered_resps`` (the values lm-eval's metrics read) task by task, in document
order, compared exactly (their JSON text: a float is written with every digit of its bits). The line says either
that the runs are the same bits (and what was compared) or where they first differ: the fingerprints, a task or a
document one run lacks, or the first document whose values differ, with both values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distperp_harness.errors import InputError

SHOWN = 60
"""Characters of each differing value the line shows."""


def _rows(path: Path) -> dict[int, Any]:
    """``doc_id -> filtered_resps`` of one samples file."""
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {int(row["doc_id"]): row.get("filtered_resps") for row in rows}


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def first_difference(a: Any, b: Any) -> tuple[str | None, int]:
    """Where the per-document values of runs ``a`` and ``b`` (:class:`~.compare.Run`) first differ (``None``: they do
    not), and how many documents were compared. Only the tasks whose samples both runs wrote are compared; a task
    with samples in one run only is a difference."""
    compared = 0
    for task in sorted({*a.samples, *b.samples}):
        if task not in a.samples or task not in b.samples:
            return f"task {task} has samples in {'A' if task in a.samples else 'B'} only", compared
        rows_a, rows_b = _rows(a.samples[task]), _rows(b.samples[task])
        if sorted(rows_a) != sorted(rows_b):
            only = sorted(set(rows_a) ^ set(rows_b))
            return f"task {task}: documents {len(rows_a)} vs {len(rows_b)} (doc {only[0]} in one run only)", compared
        for doc in sorted(rows_a):
            if json.dumps(rows_a[doc]) != json.dumps(rows_b[doc]):
                values = f"{_short(rows_a[doc])} vs {_short(rows_b[doc])}"
                return f"task {task} doc {doc}: filtered_resps {values}", compared
            compared += 1
    return None, compared


def same_bits(a: Any, b: Any) -> tuple[bool, str]:
    """``(equal, line)`` for runs ``a`` and ``b``: fingerprints first, then the per-document values.

    Raises:
        InputError: neither a fingerprint in both runs nor samples in either (nothing to compare), naming the fix.
    """
    names = f"A={a.path.parent} and B={b.path.parent}"
    fingerprints = bool(a.fingerprint and b.fingerprint)
    if not fingerprints and not (a.samples and b.samples):
        raise InputError(
            f"compare --same-bits: {names} cannot be compared: a distperp fingerprint in both, or samples in both "
            "(--log_samples), is needed; one has neither. Fix: compare two distperp runs, or rerun with --log_samples"
        )
    where, documents = first_difference(a, b) if a.samples and b.samples else (None, 0)
    if fingerprints and a.fingerprint != b.fingerprint:
        where = where or "the per-document values of the samples agree where both wrote them"
        return False, (
            f"compare: not the same bits: {names}: fingerprints {a.fingerprint} and {b.fingerprint} differ; first "
            f"difference: {where}"
        )
    if where is not None:
        return False, f"compare: not the same bits: {names}: first difference: {where}"
    said = [f"fingerprint {a.fingerprint}"] if fingerprints else []
    said += [f"{documents} documents' values in {len(a.samples)} task(s)"] if a.samples and b.samples else []
    return True, f"compare: the same bits: {names}: {' and '.join(said)} equal"
