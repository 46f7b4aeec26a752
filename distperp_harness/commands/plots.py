"""Figures: the quantization leaderboard (``sweep`` → ``leaderboard.png``) and ``compare --plot``.

Which panels a figure has is decided from the loaded runs alone (:func:`leaderboard_panels`,
:func:`compare_panels`), so tests check the panels against the results without looking at pixels; every drawn
``Axes`` carries its panel name as its ``gid`` and the PNG's ``Description`` lists them. matplotlib is optional (the
``plot`` extra): it is imported here only, lazily, through the Agg canvas (no pyplot, no global backend); without it
:class:`PlotUnavailable` says how to install it.

**Leaderboard** (:func:`plot_leaderboard`; ``(label, Run)`` pairs, rows in leaderboard order):

- ``kl_vs_weight_bytes``: KL per token pooled over all tasks (log scale, ± stderr;
  :func:`~distperp_harness.commands.panels.pooled_kl`) against weight bytes, one point per scheme; the unquantized
  reference as a dotted vertical line at its weight bytes (its KL, 0, is off a log scale); the Pareto front (schemes
  no other scheme beats on both bytes and KL) dashed, its points filled.
- ``delta_ppl``: Δppl % = 100·(exp(``ln_ppl_ratio``) − 1) ± delta-method stderr, for tasks without flips;
  ``flips`` (% of documents whose answer differs from the reference's) and ``delta_acc`` (paired Δ accuracy, points)
  for multiple-choice tasks. One row per scheme, one colour per task.

**Compare** (:func:`plot_compare`): ``kl_divergence`` (log scale), ``top1_agreement``, ``perplexity`` (token
perplexity; word or byte perplexity where a task has no token perplexity) and ``flips``: one row per task, one
colour per run; with per-document samples (``--log_samples``), ``nll_per_document:<task>`` and
``kl_per_document:<task>``. Panels without data are skipped, with the reason.

**No overlapping text.** Row names are tick labels (one row each), series names are in one legend, and the scheme
labels of the scatter are placed by a greedy search over offsets around each point, measured with the renderer's
text extents: a label never covers another label, a marker, an error bar or the reference line, and stays inside the
axes. :func:`text_overlaps` lists overlapping text boxes of a figure (the tests use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distperp_harness.commands.panels import (  # make_panel, Panel: re-exported (the figures' data)
    Panel,
    compare_panels,
    leaderboard_panels,
    make_panel,  # noqa: F401 - re-exported: plots.make_panel builds the panels it draws
    per_document,
    ranked,
    run_labels,
)
from distperp_harness.report.atomic import atomic_path

MARKERS = "osD^vPX<>"
DPI = 110
FONT = 8
DIRECTIONS = ((1, 0), (-1, 0), (1, 1), (-1, 1), (1, -1), (-1, -1), (0, 1), (0, -1))
DISTANCES = (5, 11, 18, 27, 38, 52, 70, 95, 125)  # label offsets from the point, in typographic points


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Drawn:
    """A written figure: its path, the panels drawn (names and titles) and the ones skipped, with why."""

    path: Path
    panels: tuple[str, ...]
    titles: tuple[str, ...]
    skipped: tuple[str, ...]

    def line(self, who: str) -> str:
        text = f"{who}: figure {self.path}: drew {', '.join(self.titles)}"
        return text + (f"; skipped {', '.join(self.skipped)}" if self.skipped else "")


def require_matplotlib() -> None:
    """Import matplotlib's Agg canvas and Figure, or raise :class:`PlotUnavailable` saying how to install it."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401 - imported to fail here, with the fix, when matplotlib is missing
    except ImportError as error:
        raise PlotUnavailable(
            "matplotlib is not installed; pip install 'distperp-harness[plot]' (or matplotlib>=3.7) for figures"
        ) from error


