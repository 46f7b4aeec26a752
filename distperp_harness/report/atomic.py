"""Files written whole or not at all: a temporary file in the target's folder, ``fsync``, then ``os.replace``.

Every file distperp writes for a user (results, leaderboards, reports, figures, task YAMLs) goes through here, so a
full disk, a lost permission or a crash mid-write never leaves a cut-short file under the final name: the final
name holds either the old content (or nothing) or the whole new content. On any error the temporary file
(``.<name>.<random>.tmp`` beside the target) is removed and the error is re-raised unchanged. A process killed
between the write and the rename leaves only that hidden temporary file.

The new file gets the mode an ordinary ``open(path, "w")`` would give (``0o666`` less the umask), not
``mkstemp``'s ``0o600``. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_MODE = 0o666


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc/self/status``); elsewhere set
    and restored (which another thread creating a file at that instant would see as 0)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sync(handle: IO[Any]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _publish(temp: str, path: Path) -> None:
    os.chmod(temp, _MODE & ~_umask())
    os.replace(temp, path)
    with contextlib.suppress(OSError):  # the rename made durable too, where the filesystem allows it
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def _discard(temp: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temp)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """A handle on a temporary file beside ``path``; when the block ends without error the file is flushed,
    ``fsync``-ed and renamed to ``path``. ``mode`` ``"w"``/``"wb"`` start empty; ``"a"``/``"ab"`` start from a copy of
    ``path``'s current content (if any), so the appended result appears whole. On any error (the block's or the
    writer's) the temporary file is removed and the error re-raised; ``path`` is untouched."""
    if mode not in ("w", "wb", "a", "ab"):
        raise ValueError(f"atomic_open: mode={mode!r} is not valid; allowed: 'w', 'wb', 'a', 'ab'")
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        binary = "b" in mode
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else encoding) as handle:
            if mode.startswith("a") and path.exists():
                with open(path, "rb") as old:
                    data = old.read()
                handle.write(data if binary else data.decode(encoding or "utf-8"))
            yield handle
            _sync(handle)
        _publish(temp, path)
    except BaseException:
        _discard(temp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (see the module docstring)."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` whole or not at all (see the module docstring)."""
    with atomic_open(path, "w", encoding=encoding) as handle:
        handle.write(text)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that choose a format by it, such as matplotlib's
    ``savefig``, choose the same) for a writer that wants a name; when the block ends without error the file is
    ``fsync``-ed and renamed to ``path``. On any error it is removed and the error re-raised."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield Path(temp)
        with open(temp, "rb+") as handle:
            _sync(handle)
        _publish(temp, path)
    except BaseException:
        _discard(temp)
        raise
