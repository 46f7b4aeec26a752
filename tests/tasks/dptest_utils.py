"""Dataset loader for the ``dptest_*`` test tasks: builds a ``datasets.DatasetDict`` from a jsonl file that sits
next to this module, so the tasks work from any current directory (relative ``data_files`` in a task YAML
resolve against the cwd, not the YAML's folder).

Used from the YAMLs as ``custom_dataset: !function dptest_utils.load_jsonl`` with
``dataset_kwargs: {dptest_jsonl: <file name>}``. lm-eval calls it as ``load_jsonl(**metadata, **dataset_kwargs)``,
where ``metadata`` holds the task's ``metadata`` and the ``--model_args`` keys; those are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def load_jsonl(dptest_jsonl: str, **_ignored: Any) -> datasets.DatasetDict:
    """Return ``DatasetDict({"test": Dataset})`` with one row per non-blank line of ``HERE / dptest_jsonl``.

    Built in memory with ``Dataset.from_list`` (no Hugging Face cache, no network).
    """
    path = HERE / dptest_jsonl
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
