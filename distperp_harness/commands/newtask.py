"""``distperp new-task NAME --data PATH``: a task YAML of your own, in your own folder, that runs there.

A task YAML of distperp's cannot simply be copied out of its folder: its ``include:`` and ``!function utils.*``
resolve against the folder the YAML sits in. The file written here includes the installed
``distperp_local_docs`` task by absolute path (whose functions then resolve in distperp's folder) and sets only
what is yours: the task's name and the documents (a folder of ``.txt`` files, one document each, and/or ``.jsonl``
files, one document per line in field ``text``). Pass its folder to lm-eval with ``--include_path``.
"""

from __future__ import annotations

import re
from pathlib import Path

from distperp_harness.commands.taskdir import tasks_path
from distperp_harness.errors import InputError, MissingInput
from distperp_harness.report.atomic import atomic_write_text

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def task_yaml(name: str, data: Path) -> str:
    """The YAML text of task ``name`` scoring the documents under ``data`` (an absolute path)."""
    template = tasks_path() / "distperp" / "distperp_local_docs.yaml"
    return (
        f"# Perplexity of your own documents with distperp's metrics (token, word and byte perplexity, bits per byte,\n"
        f"# and KL against a reference model), written by `distperp new-task`. Edit docs_path to score other files;\n"
        f"# keep the include (distperp's task, by absolute path: its functions resolve in its own folder).\n"
        f"include: {template}\n"
        f"task: {name}\n"
        f"dataset_kwargs:\n"
        f"  split: test\n"
        f"  docs_path: {data}\n"
        f"metadata:\n"
        f"  version: 1.0\n"
    )


def write_task(name: str, data: str, out: str = ".") -> Path:
    """Write ``out/<name>.yaml`` (see the module docstring) and return its path."""
    if not NAME.match(name) or name.startswith("distperp_"):
        raise InputError(
            f"task name {name!r} is not valid: use letters, digits, '_', '.' or '-', starting with a letter, and "
            "not the distperp_ prefix (distperp's own tasks use it). Fix: e.g. distperp new-task my_docs --data DIR"
        )
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise MissingInput(f"--data {data!r}: no such file or folder. Fix: give the folder of your .txt/.jsonl files")
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}.yaml"
    atomic_write_text(target, task_yaml(name, path))
    return target