def new_figure(**kwargs: Any):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Data: which panels, with which values (pure)
# ---------------------------------------------------------------------------------------------------------------


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better), sorted by x."""
    front = [
        i for i, (x, y) in enumerate(points) if not any(x2 <= x and y2 <= y and (x2 < x or y2 < y) for x2, y2 in points)
    ]
    return sorted(front, key=lambda i: points[i])


# ---------------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------------


def _styles(series: tuple[str, ...] | list[str]) -> dict[str, tuple[Any, str]]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(series) <= 10 else "tab20"]
    return {s: (cmap(j % cmap.N), MARKERS[(j // cmap.N) % len(MARKERS)]) for j, s in enumerate(series)}


def _legend_handles(styles: dict[str, tuple[Any, str]]) -> list[Any]:
    from matplotlib.lines import Line2D

    return [Line2D([], [], ls="none", marker=m, color=c, label=s) for s, (c, m) in styles.items()]


def _dot_panel(ax, panel: Panel, rows: tuple[str, ...], styles: dict[str, tuple[Any, str]], labels: bool) -> None:
    """One row per ``rows`` item (top to bottom), the series offset within it, x = value ± stderr."""
    n, m = len(rows), max(len(panel.series), 1)
    step = min(0.8 / m, 0.22)
    for j, s in enumerate(panel.series):
        pts = [
            (n - 1 - i - (j - (m - 1) / 2) * step, *panel.values[(r, s)])
            for i, r in enumerate(rows)
            if (r, s) in panel.values
        ]
        if not pts:
            continue
        lo = [0.0 if se is None else (min(se, 0.9 * v) if panel.log else se) for _, v, se in pts]
        hi = [0.0 if se is None else se for _, _, se in pts]
        color, marker = styles[s]
        ax.errorbar(
            [v for _, v, _ in pts],
            [y for y, _, _ in pts],
            xerr=[lo, hi],
            fmt=marker,
            color=color,
            ms=4.5,
            capsize=2,
            lw=1,
            ls="none",
        )
    ax.set_yticks(range(n), rows[::-1] if labels else [""] * n, fontsize=FONT)
    ax.set_ylim(-0.5, n - 0.5)
    for k in range(n - 1):
        ax.axhline(k + 0.5, color="0.9", lw=0.6, zorder=0)
    if panel.zero:
        ax.axvline(0, color="0.5", lw=0.8, zorder=0)
    if panel.log:
        ax.set_xscale("log")
    ax.grid(axis="x", color="0.93")
    ax.tick_params(labelsize=FONT)
    ax.set_title(panel.title, fontsize=FONT + 1)
    ax.set_xlabel(panel.xlabel, fontsize=FONT)
    ax.set_gid(panel.name)


def _box(artist, renderer):
    """Display-space box of a text artist (an annotation's text only, not its leader line)."""
    from matplotlib.text import Annotation, Text

    if isinstance(artist, Annotation):
        artist.get_window_extent(renderer)  # places the text
        return Text.get_window_extent(artist)
    return artist.get_window_extent(renderer)


def _cost(box, taken, inside) -> float:
    from matplotlib.transforms import Bbox

    def area(b) -> float:
        return 0.0 if b is None else b.width * b.height

    outside = area(box) - area(Bbox.intersection(box, inside))
    return 10 * outside + sum(area(Bbox.intersection(box, t)) for t in taken)


def place_labels(ax, points: list[tuple[float, float]], labels: list[str], obstacles: list[Any]) -> list[Any]:
    """Annotate each point with its label at the first offset (nearest first) whose text box stays inside ``ax``
    and meets no obstacle (display-space boxes) and no label placed before; far labels get a leader line.
    Call after the figure's layout is final."""
    renderer = ax.figure.canvas.get_renderer()
    inside, taken, placed = ax.get_window_extent(renderer), list(obstacles), []
    for (x, y), label in zip(points, labels):
        best = None
        for dist in DISTANCES:
            for dx, dy in DIRECTIONS:
                norm = math.hypot(dx, dy)
                ann = ax.annotate(
                    label,
                    (x, y),
                    xytext=(dist * dx / norm, dist * dy / norm),
                    fontsize=FONT,
                    textcoords="offset points",
                    ha=("center", "left", "right")[dx],
                    va=("center", "bottom", "top")[dy],
                )
                cost = _cost(_box(ann, renderer).padded(2), taken, inside)
                ann.remove()
                if best is None or cost < best[0]:
                    best = (cost, dist, dx, dy)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None  # DIRECTIONS is not empty: the loop chose an offset
        _, dist, dx, dy = best
        norm = math.hypot(dx, dy)
        arrow = dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0, shrinkB=4) if dist > 11 else None
        ann = ax.annotate(
            label,
            (x, y),
            xytext=(dist * dx / norm, dist * dy / norm),
            textcoords="offset points",
            fontsize=FONT,
            ha=("center", "left", "right")[dx],
            va=("center", "bottom", "top")[dy],
            arrowprops=arrow,
            annotation_clip=False,
        )
        taken.append(_box(ann, renderer).padded(2))
        placed.append(ann)
    return placed


