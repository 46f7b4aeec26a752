"""``distperp babilong-local --data DIR``: lm-eval's own ``babilong`` tasks on a local copy of their dataset, offline.

lm-eval's ``babilong_qa1`` .. ``babilong_qa20`` load ``RMT-team/babilong-1k-samples`` from the hub by name (their
loader fixes the id), so they need the hub or a warm datasets cache. This writes, for each ``qaN`` split found in
``DIR`` (the dataset repository as ``huggingface-cli download RMT-team/babilong-1k-samples --repo-type dataset
--local-dir DIR`` writes it: ``DIR/<length>/qaN-*.parquet``, lengths such as ``4k`` or ``32k``), a task
``babilong_local_qaN`` that includes lm-eval's own ``babilong_qaN.yaml`` by absolute path — its instructions,
few-shot examples, generation arguments and scoring unchanged — and only replaces the dataset loader with
:func:`load_local`, which reads those parquet files; and a group ``babilong_local`` over them. The length comes from
``--metadata '{"max_seq_lengths": "4k"}'`` as with lm-eval's tasks (default ``0k``).

Refused, each in one :class:`~distperp_harness.errors.InputError` before anything is written: a ``DIR`` without
``<length>/qaN-*.parquet`` files, an ``out`` that is a file, existing files unless ``force``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from distperp_harness.errors import InputError, MissingInput
from distperp_harness.report.atomic import atomic_write_text

SPLIT = re.compile(r"^(qa\d+)-\d+-of-\d+\.parquet$")
GROUP = "babilong_local"
DOWNLOAD = "huggingface-cli download RMT-team/babilong-1k-samples --repo-type dataset --local-dir DIR"


def found_splits(data: Path) -> dict[str, list[str]]:
    """``qaN`` -> the lengths (folder names) holding its parquet files under ``data``, in name order."""
    out: dict[str, list[str]] = {}
    for file in sorted(data.glob("*/*.parquet")):
        match = SPLIT.match(file.name)
        if match:
            lengths = out.setdefault(match.group(1), [])
            if file.parent.name not in lengths:
                lengths.append(file.parent.name)
    return dict(sorted(out.items(), key=lambda item: int(item[0][2:])))


def load_local(babilong_path: str | None = None, qa_split: str = "qa1", max_seq_lengths: str = "0k", **_: object):
    """lm-eval's ``custom_dataset`` contract: ``{qa_split: Dataset}`` from ``babilong_path/<max_seq_lengths>/
    <qa_split>-*.parquet`` (the rest of lm-eval's metadata is not used)."""
    import datasets

    if not babilong_path:
        raise InputError(
            f"babilong_local: no babilong_path in the task's metadata. Fix: write the tasks again: {DOWNLOAD}"
        )
    length = max_seq_lengths if isinstance(max_seq_lengths, str) else str(max_seq_lengths)
    files = sorted(str(f) for f in Path(babilong_path).glob(f"{length}/{qa_split}-*.parquet"))
    if not files:
        have = found_splits(Path(babilong_path)).get(qa_split, [])
        raise MissingInput(
            f"babilong_local: no {length}/{qa_split}-*.parquet under {babilong_path} (lengths there for "
            f'{qa_split}: {have or "none"}). Fix: --metadata \'{{"max_seq_lengths": "{have[0] if have else "4k"}"}}\', '
            f"or download that length: {DOWNLOAD}"
        )
    loaded = datasets.load_dataset("parquet", data_files={qa_split: files})
    return {qa_split: loaded[qa_split]}


def _task_yaml(qa: str, data: Path, included: Path) -> str:
    return (
        f"# lm-eval's babilong_{qa} on local parquet files (written by `distperp babilong-local`): lm-eval's task\n"
        f'# by absolute path, only the dataset loader replaced. Length: --metadata \'{{"max_seq_lengths": "4k"}}\'.\n'
        f"include: {json.dumps(str(included))}\n"
        f"task: {GROUP}_{qa}\n"
        f"custom_dataset: !function distperp_harness.commands.babilong.load_local\n"
        f"metadata:\n"
        f"  version: 0.0\n"
        f"  babilong_path: {json.dumps(str(data))}\n"
    )


def write_tasks(data: str, out: str = ".", *, force: bool = False) -> list[Path]:
    """Write ``out/babilong_local_qaN.yaml`` for each split found under ``data`` and ``out/babilong_local.yaml``
    (the group); returns their paths (module docstring)."""
    import lm_eval

    path = Path(data).expanduser().resolve()
    if not path.is_dir():
        raise MissingInput(f"--data {data!r}: no such folder. Fix: {DOWNLOAD}")
    splits = found_splits(path)
    if not splits:
        raise InputError(
            f"--data {data!r} holds no <length>/qaN-*.parquet files (e.g. 4k/qa1-00000-of-00001.parquet). "
            f"Fix: {DOWNLOAD}"
        )
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {out!r} is a file; it must be a folder (made if missing). Fix: give a folder")
    theirs = Path(lm_eval.__file__).parent / "tasks" / "babilong"
    files = {folder / f"{GROUP}_{qa}.yaml": _task_yaml(qa, path, theirs / f"babilong_{qa}.yaml") for qa in splits}
    missing = [qa for qa in splits if not (theirs / f"babilong_{qa}.yaml").exists()]
    if missing:
        raise InputError(f"lm-eval {lm_eval.__version__} has no babilong task for {missing}. Fix: remove those files")
    tasks = "".join(f"  - {GROUP}_{qa}\n" for qa in splits)
    files[folder / f"{GROUP}.yaml"] = (
        f"group: {GROUP}\ntask:\n{tasks}aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\n"
        "metadata:\n  version: 0.0\n"
    )
    existing = [str(f) for f in files if f.exists()]
    if existing and not force:
        raise InputError(f"{existing[0]} already exists. Fix: another --out, or --force to overwrite")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for target, text in files.items():
            atomic_write_text(target, text)
    except OSError as e:
        raise InputError(
            f"cannot write in {folder}: {e.strerror or e}. Fix: give an --out folder you can write to"
        ) from None
    return list(files)
