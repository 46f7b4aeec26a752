"""Where lm-eval writes a run's results, checked before the run and after it: nothing computed is lost silently.

lm-eval writes ``--output_path`` only at the end, and if that fails it logs a warning and exits 0: hours of work
gone, and a script sees success. The start-up hook (:mod:`distperp_harness._hook`) wraps lm-eval's
``EvaluationTracker`` with the two functions here:

* :func:`check_writable` when the tracker is made (before any model loads): the folder the results would go to is
  created if missing and a file is written and removed there; if that fails, one line names the path and the
  reason, and the process exits 1.
* :func:`save_or_fall_back` around its ``save_results_aggregated``: when the results file is not there afterwards,
  they are written to a fallback file instead (the current folder, else ``~/.cache/distperp/unsaved``, else the
  temporary folder), and an :class:`~distperp_harness.errors.InputError` names both paths: the process exits 1.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from distperp_harness.errors import InputError


def results_folder(output_path: str) -> Path:
    """The folder lm-eval writes results under for ``--output_path`` (a ``.json`` path: its folder)."""
    path = Path(output_path).expanduser()
    return path.parent if path.suffix == ".json" else path


def check_writable(output_path: str | None) -> None:
    """Raise :class:`InputError` (same on every rank) unless results can be written under ``output_path``."""
    if not output_path:
        return
    folder = results_folder(output_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".distperp-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(
            f"--output_path {output_path!r}: results could not be written there ({type(exc).__name__}: "
            f"{exc.strerror or exc}); checked before loading the model. Fix: give a folder you can write to",
            same_on_every_rank=True,
        ) from exc


def _fallback_file(name: str) -> Path:
    for folder in (Path.cwd(), Path.home() / ".cache" / "distperp" / "unsaved", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.touch()
            return path
        except OSError:
            continue
    raise OSError("no folder to write the results to (current folder, ~/.cache/distperp/unsaved, the temp folder)")


def save_or_fall_back(save: Callable[..., None], tracker: Any, results: dict, *args: Any, **kwargs: Any) -> None:
    """``save(tracker, results, ...)`` (lm-eval's ``save_results_aggregated``); if no new results file is in the
    results folder afterwards, write ``results`` to a fallback file and raise :class:`InputError` naming it."""
    output_path = getattr(tracker, "output_path", None)
    folder = results_folder(output_path) if output_path else None
    before = set(folder.rglob("*.json")) if folder is not None and folder.is_dir() else set()
    save(tracker, results, *args, **kwargs)
    if folder is None or (folder.is_dir() and set(folder.rglob("*.json")) - before):
        return
    name = f"results_{getattr(tracker, 'date_id', None) or os.getpid()}.json"
    fallback = _fallback_file(name)
    fallback.write_text(json.dumps(results, indent=2, default=str, ensure_ascii=False), encoding="utf-8")
    raise InputError(
        f"--output_path {output_path!r}: lm-eval could not write the results there; they are in {fallback} "
        "instead (samples, if asked for, were not written). Fix: free space or permissions there, or give "
        "another --output_path"
    )
