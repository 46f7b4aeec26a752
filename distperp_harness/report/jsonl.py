"""Documents of a ``.jsonl`` file: one JSON object per non-blank line, its document in a string field ``text``. One
reader for the tasks that score the user's files and for ``new-task``'s check of them, so both accept and refuse
the same lines with the same words."""

from __future__ import annotations

import json
from typing import Callable

from distperp_harness.errors import InputError


def jsonl_documents(text: str, where: Callable[[int], str]) -> list[tuple[str, int]]:
    """``(document, line number)`` of every non-blank line of ``text``; an :class:`InputError` at the first line that
    is not a JSON object with a string ``text`` (``where(line)`` names the place, e.g. ``"docs/a.jsonl:3"``)."""
    docs = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where(number)} is not valid JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(
                f'{where(number)} has no string field "text"; each line is one document, e.g. {{"text": "..."}}'
            )
        docs.append((record["text"], number))
    return docs