def _scatter(ax, points, reference: tuple[float, str] | None):
    """KL against weight MB (error bars clipped at a tenth of the value below: a log scale), the Pareto front, the
    reference line. Returns a function of the renderer giving the display-space boxes labels must avoid (markers,
    error bars, the reference line), to call once the layout is final."""
    from matplotlib.lines import Line2D

    xy = [(x, y) for _, x, y, _ in points]
    front = pareto_front(xy)
    lows = [max(y - se, y / 10) if se is not None else y for _, _, y, se in points]
    highs = [y + se if se is not None else y for _, _, y, se in points]
    for i, (_, x, y, se) in enumerate(points):
        ax.errorbar(
            [x],
            [y],
            yerr=None if se is None else [[y - lows[i]], [se]],
            fmt="o",
            ms=6,
            color="C0",
            mfc="C0" if i in front else "white",
            ecolor="0.6",
            elinewidth=1,
            capsize=3,
            zorder=3,
        )
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], "--", color="C1", lw=1.2, zorder=2)
    handles = [
        Line2D([], [], ls="none", marker="o", color="C0", label="on the Pareto front"),
        Line2D([], [], ls="none", marker="o", color="C0", mfc="white", label="dominated"),
        Line2D([], [], ls="--", color="C1", label="Pareto front"),
    ]
    right = max([x for x, _ in xy] + ([reference[0]] if reference else []))
    if reference:
        ax.axvline(reference[0], ls=":", color="0.2", lw=1.2)
        handles.append(
            Line2D(
                [],
                [],
                ls=":",
                color="0.2",
                label=f"unquantized reference ({reference[1]}, {reference[0]:.2f} MB; KL 0)",
            )
        )
    ax.set_yscale("log")
    ax.set_ylim(min(lows) / 3, max(highs) * 3)
    ax.set_xlim(0, right * 1.1)
    ax.grid(color="0.93")
    ax.tick_params(labelsize=FONT)
    ax.set_xlabel("weight bytes (MB)", fontsize=FONT)
    ax.set_ylabel("KL(reference ‖ model), nats / token (log)", fontsize=FONT)
    ax.set_title("quality lost vs memory: KL per token pooled over tasks (± stderr)", fontsize=FONT + 1)
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncols=len(handles),
        fontsize=FONT,
        frameon=False,
    )
    ax.set_gid("kl_vs_weight_bytes")

    def obstacles(renderer) -> list[Any]:
        from matplotlib.transforms import Bbox

        to = ax.transData.transform
        boxes = []
        for (x, y), lo, hi in zip(xy, lows, highs):
            (px, py), (_, plo), (_, phi) = to((x, y)), to((x, lo)), to((x, hi))
            boxes += [Bbox.from_extents(px - 6, py - 6, px + 6, py + 6), Bbox.from_extents(px - 5, plo, px + 5, phi)]
        if reference:
            rx = to((reference[0], 1.0))[0]
            box = ax.get_window_extent(renderer)
            boxes.append(Bbox.from_extents(rx - 2, box.y0, rx + 2, box.y1))
        return boxes

    return obstacles


