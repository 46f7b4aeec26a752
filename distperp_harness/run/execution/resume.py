"""``resume_dir=PATH``: finished batches of the plan, saved as they complete, reused by a rerun.

A batch's file name is a hash of everything that determines its numbers — the scoring configuration (model,
revision, dtype, quantization, reference, library versions, device identity and precision flags) and the exact
rows of the batch (their layout and units: the same units in other rows round differently) —
so a rerun with any number of processes or nodes (batches never depend on the world size) finds the batches
that were done and skips them, and the final results are identical bits. The folder must be visible to the
ranks that should reuse it (a shared filesystem for several nodes).

What long runs meet, and the contract for each:

* **A saved file is never trusted.** It is reused only if it reads back whole (``allow_pickle=False``), has the
  exact layout (float64 ``stats`` ``[units, N_COLUMNS]``; with a reference, one float64 KL value per scored
  token), carries the key of this configuration and these units, matches the sha256 of its arrays stored with
  it, and holds possible values (finite; log-likelihoods <= 0; greedy flags 0/1; token counts equal to the
  units'). Anything else — cut short, garbage, a flipped byte, numbers changed after saving — is recomputed and
  overwritten, never an error, and counted (``recomputed_corrupt``; rank 0 logs the count).
* **Saving is best effort.** Files are written atomically (temporary file, then ``os.replace``). The first
  ``OSError`` (disk full, permission lost, filesystem gone) removes the temporary file and stops saving on that
  process; rank 0 warns once per failing rank with the reason and the path. The evaluation finishes with the
  same results.
* **Preemption and Ctrl-C.** With ``exit_on_sigterm``, SIGTERM (what SLURM sends, and ``accelerate launch``
  forwards) and SIGINT (Ctrl-C, which reaches every process of a launch) end the process at once with exit code
  143 or 130 — no exit barrier, no traceback, no half-written file left behind — and each node's first process
  first says, in one line, how many batches are saved and that the same command resumes the run.
* **Leftovers.** A writer killed between its temporary file and the rename (SIGKILL, a lost node) leaves a
  ``.tmp-*`` file: rank 0 removes those when a run opens the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from distperp_harness.distributed.failfast import hard_exit, leaving
from distperp_harness.distributed.testfaults import inject
from distperp_harness.errors import InputError
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row
from distperp_harness.run.scoring.engine.forward import GREEDY, LL, N_COLUMNS, N_TOKENS, REF_LL, TOP1, BatchScores

# Printed by the "distperp_harness" handler that lm.py sets up; a store logs only when ``is_main`` (rank 0).
log = logging.getLogger(__name__)

FORMAT = 3
"""File layout version. It is part of every file's key, so files of another layout are not found (not damaged). 3: rows
planned from unit records may group units differently, so files of format 2 are recomputed, never read."""

COUNTS = ("reused", "saved", "recomputed_corrupt", "save_failures")


class DamagedFile(ValueError):
    """A saved batch file that must not be reused; the message says why."""


class BatchStore:
    """Saved batch scores under ``folder``, keyed by ``config`` (a JSON-able dict) and the batch's rows.

    Args:
        folder: created if missing (a ``ValueError`` names it when that fails).
        config: everything besides the units that determines the scores.
        with_kl: scores carry per-token KL arrays (a reference model is used).
        is_main: this process is rank 0 (the only one that logs).
        exit_on_sigterm: install the preemption exit described in the module docstring (for a real run; the
            most recent store of the process is the one reported).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        config: dict,
        *,
        with_kl: bool = False,
        is_main: bool = True,
        exit_on_sigterm: bool = False,
    ) -> None:
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.folder, prefix=".write-check-")  # writable: checked at start
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise InputError(
                f"resume_dir={str(folder)!r} cannot be created or written to: {exc}. Fix: give a folder you can "
                "write to",
                same_on_every_rank=True,
            ) from exc
        self.with_kl = with_kl
        self.is_main = is_main
        config_text = json.dumps({"config": config, "format": FORMAT}, sort_keys=True, default=str)
        self._config_key = hashlib.sha256(config_text.encode()).digest()
        self._prefix = f"batch-{self._config_key.hex()[:8]}-"
        self.counts = dict.fromkeys(COUNTS, 0)
        """This process's counts since the store was opened."""
        self.totals = dict(self.counts)
        """Counts summed over ranks at the last :meth:`add_up` (this process's until then)."""
        self.call_reused = 0
        """Batches or lanes read back between the last two :meth:`add_up` (one call's), summed over ranks."""
        self.save_error: str | None = None
        """Why saving stopped on this process (reason and path), or ``None``."""
        self._damage_note: str | None = None
        self._warned_ranks: set[int] = set()
        self._logged_corrupt = 0
        self._in_flight: str | None = None
        if is_main:
            self._remove_leftovers()
        if exit_on_sigterm:
            _exit_on_sigterm(self)

    def _remove_leftovers(self) -> None:
        """Temporary files of writers that were killed (no rank writes before the run's first collective)."""
        with contextlib.suppress(OSError):
            for path in self.folder.glob(".tmp-*"):
                with contextlib.suppress(OSError):
                    path.unlink()

    # ------------------------------------------------------------------------------------------ reading
    def load(self, rows: Sequence[Row]) -> BatchScores | None:
        """The saved scores of exactly these rows' units, or ``None`` (not saved, or damaged: recompute)."""
        key = self._key(rows)
        path = self._path(key)
        units = _units_of(rows)
        try:
            scores = self._read(path, key, units)
        except FileNotFoundError:
            return None
        except Exception as exc:  # the bytes are untrusted: any failure to read them means "recompute"
            self._damaged(path, exc)
            return None
        self.counts["reused"] += 1
        return scores

    def _read(self, path: Path, key: bytes, units: Sequence[Unit]) -> BatchScores:
        expected = {"key", "sha256", "stats"} | ({"kl"} if self.with_kl else set())
        loaded = np.load(path, allow_pickle=False)  # pickled content raises; it is never unpickled
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DamagedFile("not an .npz archive")
        with loaded as data:
            if set(data.files) != expected:
                raise DamagedFile(f"holds arrays {sorted(data.files)}, expected {sorted(expected)}")
            arrays = {name: data[name] for name in expected}
        _check_layout(arrays, units)
        if arrays["key"].tobytes() != key:
            raise DamagedFile("its key belongs to another configuration or batch")
        if arrays["sha256"].tobytes() != _checksum(arrays):
            raise DamagedFile("sha256 mismatch: the numbers changed after saving")
        _check_values(arrays, units)
        kl = None
        if self.with_kl:
            kl = np.split(arrays["kl"], np.cumsum([u.n_score for u in units])[:-1])
        return BatchScores(arrays["stats"], kl)

    # ------------------------------------------------------------------------------------------ writing
    def save(self, rows: Sequence[Row], scores: BatchScores) -> None:
        """Write atomically (a reader sees the old state or the whole new file); never raises ``OSError``.

        The first failure stops saving on this process (see the module docstring).
        """
        if self.save_error is not None:
            return
        key = self._key(rows)
        path = self._path(key)
        arrays: dict[str, np.ndarray] = {
            "key": np.frombuffer(key, dtype=np.uint8),
            "stats": np.asarray(scores.stats, dtype=np.float64),
        }
        if self.with_kl:
            arrays["kl"] = np.concatenate([np.zeros(0), *scores.kl_rows()]).astype(np.float64)
        arrays["sha256"] = np.frombuffer(_checksum(arrays), dtype=np.uint8)

        def write(handle) -> None:
            np.savez(handle, **arrays)  # type: ignore[arg-type]  # numpy's stub: a ** name could be allow_pickle

        self._write_atomic(path, ".npz", "wb", write)

    def _write_atomic(self, path: Path, suffix: str, mode: str, write) -> None:
        """``write(handle)`` into a temporary file, ``fsync``, then ``os.replace`` it to ``path``; an ``OSError`` stops
        saving."""
        try:
            fd, self._in_flight = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=suffix)
            with os.fdopen(fd, mode, encoding="utf-8" if "b" not in mode else None) as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())  # whole on disk before the rename makes it the batch's file
            os.replace(self._in_flight, path)
            self._in_flight = None
        except OSError as exc:
            self._stop_saving(path, exc)
        else:
            self.counts["saved"] += 1
        finally:
            self._discard_in_flight()

    def _lane_path(self, lane_key: bytes) -> tuple[str, Path]:
        key = hashlib.sha256(self._config_key + b"lane" + lane_key).hexdigest()
        return key, self.folder / f"{self._prefix}{key[:40]}.lane.json"

    # ------------------------------------------------------------------------------------------ generations
    def load_lane(self, lane_key: bytes, jobs: int) -> list[str] | None:
        """The saved texts of a generation lane (``lane_key``: everything that determines them, see
        :func:`distperp_harness.run.generation.generate`), or ``None``. Like batches, a file is never trusted: it is
        reused only if it is JSON with this configuration's key, ``jobs`` strings and their sha256; else recomputed
        (counted)."""
        key, path = self._lane_path(lane_key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except Exception as exc:  # untrusted bytes: recompute
            self._damaged(path, exc)
            return None
        texts = data.get("texts") if isinstance(data, dict) else None
        if (
            not isinstance(texts, list)
            or len(texts) != jobs
            or not all(isinstance(t, str) for t in texts)
            or data.get("key") != key
            or data.get("sha256") != _text_sha(texts)
        ):
            self._damaged(path, DamagedFile("not this lane's texts, or they changed after saving"))
            return None
        self.counts["reused"] += 1
        return texts

    def save_lane(self, lane_key: bytes, texts: Sequence[str]) -> None:
        """Write a finished lane's texts atomically; never raises ``OSError`` (as :meth:`save`)."""
        if self.save_error is not None:
            return
        key, path = self._lane_path(lane_key)
        body = json.dumps({"key": key, "texts": list(texts), "sha256": _text_sha(texts)})
        self._write_atomic(path, ".json", "w", lambda handle: handle.write(body))

    def _damaged(self, path: Path, exc: Exception) -> None:
        self.counts["recomputed_corrupt"] += 1
        self._damage_note = f"{path.name}: {type(exc).__name__}: {str(exc)[:160]}"

    def _stop_saving(self, path: Path, exc: OSError) -> None:
        self.counts["save_failures"] += 1
        self.save_error = f"{type(exc).__name__}: {exc} (saving {path})"
        if self.is_main:
            self._warn_save_failure({0: self.save_error})

    def _discard_in_flight(self) -> None:
        tmp, self._in_flight = self._in_flight, None
        if tmp is not None:
            with contextlib.suppress(OSError):  # already gone, or the filesystem is: nothing left to clean
                os.unlink(tmp)

    # ------------------------------------------------------------------------------------------ reporting
    def local_counts(self) -> dict:
        """This process's counts and notes, for :meth:`add_up` on every rank (one all-gather)."""
        note, self._damage_note = self._damage_note, None
        return {**self.counts, "damage": note, "save_error": self.save_error}

    def add_up(self, per_rank: Sequence[dict | None]) -> None:
        """Sum every rank's :meth:`local_counts` (in rank order; ``None`` for a rank without a store) into
        :attr:`totals`. Rank 0 logs newly recomputed files and save failures not reported yet."""
        present = [c for c in per_rank if c is not None]
        reused_before = self.totals["reused"]
        self.totals = {name: sum(int(c[name]) for c in present) for name in COUNTS}
        self.call_reused = self.totals["reused"] - reused_before
        new_corrupt = self.totals["recomputed_corrupt"] - self._logged_corrupt
        self._logged_corrupt = self.totals["recomputed_corrupt"]
        if new_corrupt and self.is_main:
            example = next((c["damage"] for c in present if c["damage"]), "")
            log.warning(
                f"resume_dir: {new_corrupt} saved batch file(s) in {self.folder} were damaged or did not "
                f"verify (e.g. {example}); they were recomputed and overwritten."
            )
        failed = {r: c["save_error"] for r, c in enumerate(per_rank) if c and c["save_error"]}
        new_failures = {r: e for r, e in failed.items() if r not in self._warned_ranks and r != 0}
        self._warned_ranks.update(failed)
        if new_failures and self.is_main:
            self._warn_save_failure(new_failures)

    def _warn_save_failure(self, errors: dict[int, str]) -> None:
        for rank, error in errors.items():
            log.warning(
                f"resume_dir: could not save a finished batch on rank {rank}: {error}. That process "
                "saves nothing more; the evaluation continues and its results are unaffected (a rerun "
                "recomputes the batches that were not saved)."
            )

    def reuse_line(self, what: str, total: int, unit: str) -> str:
        """The line a call logs (rank 0): how many of its ``total`` ``unit`` (batches, lanes) it read back from the
        folder (:attr:`call_reused`, after :meth:`add_up`) and how many it computed."""
        reused = self.call_reused
        return (
            f"resume_dir: {what}: reused {reused} of {total} {unit} saved in {self.folder}, computed "
            f"{total - reused}" + (" (saved there for a rerun)" if self.save_error is None and total > reused else "")
        )

    def report(self) -> dict:
        """``config.distperp.resume`` of the results: the folder and the counts summed over ranks."""
        return {"folder": str(self.folder), **self.totals}

    def saved_batches(self) -> int | None:
        """Files of this configuration in the folder (any run, any rank), or ``None`` if it cannot be listed."""
        try:
            return sum(1 for path in self.folder.glob(f"{self._prefix}*") if path.suffix in (".npz", ".json"))
        except OSError:
            return None

    # ------------------------------------------------------------------------------------------ keys
    def _key(self, rows: Sequence[Row]) -> bytes:
        digest = hashlib.sha256(self._config_key)
        for row in rows:
            digest.update(row.key())
        return digest.digest()

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{self._prefix}{key.hex()[:40]}.npz"


def _text_sha(texts: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()


def _units_of(rows: Sequence[Row]) -> list[Unit]:
    """The units of ``rows`` in score order (the order of ``BatchScores.stats``)."""
    return [unit for row in rows for unit in row.units]


def _checksum(arrays: dict[str, np.ndarray]) -> bytes:
    """sha256 over the key and the score arrays: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in ("key", "stats", "kl"):
        if name in arrays:
            array = np.ascontiguousarray(arrays[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
    return digest.digest()


def _check_layout(arrays: dict[str, np.ndarray], units: Sequence[Unit]) -> None:
    want = {
        "key": (np.uint8, (32,)),
        "sha256": (np.uint8, (32,)),
        "stats": (np.float64, (len(units), N_COLUMNS)),
        "kl": (np.float64, (sum(u.n_score for u in units),)),
    }
    for name, array in arrays.items():
        dtype, shape = want[name]
        if array.dtype != dtype or array.shape != shape:
            raise DamagedFile(f"{name} is {array.dtype}{list(array.shape)}, expected {np.dtype(dtype)}{list(shape)}")


def _check_values(arrays: dict[str, np.ndarray], units: Sequence[Unit]) -> None:
    """Values no scoring can produce (checked after the checksum: another writer's file, or a bug)."""
    stats = arrays["stats"]
    n_score = np.array([u.n_score for u in units], dtype=np.float64)
    problems = {
        "non-finite scores": not np.isfinite(stats).all() or not np.isfinite(arrays.get("kl", 0.0)).all(),
        "a log-likelihood > 0": bool((stats[:, [LL, REF_LL]] > 0).any()),
        "a greedy flag other than 0/1": not np.isin(stats[:, GREEDY], (0.0, 1.0)).all(),
        "token counts that differ from the batch's": not np.array_equal(stats[:, N_TOKENS], n_score),
        "top-1 counts out of range": not (
            np.all(stats[:, TOP1] == np.round(stats[:, TOP1]))
            and np.all((stats[:, TOP1] >= 0) & (stats[:, TOP1] <= n_score))
        ),
    }
    if "kl" not in arrays and (stats[:, [REF_LL, TOP1]] != 0).any():
        problems["reference columns without a reference"] = True
    bad = [what for what, found in problems.items() if found]
    if bad:
        raise DamagedFile("impossible values: " + ", ".join(bad))


# ---------------------------------------------------------------------------------------------- preemption
_ACTIVE: list[BatchStore] = []


def _exit_on_sigterm(store: BatchStore) -> None:
    """Make SIGTERM and SIGINT end this process at once (exit code 143 or 130), each node's first process saying
    how to resume.

    ``os._exit`` skips ``atexit`` on purpose: the process-group exit barrier
    (:func:`distperp_harness.distributed.collective._leave_group`) would wait for peers that are being stopped too. The
    handler runs in the main thread between Python operations: during a forward pass or a sleep at once; in a
    collective when it returns, which it does as soon as a peer has exited (the peers receive SIGTERM too).
    """
    _ACTIVE[:] = [store]
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; the default SIGTERM still stops us
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Python's own: KeyboardInterrupt
        signal.signal(signal.SIGINT, _on_sigterm)


def _on_sigterm(signum: int, frame) -> None:  # signal handler signature
    leaving()  # the peers stop too: none of them may name this rank as lost
    store = _ACTIVE[0] if _ACTIVE else None
    if store is not None:
        store._discard_in_flight()
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # one line per node (a launch's every process stops)
            saved = store.saved_batches()
            name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
            print(  # from a new line: a progress bar may hold the current one (no lock taken in a handler)
                f"\ndistperp: stopped by {name}: {'an unknown number of' if saved is None else saved} finished "
                f"batch(es) of this model configuration are saved in resume_dir={store.folder}. Run the "
                "same command again to resume: saved batches are reused (with any number of processes), "
                "the rest are computed, and the results are identical.",
                file=sys.stderr,
                flush=True,
            )
    hard_exit(128 + signum)


# ---------------------------------------------------------------------------------------------- fault injection
def fault_for_tests(rank: int) -> None:
    """Fault injection for the resume tests, after each scored batch; unset in normal runs.

    ``DISTPERP_TEST_CRASH=<rank>:<batches>`` kills that rank after it has scored that many batches (as a SIGKILL
    would); ``DISTPERP_TEST_HOLD=<rank>:<batches>`` makes it stall there (a long batch, to be preempted).
    """
    inject(
        "batch", rank, {"DISTPERP_TEST_CRASH": lambda _: os._exit(17), "DISTPERP_TEST_HOLD": lambda _: time.sleep(600)}
    )
