"""Where lm-eval writes a run's results, checked before the run and after it: written whole, or not at all and said.

lm-eval writes ``--output_path`` only at the end, and if that fails it logs a warning and exits 0: hours of work
gone, and a script sees success. Worse, a write cut short (a full disk) leaves a truncated ``results_*.json``
that later readers choke on. The start-up hook (:mod:`distperp_harness._hook`) wraps lm-eval's
``EvaluationTracker`` with the functions here:

* :func:`check_writable` when the tracker is made (before any model loads): the folder the results would go to is
  created if missing and a file is written and removed there; if that fails, one line names the path and the
  reason, and the process exits 1.
* :func:`save_or_fall_back` around its ``save_results_aggregated`` and :func:`save_samples_or_fail` around its
  ``save_results_samples``. Two layers, so that neither lm-eval's code nor ours has to be trusted alone:

  1. *Routed writes.* While lm-eval's save runs, the module it lives in sees a ``Path`` whose ``write_text`` and an
     ``open`` whose ``"w"``/``"a"`` modes go through :mod:`distperp_harness.report.atomic` (temporary file beside
     the target, ``fsync``, rename) for files under the results folder; every other path is untouched. A write that
     fails leaves no file and is recorded (lm-eval itself only logs it).
  2. *Checked result.* Afterwards every ``*.json`` (``*.jsonl`` for samples) that is new or changed under the
     results folder must parse; one that does not (a write this routing did not see, e.g. a future lm-eval that
     writes another way) is removed. Success is: nothing recorded as failed, nothing removed, and at least one
     new file that parses.

  On failure of the results: they are written (whole) to a fallback file instead (the current folder, else
  ``~/.cache/distperp/unsaved``, else the temporary folder), and an :class:`~distperp_harness.errors.InputError`
  names it, the folder and the reason: the process exits 1. On failure of a task's samples (written after the
  results): an ``InputError`` names the task, the reason and the results file that was written; exit 1.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distperp_harness.errors import InputError
from distperp_harness.report.atomic import atomic_open, atomic_write_text


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


Failures = list[tuple[Path, BaseException]]


@contextlib.contextmanager
def _routed_writes(namespace: dict[str, Any], folder: Path, failures: Failures) -> Iterator[None]:
    """While active, the module whose globals are ``namespace`` writes files under ``folder`` atomically: its
    ``Path(...).write_text`` and its ``open(..., "w"/"a")``; each write that fails is appended to ``failures`` (and
    re-raised to the writer). Restores the module's names afterwards."""
    root = folder.resolve()

    def inside(path: Any) -> bool:
        try:
            return Path(path).resolve().is_relative_to(root)
        except (TypeError, OSError):
            return False

    @contextlib.contextmanager
    def recorded(path: Path, handle_cm: Any) -> Iterator[Any]:
        try:
            with handle_cm as handle:
                yield handle
        except Exception as exc:
            failures.append((path, exc))
            raise

    class AtomicPath(type(Path())):  # type: ignore[misc]  # a concrete path class: subclassable on every Python
        def write_text(
            self, data: str, encoding: str | None = None, errors: str | None = None, newline: str | None = None
        ) -> int:
            if not inside(self) or errors is not None or newline is not None:
                return super().write_text(data, encoding, errors, newline)
            with recorded(self, atomic_open(self, "w", encoding=encoding or "utf-8")) as handle:
                handle.write(data)
            return len(data)

    def routed_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode in ("w", "a", "wb", "ab") and not args and set(kwargs) <= {"encoding"} and inside(file):
            return recorded(Path(file), atomic_open(file, mode, encoding=kwargs.get("encoding") or "utf-8"))
        return builtins.open(file, mode, *args, **kwargs)

    missing = object()
    saved = {name: namespace.get(name, missing) for name in ("Path", "open")}
    namespace["Path"], namespace["open"] = AtomicPath, routed_open
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                namespace.pop(name, None)
            else:
                namespace[name] = value


def _snapshot(folder: Path, pattern: str) -> dict[Path, tuple[int, int]]:
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.rglob(pattern):
        with contextlib.suppress(OSError):
            stat = path.stat()
            found[path] = (stat.st_mtime_ns, stat.st_size)
    return found