def save_figure(fig, path: str | Path, names: list[str], titles: list[str], skipped: list[str]) -> Drawn:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temp:  # a figure cut short never stands under its name
        fig.savefig(temp, dpi=DPI, metadata={"Description": "panels: " + ", ".join(names), "Software": "distperp"})
    return Drawn(path, tuple(names), tuple(titles), tuple(skipped))


def leaderboard_figure(runs: list[tuple[str, Any]]):
    """The leaderboard figure (not saved) and its panel names; ``ValueError`` when no run has anything to draw."""
    require_matplotlib()
    points, panels = leaderboard_panels(runs)
    if not points and not panels:
        raise ValueError(
            "nothing to plot: no scheme has weight bytes and a KL divergence (reference=) or a per-task reference entry"
        )
    rows = tuple(label for label, _ in ranked(runs))
    n_series = max((len(p.series) for p in panels), default=1)
    heights = ([4.2] if points else []) + ([1.7 + len(rows) * max(0.3, 0.11 * n_series)] if panels else [])
    width = max(10.0, 3.4 * len(panels))
    fig = new_figure(figsize=(width, sum(heights) + 0.5), layout="constrained")
    spec = fig.add_gridspec(len(heights), max(len(panels), 1), height_ratios=heights)
    obstacles = _scatter(fig.add_subplot(spec[0, :]), points, _reference(runs)) if points else None
    tasks = sorted({s for p in panels for s in p.series})
    styles = _styles(tasks)
    for k, panel in enumerate(panels):
        _dot_panel(fig.add_subplot(spec[len(heights) - 1, k]), panel, rows, styles, labels=k == 0)
    if panels:
        fig.legend(
            handles=_legend_handles(styles),
            loc="outside lower center",
            ncols=min(len(tasks), 4),
            fontsize=FONT,
            title="tasks",
            title_fontsize=FONT,
            frameon=False,
        )
    fig.draw_without_rendering()
    fig.set_layout_engine("none")  # freeze the layout: label placement measures final positions
    if points and obstacles is not None:
        place_labels(
            fig.axes[0], [(x, y) for _, x, y, _ in points], [p[0] for p in points], obstacles(fig.canvas.get_renderer())
        )
    names = (["kl_vs_weight_bytes"] if points else []) + [p.name for p in panels]
    return fig, names


def _reference(runs: list[tuple[str, Any]]) -> tuple[float, str] | None:
    for _, run in runs:
        if run.reference_weight_bytes:
            return run.reference_weight_bytes / 1e6, (run.reference_dtype or "?").removeprefix("torch.")
    return None


def plot_leaderboard(runs: list[tuple[str, Any]], out: str | Path) -> Drawn:
    """Draw and write the leaderboard figure (see the module doc)."""
    fig, names = leaderboard_figure(runs)
    titles = {"kl_vs_weight_bytes": "KL vs weight bytes", "delta_ppl": "Δppl %", "flips": "flips", "delta_acc": "Δacc"}
    skipped = [] if "kl_vs_weight_bytes" in names else ["KL vs weight bytes (no weight bytes or KL)"]
    return save_figure(fig, out, names, [titles[n] for n in names], skipped)


