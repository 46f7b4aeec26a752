"""A series' record and its table (pure: files and loaded runs, no model).

``<output_path>/series.json`` is the series' record: one :class:`Row` per checkpoint that ran to an end (evaluated,
or failed with its one-line reason), in the order they ended; rank 0 rewrites it whole (atomically) after each
checkpoint, so a stopped series leaves it intact, and a rerun reads it to know what is done. ``series.md`` is drawn
from it and the results folders: one row per checkpoint (step, label, each task metric ± stderr, or the reason it
failed), and with a reference KL, top-1 agreement and flips per task, each metric once (:func:`columns`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any

from distperp_harness.report.atomic import atomic_write_text

STATE_FILE = "series.json"
TABLE_FILE = "series.md"
REFERENCE_METRICS = (("kl_divergence", "KL"), ("top1_agreement", "top-1"), ("flips", "flips"))
"""``config.distperp.reference.tasks`` keys drawn per step, and their short names; a task that reports one of them
as a metric of its own (distperp's perplexity tasks: ``kl_divergence``, ``top1_agreement``) shows it once, as its
metric."""
REFERENCE_TASK_METRICS = frozenset(
    {"kl_divergence", "kl_p99", "kl_max", "top1_agreement", "ref_token_perplexity", "ln_ppl_ratio"}
)
"""Task metrics that compare with the reference (distperp's task template): drawn with the reference's."""


class Group(IntEnum):
    """A column's place in the table and the figure: the task's own metrics, then what compares with the
    reference, then counts (``n_tokens``)."""

    TASK = 0
    REFERENCE = 1
    COUNT = 2


class Status(Enum):
    """How a checkpoint's evaluation ended."""

    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Row:
    """One checkpoint of the series as it ended: ``folder`` holds its results (relative to the output path) when
    ``status`` is done; ``reason`` is the one-line failure when it failed; ``strings_reused`` / ``strings_encoded``:
    the distinct strings its evaluation read back from an earlier checkpoint with the same tokenizer, and encoded."""

    label: str
    path: str
    step: int | None
    status: Status
    reason: str = ""
    seconds: float = 0.0
    strings_reused: int = 0
    strings_encoded: int = 0

    @property
    def folder(self) -> str:
        return self.label

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        return cls(**{**data, "status": Status(data["status"])})


def read_rows(out: Path) -> list[Row]:
    """The rows of ``out/series.json`` (none when there is no such file yet)."""
    path = out / STATE_FILE
    if not path.exists():
        return []
    return [Row.from_dict(r) for r in json.loads(path.read_text(encoding="utf-8"))["rows"]]


def write_rows(out: Path, rows: list[Row]) -> None:
    """Rewrite ``out/series.json`` whole (atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / STATE_FILE, json.dumps({"rows": [r.to_dict() for r in rows]}, indent=1) + "\n")


def with_row(rows: list[Row], row: Row) -> list[Row]:
    """``rows`` with ``row`` replacing the row of the same label (a failed checkpoint run again), else appended."""
    return [r for r in rows if r.label != row.label] + [row]


def sorted_rows(rows: list[Row]) -> list[Row]:
    """Rows by step (rows without one last, in the order they ended)."""
    return sorted(rows, key=lambda r: (r.step is None, r.step or 0))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Column:
    """One quantity of the table and the figure: ``task``, ``metric`` (lm-eval's ``name,filter`` key, or a
    reference key), and whether it comes from the reference comparison."""

    task: str
    metric: str
    reference: bool = False

    @property
    def group(self) -> Group:
        name = self.metric.partition(",")[0]
        if self.reference or name in REFERENCE_TASK_METRICS:
            return Group.REFERENCE
        return Group.COUNT if name.startswith("n_") else Group.TASK

    @property
    def title(self) -> str:
        name, _, kind = self.metric.partition(",")
        short = dict(REFERENCE_METRICS).get(name, name) if self.reference else name
        return f"{self.task} {short}" + (f" ({kind})" if kind and kind != "none" else "")

    def value(self, run: Any) -> tuple[float | None, float | None]:
        """This column's value and standard error in ``run`` (a :class:`~distperp_harness.commands.compare.Run`)."""
        if self.reference:
            entry = run.reference.get(self.task, {})
            return _number(entry.get(self.metric)), _number(entry.get(f"{self.metric}_stderr"))
        values = run.tasks.get(self.task, {})
        name, _, kind = self.metric.partition(",")
        return _number(values.get(self.metric)), _number(values.get(f"{name}_stderr,{kind}"))


def columns(runs: list[Any]) -> list[Column]:
    """Every numeric task metric of the runs (lm-eval's results) and the reference's KL, top-1 agreement and flips
    per task where the runs have them, each once (a task's own ``kl_divergence`` is its KL); the task's own
    metrics first, then those that compare with the reference, then counts (:class:`Group`), each group in
    first-seen order."""
    found: dict[Column, None] = {}
    own: set[tuple[str, str]] = set()
    for run in runs:
        for task, values in sorted(run.tasks.items()):
            for key, value in values.items():
                if "," in key and "_stderr," not in key and _number(value) is not None:
                    found.setdefault(Column(task, key))
                    own.add((task, key.partition(",")[0]))
    for run in runs:
        for task, entry in sorted(run.reference.items()):
            for key, _ in REFERENCE_METRICS:
                if _number(entry.get(key)) is not None and (task, key) not in own:
                    found.setdefault(Column(task, key, reference=True))
    return sorted(found, key=lambda c: c.group)


def _cell(value: float | None, stderr: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.4g}" + (f" ± {stderr:.2g}" if stderr is not None and math.isfinite(stderr) else "")


def series_table(rows: list[Row], runs: dict[str, Any]) -> str:
    """Markdown: one row per checkpoint by step (``runs``: label → loaded run of each done row), a column per
    :func:`columns`; a failed checkpoint's row says why in place of its numbers."""
    cols = columns(list(runs.values()))
    head = ["step", "checkpoint", "status", "seconds", *(c.title for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted_rows(rows):
        run = runs.get(row.label) if row.status is Status.DONE else None
        status = "done" if run is not None else "failed: " + (row.reason or "no results").replace("|", "/")
        cells = [_cell(*c.value(run)) if run is not None else "–" for c in cols]
        step = "–" if row.step is None else str(row.step)
        lines.append("| " + " | ".join([step, row.label, status, f"{row.seconds:.0f}", *cells]) + " |")
    return "\n".join(lines)


def points(rows: list[Row], runs: dict[str, Any], column: Column) -> list[tuple[float, float, float | None]]:
    """``(step, value, stderr)`` of ``column`` for each done checkpoint that has a value, by step; a checkpoint
    without a step is placed at its position in the series."""
    out = []
    for i, row in enumerate(sorted_rows(rows)):
        if row.label in runs:
            value, stderr = column.value(runs[row.label])
            if value is not None and math.isfinite(value):
                out.append((float(i if row.step is None else row.step), value, stderr))
    return out
