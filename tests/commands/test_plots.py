"""plots: the Pareto front, panels keep only what has data, label placement never covers a label or a marker, and
the overlap check itself finds overlapping texts (renderer boxes, no pixels). The leaderboard and compare figures
are tested from fixed results JSONs in test_sweep.py and test_compare.py."""

import pytest

from distperp_harness.commands import plots

pytest.importorskip("matplotlib")


def test_pareto_front():
    points = [(1, 5), (2, 3), (2, 4), (3, 3), (4, 1), (1, 5)]
    # (2, 4) and (3, 3) are beaten by (2, 3); the two equal points beat each other on neither coordinate
    assert plots.pareto_front(points) == [0, 5, 1, 4]
    assert plots.pareto_front([(1.0, 1.0)]) == [0]


def test_make_panel_keeps_rows_and_series_with_values():
    values = {("b", "t2"): (1.0, None), ("a", "t2"): (2.0, 0.1)}
    panel = plots.make_panel("p", "title", "x", values, ["a", "b", "c"], ["t1", "t2"])
    assert panel.rows == ("a", "b") and panel.series == ("t2",)
    assert plots.make_panel("p", "title", "x", {}, ["a"], ["t1"]) is None


def test_text_overlaps_finds_overlapping_texts():
    fig = plots.new_figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, "first label")
    ax.text(0.52, 0.5, "second label")
    ax.text(0.1, 0.1, "alone")
    ax.text(1.5, 0.5, "far outside the figure")
    fig.canvas.draw()
    assert sorted(plots.text_overlaps(fig)) == [
        ("far outside the figure", "<outside>"),
        ("first label", "second label"),
    ]


def test_labels_of_crowded_points_meet_nothing():
    """Twelve points in three tight clusters (two of them equal): every label inside the axes, on no other label,
    on no marker."""
    from matplotlib.text import Text

    fig = plots.new_figure(figsize=(6, 4))
    ax = fig.add_subplot()
    points = (
        [(1.0 + 0.01 * i, 0.01 * 1.1**i) for i in range(5)]
        + [(2.7, 1e-4), (2.7, 1e-4)]
        + [(2.7 + 0.02 * i, 0.02 * 1.05**i) for i in range(5)]
    )
    ax.plot(*zip(*points), "o", ms=6)
    ax.set(yscale="log", xlim=(0, 3.5), ylim=(3e-5, 0.1))
    fig.canvas.draw()
    to = ax.transData.transform
    from matplotlib.transforms import Bbox

    markers = [Bbox.from_extents(*(to(p) - 6), *(to(p) + 6)) for p in points]
    labels = [f"scheme-{i}:{2 ** (i % 5 + 5)}" for i in range(12)]
    placed = plots.place_labels(ax, points, labels, markers)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(a, renderer) for a in placed]
    assert [a.get_text() for a in placed] == labels
    inside = ax.get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
        assert not any(box.overlaps(other) for other in boxes[i + 1 :])
        assert not any(box.overlaps(m) for m in markers)
    assert plots.text_overlaps(fig) == []


def test_drawn_line_says_what_was_drawn_and_skipped(tmp_path):
    drawn = plots.Drawn(tmp_path / "f.png", ("a", "b"), ("A", "B"), ("c (no data)",))
    assert drawn.line("compare") == f"compare: figure {tmp_path / 'f.png'}: drew A, B; skipped c (no data)"
    assert "\n" not in drawn.line("x")