def compare_figure(runs: list[Any]):
    """The ``compare --plot`` figure (not saved), its panel names and the skipped panels."""
    require_matplotlib()
    panels, sampled, skipped = compare_panels(runs)
    if not panels and not sampled:
        raise ValueError(
            "nothing to plot: these results have no perplexity, no reference= comparison and no per-document samples"
        )
    labels = run_labels(runs)
    styles = _styles(labels)
    docs = {t: {j: per_document(r, t) for j, r in enumerate(runs) if t in r.samples} for t in sampled}
    cells: list[tuple[str, Any]] = [(p.name, p) for p in panels]
    for t in sampled:
        cells.append((f"nll_per_document:{t}", t))
        if any(d["kl_per_token"] for d in docs[t].values()):
            cells.append((f"kl_per_document:{t}", t))
    ncols = 1 if len(cells) == 1 else 2
    grid = [cells[i : i + ncols] for i in range(0, len(cells), ncols)]
    heights = [
        max(3.4, 1.6 + max(len(c.rows) * max(0.3, 0.11 * len(c.series)) if isinstance(c, Panel) else 0 for _, c in row))
        for row in grid
    ]
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(figsize=(6.2 * ncols, sum(heights) + 0.6), layout="constrained")
    spec = fig.add_gridspec(len(grid), ncols, height_ratios=heights)
    drawn: set[str] = set()  # the runs with a point or bar somewhere: the legend lists those only
    for i, row in enumerate(grid):
        for k, (name, content) in enumerate(row):
            ax = fig.add_subplot(spec[i, k])
            if isinstance(content, Panel):
                _dot_panel(ax, content, content.rows, styles, labels=True)
                drawn.update(s for r, s in content.values)
                continue
            key = "nll_per_token" if name.startswith("nll") else "kl_per_token"
            shown = [j for j, d in docs[content].items() if d[key]]
            drawn.update(labels[j] for j in shown)
            width = 0.8 / len(shown)
            for slot, j in enumerate(shown):
                values = docs[content][j][key]
                ax.bar(
                    [d + (slot - (len(shown) - 1) / 2) * width for d in range(len(values))],
                    values,
                    width=width,
                    color=styles[labels[j]][0],
                )
            what = "NLL" if key == "nll_per_token" else "KL(reference ‖ model)"
            ax.set_title(f"{content}: {what} per token, by document", fontsize=FONT + 1)
            ax.set_xlabel("document", fontsize=FONT)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # documents are counted, not measured
            ax.set_ylabel("nats / token", fontsize=FONT)
            ax.tick_params(labelsize=FONT)
            ax.set_gid(name)
    shown_runs = {label: style for label, style in styles.items() if label in drawn}
    fig.legend(
        handles=_legend_handles(shown_runs),
        loc="outside lower center",
        ncols=min(len(shown_runs), 3),
        fontsize=FONT,
        title="runs",
        title_fontsize=FONT,
        frameon=False,
    )
    skipped += [f"run {label} (no value in any panel)" for label in labels if label not in drawn]
    return fig, [name for name, _ in cells], skipped


def plot_compare(runs: list[Any], out: str | Path) -> Drawn:
    """Draw and write the ``compare`` figure (see the module doc)."""
    fig, names, skipped = compare_figure(runs)
    short = {
        "kl_divergence": "KL divergence",
        "top1_agreement": "top-1 agreement",
        "perplexity": "perplexity",
        "flips": "flips",
        "nll_per_document": "NLL per document",
        "kl_per_document": "KL per document",
    }
    titles = [short[n.split(":")[0]] + (f" ({n.split(':', 1)[1]})" if ":" in n else "") for n in names]
    return save_figure(fig, out, names, titles, skipped)


def text_overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of visible, non-empty texts of a drawn figure whose boxes overlap: titles, axis labels, tick labels in
    view (row names included), texts and annotations, legend entries; plus any text outside the figure (paired with
    ``"<outside>"``)."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    texts = [t for leg in fig.legends for t in (*leg.get_texts(), leg.get_title())]
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
            texts += [
                t.label1 for t in (*axis.get_major_ticks(), *axis.get_minor_ticks()) if lo <= t.get_loc() <= hi
            ]  # the drawn ones
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    boxes = [(t.get_text(), _box(t, renderer)) for t in texts if t.get_visible() and t.get_text().strip()]
    page = fig.bbox.padded(0.5)
    pairs = [(a, "<outside>") for a, box in boxes if Bbox.union([box, page]).bounds != page.bounds]
    for i, (a, box) in enumerate(boxes):
        pairs += [(a, b) for b, other in boxes[i + 1 :] if box.overlaps(other)]
    return pairs
