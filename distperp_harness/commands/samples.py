"""Reading what lm-eval logged (``--log_samples``): per-document responses and a run's results file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def responses_by_doc(samples: Iterable[dict[str, Any]]) -> dict[int, list[Any]]:
    """Document id -> its responses, one per request: the first logged row of each document (lm-eval logs a row per
    filter, and a process's padding copies after the real one) and the first response of each request."""
    out: dict[int, list[Any]] = {}
    for sample in samples:
        out.setdefault(int(sample["doc_id"]), [resp[0] for resp in sample["resps"]])
    return out


def logged_samples(folder: Path, task: str) -> list[dict[str, Any]]:
    """Every row of ``samples_<task>_*.jsonl`` under ``folder`` (one run's output folder)."""
    return [
        json.loads(line)
        for path in sorted(folder.rglob(f"samples_{task}_*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def newest_results(folder: Path) -> dict[str, Any]:
    """The newest ``results_*.json`` under ``folder``.

    Raises:
        FileNotFoundError: none there (the run wrote nothing: its output says why).
    """
    found = list(folder.rglob("results_*.json"))
    if not found:
        raise FileNotFoundError(f"no results_*.json under {folder}: the run wrote no results")
    return json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text(encoding="utf-8"))
