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

``--watch`` reads a checkpoint once its writer is done with it (:func:`has_marker`, or files unchanged over the
settle time: :mod:`~.series_decide`) and its weight files are whole (:func:`not_whole`: headers and sizes agree with
the index).
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
"""Files a checkpoint's writer leaves last: ``--watch`` takes a checkpoint holding one as written at once (HF's
Trainer writes ``trainer_state.json`` after the weights); others once their files stop changing (the settle time).
Either way its weight files must be whole (:func:`not_whole`)."""
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".incomplete", ".lock")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SHARD = re.compile(r"-(\d+)-of-(\d+)\.(safetensors|bin)$")


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


def being_written(name: str) -> bool:
    """A name a writer gives a file or folder before its final rename (``.x``, ``tmp-checkpoint-500``,
    ``model.safetensors.tmp``, ``*.part``, ``*.incomplete``)."""
    return name.startswith((".", "tmp-", "tmp_")) or name.endswith(PARTIAL_SUFFIXES)


def _children(folder: Path) -> list[Path]:
    """The checkpoints in a run's output folder (see the module docstring); a child still named as being written
    (HF's Trainer writes ``tmp-checkpoint-N`` and renames it) is not one yet."""
    return [
        child
        for child in sorted(folder.iterdir())
        if not being_written(child.name) and (kind_of(child) is not None or _named_as_checkpoint(child))
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


def has_marker(path: Path) -> bool:
    """Whether the checkpoint's writer left one of :data:`COMPLETION_MARKERS`."""
    return path.is_dir() and any((path / marker).exists() for marker in COMPLETION_MARKERS)


def not_whole(path: Path) -> str | None:
    """Why the files of checkpoint ``path`` (a folder or a ``.gguf`` file) are not whole yet, or ``None`` when they
    are: a file still named as being written (:func:`being_written`), no weight file, a safetensors file shorter
    than its header says, shards (``-0000k-of-0000N``) without their index or without all N of them, an index that
    names a missing file or whose ``total_size`` is more than its files hold, a GGUF file that ``gguf`` cannot read
    whole. Only reads headers. A file that is damaged at rest reads as not whole too: the watch names it when it
    stops (a run of ``series`` without ``--watch`` loads it, and the load says what is wrong)."""
    if path.is_file():
        return _gguf_not_whole(path) if path.suffix == ".gguf" else None
    try:
        files = {p.name: p for p in path.iterdir() if p.is_file()}
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    partial = sorted(n for n in files if being_written(n) and n not in COMPLETION_MARKERS)
    if partial:
        return f"{partial[0]} is still being written (named as a temporary file)"
    weights = sorted(n for n in files if n.endswith(WEIGHT_SUFFIXES))
    if not weights:
        return "no weight file yet (*.safetensors, *.bin, *.pt, *.gguf)"
    for name in weights:
        why = _safetensors_not_whole(files[name]) if name.endswith(".safetensors") else None
        why = why or (_gguf_not_whole(files[name]) if name.endswith(".gguf") else None)
        if why:
            return why
    return _shards_not_whole(files)


def _safetensors_layout(file: Path) -> tuple[int, int, int] | None:
    """``(where the data starts, where the header says it ends, the file's size)`` of a safetensors file; ``None``
    when its header is not safetensors' (then the load says what is wrong)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return 8, 8, size  # not even the header's length yet
        start = 8 + int.from_bytes(head, "little")
        if start > 8 + (1 << 28):  # no header is that long: not a safetensors file
            return None
        if start > size:
            return start, start, size  # the header itself not whole yet
        try:
            header = json.loads(handle.read(start - 8))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return None
    return start, start + max(ends, default=0), size


def _safetensors_not_whole(file: Path) -> str | None:
    layout = _safetensors_layout(file)
    if layout is not None and layout[2] < layout[1]:
        return f"{file.name} holds {layout[2]:,} of the {layout[1]:,} bytes its header says"
    return None


def _gguf_not_whole(file: Path) -> str | None:
    try:
        import gguf
    except ImportError:  # the load needs it anyway and says so
        return None
    try:
        gguf.GGUFReader(file)
    except Exception as error:  # any reading error of a cut-short file: ValueError, IndexError, ...
        return f"{file.name} cannot be read whole yet ({type(error).__name__}: {error})"
    return None


def _shards_not_whole(files: dict[str, Path]) -> str | None:
    """Shards and their indexes (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``)."""
    indexes = {n: p for n, p in files.items() if n.endswith(".index.json")}
    shards = {n: (m.group(2), m.group(3)) for n in files for m in [SHARD.search(n)] if m}
    for name, (count, kind) in shards.items():
        present = list(shards.values()).count((count, kind))
        if present < int(count):
            return f"{present} of the {int(count)} shards named like {name} are there"
        if not any(i.endswith(f".{kind}.index.json") for i in indexes):
            return f"{name} is a shard, but no *.{kind}.index.json is there yet"
    for name, path in indexes.items():
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            named = sorted(set(index["weight_map"].values()))
            total = (index.get("metadata") or {}).get("total_size")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{name} is not whole JSON yet"
        missing = [n for n in named if n not in files]
        if missing:
            return f"{name} names {missing[0]}, which is not there yet"
        layouts = [_safetensors_layout(files[n]) for n in named if n.endswith(".safetensors")]
        read = [layout for layout in layouts if layout is not None]
        if isinstance(total, int) and read and len(read) == len(layouts):
            data = sum(end - start for start, end, _ in read)
            if data < total:
                return f"{name} says total_size {total:,}, its files hold {data:,} bytes of tensors"
    return None
