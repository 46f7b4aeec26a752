"""The documents ``distperp new-task --data`` points at, checked when the task is written (not after a model loads).

The files are those the task reads (``tasks/distperp/utils.py``, ``read_local_docs``): ``PATH`` itself when it is a
``.txt`` or ``.jsonl`` file, else every such file under the folder, recursively, hidden entries skipped. Every file
must decode as UTF-8; every non-blank line of a ``.jsonl`` file must be a JSON object with a string field ``text``.
The first bad file is named with its line, in one :class:`~distperp_harness.errors.InputError`.
"""

from __future__ import annotations

from pathlib import Path

from distperp_harness.errors import InputError
from distperp_harness.report.jsonl import jsonl_documents

SUFFIXES = (".txt", ".jsonl")


def data_files(path: Path) -> list[Path]:
    """The ``.txt``/``.jsonl`` files the task reads under ``path`` (an existing file or folder), sorted.

    Raises:
        InputError: ``path`` is another kind of file, or a folder without such files.
    """
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in SUFFIXES
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise InputError(
                f"--data {str(path)!r} holds no .txt or .jsonl files. Fix: give the folder of your documents"
            )
        return files
    if path.suffix in SUFFIXES:
        return [path]
    raise InputError(f"--data {str(path)!r} is neither a folder nor a .txt or .jsonl file. Fix: give one of those")


def check_file(file: Path) -> None:
    """Raise :class:`InputError` naming ``file`` and its first bad line: not UTF-8, or (``.jsonl``) a line that is not
    a JSON object with a string ``text``."""
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise InputError(f"--data: {file} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InputError(
            f"--data: {file}:{line} is not UTF-8 (invalid byte at offset {e.start}); every .txt and .jsonl file "
            "must be UTF-8 text. Fix: convert it, e.g. `iconv -f LATIN1 -t UTF-8`"
        ) from None
    if file.suffix != ".jsonl":
        return
    jsonl_documents(text, lambda number: f"--data: {file}:{number}")


def check_data(path: Path) -> int:
    """Check every file :func:`data_files` finds under ``path`` (see the module docstring); return how many."""
    files = data_files(path)
    for file in files:
        check_file(file)
    return len(files)
