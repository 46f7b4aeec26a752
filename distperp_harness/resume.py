"""``resume_dir=PATH``: finished batches of the plan, saved as they complete, reused by a rerun.

A batch's file name is a hash of everything that determines its numbers — the scoring configuration (model,
revision, dtype, quantization, reference, library versions, device type) and the exact rows of the batch —
so a rerun with any number of processes or nodes (batches never depend on the world size) finds the batches
that were done and skips them, and the final results are identical bits. Files hold float64 arrays and are
written atomically (temporary file, then ``os.replace``). The folder must be visible to the ranks that
should reuse it (a shared filesystem for several nodes).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from distperp_harness.rows import Row
from distperp_harness.scoring import BatchScores


class BatchStore:
    """Saved batch scores under ``folder``, keyed by ``config`` (a JSON-able dict) and the batch's rows (their
    layout and units: the same units in other rows round differently)."""

    def __init__(self, folder: str | os.PathLike, config: dict) -> None:
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"resume_dir={str(folder)!r} cannot be created: {exc}") from exc
        self._config_key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).digest()
        self.hits = 0
        self.saved = 0

    def _path(self, rows: Sequence[Row]) -> Path:
        digest = hashlib.sha256(self._config_key)
        for row in rows:
            digest.update(row.key())
        return self.folder / f"batch-{digest.hexdigest()[:40]}.npz"

    def load(self, rows: Sequence[Row]) -> BatchScores | None:
        """The saved scores of exactly these rows, or ``None``."""
        path = self._path(rows)
        if not path.exists():
            return None
        n_units = sum(len(r.units) for r in rows)
        try:
            with np.load(path) as data:
                stats = data["stats"]
                kl = [data[f"kl{i}"] for i in range(n_units)] if "kl0" in data else None
        except (OSError, ValueError, KeyError):
            return None  # unreadable or partial: recompute
        if stats.shape[0] != n_units:
            return None
        self.hits += 1
        return BatchScores(stats, kl)

    def save(self, rows: Sequence[Row], scores: BatchScores) -> None:
        """Write atomically: a reader sees the old state or the whole new file."""
        arrays = {"stats": scores.stats}
        if scores.kl is not None:
            arrays.update({f"kl{i}": k for i, k in enumerate(scores.kl)})
        path = self._path(rows)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as handle:
                np.savez(handle, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.saved += 1