def _parses(path: Path) -> str | None:
    """``None`` when ``path`` is whole JSON (``.jsonl``: every line), else why not."""
    try:
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
            if line.strip() or path.suffix != ".jsonl":
                json.loads(line)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _new_files(folder: Path, pattern: str, before: dict[Path, tuple[int, int]]) -> tuple[list[Path], list[str]]:
    """The files under ``folder`` matching ``pattern`` that are new or changed since ``before`` and parse; and, for
    each one that does not parse, a note saying which and why (that file is removed: nothing partial is kept)."""
    whole, broken = [], []
    for path, stamp in _snapshot(folder, pattern).items():
        if before.get(path) == stamp:
            continue
        reason = _parses(path)
        if reason is None:
            whole.append(path)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
            broken.append(f"{path} was cut short or damaged ({reason}) and was removed")
    return whole, broken


def _reason(failures: Failures, broken: list[str], what: str) -> str:
    if failures:
        path, exc = failures[0]
        detail = getattr(exc, "strerror", None) or exc
        return f"writing {path} failed: {type(exc).__name__}: {detail}; nothing partial was left there"
    if broken:
        return "; ".join(broken)
    return f"lm-eval wrote no {what} file (see its warning above)"


def _write_fallback(name: str, text: str) -> Path:
    """Write ``text`` whole to ``name`` in the first folder that takes it (the current folder,
    ``~/.cache/distperp/unsaved``, the temporary folder); ``OSError`` naming them all when none does."""
    tried = []
    for folder in (Path.cwd(), Path.home() / ".cache" / "distperp" / "unsaved", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / name, text)
            return folder / name
        except OSError as exc:
            tried.append(f"{folder}: {exc.strerror or exc}")
    raise OSError("no folder took the results: " + "; ".join(tried))


def save_or_fall_back(save: Callable[..., None], tracker: Any, results: dict, *args: Any, **kwargs: Any) -> None:
    """``save(tracker, results, ...)`` (lm-eval's ``save_results_aggregated``) with its writes made atomic; unless a
    whole results file is in the results folder afterwards, write ``results`` to a fallback file and raise
    :class:`InputError` naming it (see the module docstring)."""
    output_path = getattr(tracker, "output_path", None)
    if not output_path:
        save(tracker, results, *args, **kwargs)
        return
    folder = results_folder(output_path)
    before, failures = _snapshot(folder, "*.json"), Failures()
    with _routed_writes(getattr(save, "__globals__", {}), folder, failures):
        save(tracker, results, *args, **kwargs)
    whole, broken = _new_files(folder, "*.json", before)
    if whole and not broken and not failures:
        with contextlib.suppress(AttributeError):  # named by a later samples error
            tracker._distperp_results_file = max(whole, key=lambda p: p.stat().st_mtime_ns)
        return
    reason = _reason(failures, broken, "results")
    name = f"results_{getattr(tracker, 'date_id', None) or os.getpid()}.json"
    try:
        fallback = _write_fallback(name, json.dumps(results, indent=2, default=str, ensure_ascii=False))
    except OSError as exc:
        raise InputError(
            f"--output_path {output_path!r}: lm-eval could not write the results there ({reason}), "
            f"and {exc}. Fix: free space or permissions there, or give another --output_path"
        ) from exc
    raise InputError(
        f"--output_path {output_path!r}: lm-eval could not write the results there ({reason}); "
        f"they are in {fallback} instead (samples, if asked for, were not written). Fix: free space or permissions "
        "there, or give another --output_path"
    )


def save_samples_or_fail(save: Callable[..., None], tracker: Any, task_name: str, *args: Any, **kwargs: Any) -> None:
    """``save(tracker, task_name, samples)`` (lm-eval's ``save_results_samples``) with its writes made atomic;
    unless a whole samples file is in the results folder afterwards, raise :class:`InputError` naming the task, the
    reason and the results file already written (see the module docstring)."""
    output_path = getattr(tracker, "output_path", None)
    if not output_path:
        save(tracker, task_name, *args, **kwargs)
        return
    folder = results_folder(output_path)
    before, failures = _snapshot(folder, "*.jsonl"), Failures()
    with _routed_writes(getattr(save, "__globals__", {}), folder, failures):
        save(tracker, task_name, *args, **kwargs)
    whole, broken = _new_files(folder, "*.jsonl", before)
    if whole and not broken and not failures:
        return
    reason = _reason(failures, broken, "samples")
    results = getattr(tracker, "_distperp_results_file", None)
    written = f"the results are in {results}" if results else "the results were written before them"
    raise InputError(
        f"--output_path {output_path!r}: lm-eval could not write the samples of task {task_name!r} there "
        f"({reason}); {written}, the samples of this "
        "and later tasks are not. Fix: free space or permissions there, and run again (or give another "
        "--output_path)"
    )
