"""``distperp new-task NAME --data PATH``: a task YAML of your own, in your own folder, that runs there.

A task YAML of distperp's cannot simply be copied out of its folder: its ``include:`` and ``!function utils.*``
resolve against the folder the YAML sits in. The file written here includes the installed
``distperp_local_docs`` task by absolute path (whose functions then resolve in distperp's folder) and sets only
what is yours: the task's name and the documents (a folder of ``.txt`` files, one document each, and/or ``.jsonl``
files, one document per line in field ``text``). Pass its folder to lm-eval with ``--include_path``.

Refused, each in one :class:`~distperp_harness.errors.InputError` before anything is written: a name lm-eval (or
distperp) already has (an ``--include_path`` task of that name would silently replace it), an existing
``NAME.yaml`` unless ``force``, an ``out`` that is a file, and documents the run could not read
(:mod:`distperp_harness.commands.datafiles`). The documents' path is the task's ``metadata`` ``docs_path``, so
``--metadata '{"docs_path": OTHER}'`` on the lm-eval command line overrides it (lm-eval merges the command line's
metadata over the YAML's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from distperp_harness.commands.datafiles import check_data
from distperp_harness.commands.taskdir import tasks_path
from distperp_harness.errors import InputError, MissingInput
from distperp_harness.report.atomic import atomic_write_text

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def task_yaml(name: str, data: Path) -> str:
    """The YAML text of task ``name`` scoring the documents under ``data`` (an absolute path)."""
    template = tasks_path() / "distperp" / "distperp_local_docs.yaml"
    return (
        f"# Perplexity of your own documents with distperp's metrics (token, word and byte perplexity, bits per byte,\n"
        f"# and KL against a reference model), written by `distperp new-task`. Edit docs_path to score other files\n"
        f'# (or override it per run: lm_eval ... --metadata \'{{"docs_path": "OTHER"}}\'); keep the include\n'
        f"# (distperp's task, by absolute path: its functions resolve in its own folder).\n"
        f"include: {json.dumps(str(template))}\n"
        f"task: {name}\n"
        f"metadata:\n"
        f"  version: 1.0\n"
        f"  docs_path: {json.dumps(str(data))}\n"
    )


def known_task_names() -> set[str]:
    """Every task, group and tag name lm-eval knows without ``--include_path`` (its own and distperp's folders);
    building lm-eval's index takes seconds."""
    from lm_eval.tasks import TaskManager

    return set(TaskManager().all_tasks)


def write_task(name: str, data: str, out: str = ".", *, force: bool = False) -> Path:
    """Write ``out/<name>.yaml`` (see the module docstring) and return its path.

    Raises:
        InputError: the name is not valid or already lm-eval's, ``out`` is a file or cannot be made, the target
            exists and ``force`` is false, or a data file is not readable as documents.
        MissingInput: ``data`` does not exist.
    """
    if not NAME.match(name) or name.startswith("distperp_"):
        raise InputError(
            f"task name {name!r} is not valid: use letters, digits, '_', '.' or '-', starting with a letter, and "
            "not the distperp_ prefix (distperp's own tasks use it). Fix: e.g. distperp new-task my_docs --data DIR"
        )
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise MissingInput(f"--data {data!r}: no such file or folder. Fix: give the folder of your .txt/.jsonl files")
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {out!r} is a file; it must be a folder (made if missing). Fix: give a folder")
    target = folder / f"{name}.yaml"
    if target.exists() and not force:
        raise InputError(f"{target} already exists. Fix: another name or --out, or --force to overwrite it")
    check_data(path)
    if name in known_task_names():
        raise InputError(
            f"task name {name!r} is already one of lm-eval's tasks, groups or tags: a task of yours under that name "
            f"would silently replace it. Fix: pick another name, e.g. distperp new-task my_{name} --data {data}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, task_yaml(name, path))
    except OSError as e:
        raise InputError(
            f"cannot write {target}: {e.strerror or e}. Fix: give an --out folder you can write to"
        ) from None
    return target
