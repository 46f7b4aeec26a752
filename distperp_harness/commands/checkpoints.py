"""Which checkpoints a series evaluates, in which order, and whether a checkpoint being written is complete (pure:
files only, no model, no process group).

``--checkpoints`` takes a comma list whose items are:

* a path: an HF model folder (``config.json``), a PEFT adapter folder (``adapter_config.json``, applied over
  ``--base``), a ``.gguf`` file; ``delta=PATH`` or ``peft=PATH`` to say what a folder is;
* a glob (``runs/ckpt-*``): its matches;
* a folder whose children are checkpoints (a training run's output dir): every child that is a checkpoint by its
  files (``config.json``, ``adapter_config.json``, ``*.gguf``) or by its name (``checkpoint-1000``, ``step_2000``,
  ``global_step3000``, ``iter-4000``): a child named as a checkpoint but without its files is kept, so that it
  fails to load as a row of the series instead of vanishing from it.

A checkpoint's step is read from its name (the number after ``checkpoint``/``step``/``global_step``/``iter``/
``ckpt``, else the name's last number), else from its ``trainer_state.json`` (``global_step``); the series is sorted
by step, checkpoints without one last in the order given. Labels (the results folder names) are the names, made
unique with the parent folder's name where two checkpoints share one.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from distperp_harness.errors import InputError

STEP_NAME = re.compile(r"(?:global_step|checkpoint|step|iter|ckpt)[-_]?(\d+)", re.IGNORECASE)
LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
MODEL_FILES = ("config.json",)
ADAPTER_FILE = "adapter_config.json"
COMPLETION_MARKERS = (".complete", "COMPLETE", ".done", "DONE", "trainer_state.json")
"""Files a checkpoint's writer leaves last: ``--watch`` takes a checkpoint holding one as complete at once (HF's
Trainer writes ``trainer_state.json`` after the weights); others complete when their files stop changing."""


class Kind(Enum):
    """What a checkpoint is, and so which ``--model_args`` load it."""

    MODEL = "model"
    ADAPTER = "peft"
    DELTA = "delta"
    GGUF = "gguf"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a series: where it is, what it is, its step (``None``: unknown) and its results label."""

    path: Path
    kind: Kind
    step: int | None
    label: str

    def model_args(self, base: str | None) -> dict[str, Any]:
        """The ``--model_args`` keys that load this checkpoint alone (``lm_eval --model distperp`` gives the same
        bits with them); ``base``: the model adapters and delta weights apply to."""
        if self.kind is Kind.MODEL:
            return {"pretrained": str(self.path)}
        if self.kind is Kind.GGUF:
            return {"pretrained": str(self.path.parent), "gguf_file": self.path.name}
        base = base or _adapter_base(self.path)
        if not base:
            raise InputError(
                f"checkpoint {self.path} is a {self.kind.value}= checkpoint but no base model was given. "
                f"Fix: add --base MODEL (the model it applies to)."
            )
        return {"pretrained": base, self.kind.value: str(self.path)}


def _adapter_base(path: Path) -> str | None:
    """An adapter's own ``base_model_name_or_path`` (``adapter_config.json``), if it names one."""
    try:
        return json.loads((path / ADAPTER_FILE).read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError):
        return None


