"""The series figure (``series.png``): each task metric against step, the standard error as a band; with a
reference, KL, top-1 agreement, flips and the task's other comparisons against step. One panel per
:class:`~.series_table.Column` that has a value at some step (each metric once), at most :data:`MAX_PANELS`: the
task's metrics, then every metric that compares with the reference (these before the task's metrics when the
panels run short), then counts; each ``Axes`` carries its column title as its ``gid`` and the PNG's
``Description`` lists them (:func:`~.plots.save_figure`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from distperp_harness.commands.plots import Drawn, new_figure, save_figure
from distperp_harness.commands.series_table import Column, Group, Row, columns, points

MAX_PANELS = 18
NCOLS = 3
COLORS = {Group.TASK: "tab:blue", Group.REFERENCE: "tab:red", Group.COUNT: "tab:gray"}
"""A panel's colour by its column's group: the task's metrics, comparisons with the reference, counts."""


def series_panels(rows: list[Row], runs: dict[str, Any]) -> list[tuple[Column, list]]:
    """The panels the figure draws: ``(column, points)`` for each column with a value (see the module docstring);
    pure, so tests check them without pixels."""
    drawn = [(c, p) for c in columns(list(runs.values())) for p in [points(rows, runs, c)] if p]
    compared = [d for d in drawn if d[0].group is Group.REFERENCE][:MAX_PANELS]
    room = MAX_PANELS - len(compared)
    task = [d for d in drawn if d[0].group is Group.TASK][:room]
    counts = [d for d in drawn if d[0].group is Group.COUNT][: room - len(task)]
    return task + compared + counts


def plot_series(rows: list[Row], runs: dict[str, Any], out: str | Path) -> Drawn:
    """Write the figure to ``out``; ``ValueError`` when no checkpoint has a value to draw,
    :class:`~.plots.PlotUnavailable` without matplotlib."""
    panels = series_panels(rows, runs)
    if not panels:
        raise ValueError("no checkpoint of the series has results to draw yet")
    ncols = min(NCOLS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = new_figure(figsize=(4.2 * ncols, 3.0 * nrows + 0.3), layout="constrained")
    for i, (column, pts) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_gid(column.title)
        steps = [p[0] for p in pts]
        values = [p[1] for p in pts]
        color = COLORS[column.group]
        ax.plot(steps, values, marker="o", markersize=3, color=color)
        if all(p[2] is not None for p in pts):
            low = [v - (p[2] or 0.0) for v, p in zip(values, pts)]
            high = [v + (p[2] or 0.0) for v, p in zip(values, pts)]
            ax.fill_between(steps, low, high, alpha=0.25, color=color, linewidth=0)
        ax.set_title(column.title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    titles = [c.title for c, _ in panels]
    return save_figure(fig, out, titles, titles, [])
