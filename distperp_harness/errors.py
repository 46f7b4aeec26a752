"""Errors a user fixes by changing what they gave, and how the command line shows them.

:class:`InputError` is a ``ValueError`` whose message names the value given, what is allowed and the fix. Library
callers (``lm_eval.simple_evaluate``) get it as any exception. From the command line, where nothing catches it,
:func:`install_excepthook` prints it as one line on stderr, ``distperp: error: <message>``, and the process exits
with code 1, on every rank of a launch; an error every rank meets alike (one that follows from the command line
or that the ranks agreed on) is printed once per launch, by rank 0, the others silent; an error one rank alone
meets is printed by that rank, named (``distperp: error (rank R): ...``).
``DISTPERP_TRACEBACK=1`` or lm-eval's ``--verbosity DEBUG`` brings the traceback back. lm-eval's own "Tasks not
found" error keeps its traceback and gains a line that says how to fix it. Ctrl-C is one line too (per node), no
traceback (with ``resume_dir`` the store's signal handler says what is saved instead,
:mod:`distperp_harness.run.execution.resume`).

Standard library only: the start-up hook installs the excepthook before lm-eval runs a task.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

TRACEBACK_ENV = "DISTPERP_TRACEBACK"
TASKS_HINT = (
    "distperp: hint: lm-eval knows the tasks of its own folder, distperp's (distperp_wikitext2, "
    "distperp_wikitext103, distperp_local_docs, ...) and those under --include_path; for a task of your "
    "own pass --include_path FOLDER (the folder of its YAML file); `lm-eval ls tasks` lists every name."
)


class InputError(ValueError):
    """A value the user gave cannot work: the message says what was given, what is allowed and how to fix it.

    ``same_on_every_rank``: every rank of a launch raises it alike (it follows from the command line, or the ranks
    agreed on it), so only rank 0 prints it."""

    def __init__(self, message: str, *, same_on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class OptionError(InputError):
    """A ``--model_args`` value (or another argument of the command line) that cannot work. Every rank parses the
    same command line, so rank 0 alone prints it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, same_on_every_rank=True)


class MissingInput(InputError, FileNotFoundError):
    """A file or folder the user named does not exist (also a ``FileNotFoundError``)."""


def wants_traceback() -> bool:
    """``DISTPERP_TRACEBACK`` set to anything but ``0``, or lm-eval's logger at DEBUG."""
    import logging

    if os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
        return True
    return logging.getLogger("lm_eval").getEffectiveLevel() <= logging.DEBUG


def one_line(error: InputError) -> str | None:
    """The line this rank prints for ``error``: an error every rank meets alike once per launch, by rank 0 (``None``
    elsewhere); an error of this rank's own naming it (``error (rank R)``) when the launch has several ranks."""
    rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    if error.same_on_every_rank and rank != 0:
        return None  # rank 0 says it for the launch
    where = f" (rank {rank})" if world > 1 and not error.same_on_every_rank else ""
    message = " ".join(str(error).split("\n"))
    return f"distperp: error{where}: {message}"


INTERRUPTED = (
    "distperp: stopped by Ctrl-C (SIGINT); nothing of this run is kept. Fix: resume_dir=FOLDER in --model_args "
    "keeps finished batches, and the same command then resumes from them."
)


def close_progress_bars() -> None:
    """End every open tqdm bar (its line), so that a message printed next starts on a line of its own."""
    module = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(module, "tqdm", None), "_instances", None) or ()):
        with contextlib.suppress(Exception):  # a bar half torn down: the message matters more
            bar.close()


def _is_tasks_not_found(value: BaseException) -> bool:
    return isinstance(value, ValueError) and str(value).startswith("Tasks not found")


def distperp_task_names() -> list[str]:
    """The names of distperp's shipped tasks: its task folder's YAML files (in a checkout or installed)."""
    package = Path(__file__).resolve().parent
    for folder in (package.parent / "tasks" / "distperp", package / "tasks" / "distperp"):
        if folder.is_dir():
            return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))
    return []


def did_you_mean(message: str) -> list[str]:
    """``distperp: did you mean NAME?`` lines for the names of lm-eval's "Tasks not found: a, b" that are close to
    one of distperp's tasks."""
    import difflib

    missing = message.removeprefix("Tasks not found:").strip().split(", ")
    ours = distperp_task_names()
    lines = []
    for name in missing:
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.75)
        if close:
            lines.append(f"distperp: did you mean {close[0]!r} (for {name!r})?")
    return lines


def install_excepthook() -> None:
    """Show uncaught :class:`InputError` as one line (see the module docstring). Idempotent; a hook installed
    later that wraps this one (the fail-fast channel's) must call it for the printing."""
    if getattr(sys.excepthook, "_distperp_input", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if issubclass(kind, KeyboardInterrupt) and not wants_traceback():  # Python still exits as for SIGINT
            if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
                close_progress_bars()
                print(INTERRUPTED, file=sys.stderr, flush=True)
            return
        if isinstance(value, InputError) and not wants_traceback():
            line = one_line(value)
            if line is not None:
                print(line, file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)
        if _is_tasks_not_found(value):
            for line in did_you_mean(str(value)):
                print(line, file=sys.stderr, flush=True)
            print(TASKS_HINT, file=sys.stderr, flush=True)

    hook._distperp_input = True  # type: ignore[attr-defined]
    sys.excepthook = hook