def step_of(path: Path) -> int | None:
    """The step in ``path``'s name, else ``global_step`` of its ``trainer_state.json``, else ``None``."""
    name = path.stem if path.suffix == ".gguf" else path.name
    found = STEP_NAME.search(name) or LAST_NUMBER.search(name)
    if found:
        return int(found.group(1))
    try:
        step = json.loads((path / "trainer_state.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return int(step) if isinstance(step, int) else None


def kind_of(path: Path) -> Kind | None:
    """What ``path`` holds by its files: ``None`` when it is no checkpoint by its files."""
    if path.is_file():
        return Kind.GGUF if path.suffix == ".gguf" else None
    if (path / ADAPTER_FILE).is_file():
        return Kind.ADAPTER
    if any((path / name).is_file() for name in MODEL_FILES):
        return Kind.MODEL
    return None


def _named_as_checkpoint(path: Path) -> bool:
    return path.is_dir() and STEP_NAME.fullmatch(path.name) is not None


def _children(folder: Path) -> list[Path]:
    """The checkpoints in a run's output folder (see the module docstring)."""
    return [
        child
        for child in sorted(folder.iterdir())
        if not child.name.startswith(".") and (kind_of(child) is not None or _named_as_checkpoint(child))
    ]


def _expand(item: str) -> list[tuple[Path, Kind | None]]:
    """One ``--checkpoints`` item → ``(path, kind given)``; ``InputError`` when it names nothing."""
    given: Kind | None = None
    for kind in (Kind.DELTA, Kind.ADAPTER):
        if item.startswith(f"{kind.value}="):
            given, item = kind, item[len(kind.value) + 1 :]
    if glob.has_magic(item):
        matches = [Path(p) for p in sorted(glob.glob(item))]
        if not matches:
            raise InputError(f"--checkpoints item {item!r} matches nothing. Fix: check the pattern, or quote it.")
        return [(p, given) for p in matches if not p.name.startswith(".")]
    path = Path(item)
    if not path.exists():
        raise InputError(
            f"--checkpoints item {item!r}: no such file or folder. Fix: give checkpoint folders, .gguf files, "
            "a glob or a folder of checkpoints."
        )
    if given is None and path.is_dir() and kind_of(path) is None and not _named_as_checkpoint(path):
        children = _children(path)
        if not children:
            raise InputError(
                f"--checkpoints {item!r} is a folder with no checkpoint in it (no child with config.json, "
                "adapter_config.json or a .gguf file, none named checkpoint-N / step_N / global_stepN). Fix: point "
                "at the run's output folder, or list the checkpoints."
            )
        return [(child, None) for child in children]
    return [(path, given)]


def _labels(paths: list[Path]) -> list[str]:
    """Names, made unique with the parent folder's name where two share one (then with the position)."""
    names = [p.stem if p.suffix == ".gguf" else p.name for p in paths]
    labels = [f"{p.parent.name}-{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]
    return [f"{label}-{i}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def discover(spec: str) -> list[Checkpoint]:
    """The checkpoints ``--checkpoints spec`` names (see the module docstring), sorted by step.

    Raises:
        InputError: an item names nothing, or the list is empty.
    """
    found: dict[Path, Kind | None] = {}
    for item in (part.strip() for part in spec.split(",")):
        if item:
            for path, kind in _expand(item):
                found.setdefault(path, kind)
    if not found:
        raise InputError(f"--checkpoints {spec!r} names no checkpoint. Fix: e.g. --checkpoints runs/out/ or a,b,c")
    paths = list(found)
    checkpoints = [
        Checkpoint(path, found[path] or kind_of(path) or Kind.MODEL, step_of(path), label)
        for path, label in zip(paths, _labels(paths))
    ]
    order = {c.path: i for i, c in enumerate(checkpoints)}
    return sorted(checkpoints, key=lambda c: (c.step is None, c.step or 0, order[c.path]))


# ---------------------------------------------------------------------------------------------------------------
# --watch: is a checkpoint being written complete?
# ---------------------------------------------------------------------------------------------------------------

Snapshot = tuple[tuple[str, int, int], ...]
"""``(relative path, size, mtime_ns)`` of every file of a checkpoint, sorted."""


def snapshot(path: Path) -> Snapshot:
    """What a checkpoint's files look like now (empty if it vanished)."""
    try:
        if path.is_file():
            st = path.stat()
            return (("", st.st_size, st.st_mtime_ns),)
        files = []
        for root, _, names in os.walk(path):
            for name in names:
                st = os.stat(os.path.join(root, name))
                files.append((os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns))
        return tuple(sorted(files))
    except OSError:
        return ()


def is_complete(path: Path, previous: Snapshot | None, now: Snapshot) -> bool:
    """Whether a checkpoint may be read: its writer's completion marker is there
    (:data:`COMPLETION_MARKERS`), or it has files and they (names, sizes, times) are the same as at the previous
    poll."""
    if path.is_dir() and any((path / marker).exists() for marker in COMPLETION_MARKERS):
        return True
    return bool(now) and previous == now
