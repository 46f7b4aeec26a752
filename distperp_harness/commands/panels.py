"""What the figures show, decided from loaded runs alone (no matplotlib): the ``compare --plot`` panels
(:func:`compare_panels`) and the leaderboard's scatter points and panels (:func:`leaderboard_panels`), with the
helpers both read runs through. ``compare``, ``sweep`` and ``plots`` import this module; it imports none of them,
so the three commands form no circle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Panel:
    """One dot panel: ``values[(row, series)] = (value, stderr or None)``; rows and series in drawing order."""

    name: str
    title: str
    xlabel: str
    rows: tuple[str, ...]
    series: tuple[str, ...]
    values: dict[tuple[str, str], tuple[float, float | None]]
    log: bool = False
    zero: bool = False


def make_panel(
    name: str,
    title: str,
    xlabel: str,
    values: dict[tuple[str, str], tuple[float, float | None]],
    rows: list[str],
    series: list[str],
    **kw: Any,
) -> Panel | None:
    """A :class:`Panel` keeping the rows and series (in the order given) that have values; ``None`` without any."""
    if not values:
        return None
    kept_rows = tuple(r for r in rows if any((r, s) in values for s in series))
    kept_series = tuple(s for s in series if any((r, s) in values for r in kept_rows))
    return Panel(name, title, xlabel, kept_rows, kept_series, values, **kw)


PPL_METRICS = ("token_perplexity", "word_perplexity", "byte_perplexity")


def value_and_stderr(run: Any, task: str, metric: str) -> tuple[Any, Any]:
    """A metric of one task: lm-eval's result where the task reports it, else the reference entry's."""
    values = run.tasks.get(task, {})
    if f"{metric},none" in values:
        return values[f"{metric},none"], values.get(f"{metric}_stderr,none")
    entry = run.reference.get(task, {})
    return entry.get(metric), entry.get(f"{metric}_stderr")


def per_document(run: Any, task: str) -> dict[str, list[float]]:
    """Per-document NLL per token (and mean KL per token with a reference), in document order."""
    path = run.samples.get(task)
    if path is None:
        raise FileNotFoundError(f"{run.path}: no samples for {task} (run lm-eval with --log_samples)")
    rows = sorted(
        (json.loads(line) for line in path.read_text().splitlines() if line.strip()), key=lambda r: r["doc_id"]
    )
    nll, kl = [], []
    for row in rows:
        ll, n = row["token_perplexity"]
        nll.append(-ll / n if n else float("nan"))
        if "kl_divergence" in row:
            kl_sum, n_kl = row["kl_divergence"]
            kl.append(kl_sum / n_kl if n_kl else float("nan"))
    return {"nll_per_token": nll, "kl_per_token": kl}


def run_labels(runs: list[Any]) -> list[str]:
    """:attr:`Run.label` of each run, a repeated one numbered (``(2)``, ...) so series stay apart in a figure."""
    seen: dict[str, int] = {}
    out = []
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        out.append(run.label if seen[run.label] == 1 else f"{run.label} ({seen[run.label]})")
    return out


def _times(se: Any, factor: float) -> float | None:
    return se * factor if isinstance(se, (int, float)) and math.isfinite(se) else None


def _spread(values: dict[Any, tuple[float, Any]]) -> bool:
    """Log scale: positive values spanning more than 20×."""
    positive = [v for v, _ in values.values() if v > 0]
    return len(positive) == len(values) > 0 and max(positive) / min(positive) > 20


def compare_panels(runs: list[Any]) -> tuple[list, list[str], list[str]]:
    """What ``compare --plot`` draws (:func:`distperp_harness.commands.plots.plot_compare`).

    Returns:
        The dot panels with data (rows: tasks, series: runs): ``kl_divergence``, ``top1_agreement``, ``perplexity``
        (token perplexity; word or byte where a task has no token perplexity) and ``flips`` (% of documents), KL and
        perplexity on a log scale where they span over 20×; the tasks with per-document samples; the skipped panels,
        each with why.
    """
    labels = run_labels(runs)
    tasks = sorted({t for r in runs for t in (*r.tasks, *r.reference)})
    Values = dict[tuple[str, str], tuple[float, float | None]]
    kl: Values = {}
    top1: Values = {}
    ppl: Values = {}
    flips: Values = {}
    for label, run in zip(labels, runs):
        for task in tasks:
            for name, store, scale in (("kl_divergence", kl, 1), ("top1_agreement", top1, 1), ("flips", flips, 100)):
                value, se = value_and_stderr(run, task, name)
                if isinstance(value, (int, float)) and (name != "kl_divergence" or value > 0):
                    store[(task, label)] = (scale * value, _times(se, scale))
    for task in tasks:  # one perplexity per task: the first metric any run reports
        metric = next(
            (m for m in PPL_METRICS for r in runs if isinstance(value_and_stderr(r, task, m)[0], float)), None
        )
        for label, run in zip(labels, runs):
            value, se = value_and_stderr(run, task, metric) if metric else (None, None)
            if isinstance(value, float) and metric is not None:
                row = task if metric == PPL_METRICS[0] else f"{task} ({metric.split('_')[0]})"
                ppl[(row, label)] = (value, se if isinstance(se, float) else None)
    ppl_rows = sorted({row for row, _ in ppl})
    no_reference = "no reference= in these runs"
    candidates = [
        (
            make_panel(
                "kl_divergence", "KL(reference ‖ model) per token", "nats / token", kl, tasks, labels, log=_spread(kl)
            ),
            "kl_divergence",
            no_reference,
        ),
        (
            make_panel("top1_agreement", "top-1 agreement with the reference", "share of tokens", top1, tasks, labels),
            "top1_agreement",
            no_reference,
        ),
        (
            make_panel(
                "perplexity",
                "perplexity (token unless named)",
                "perplexity (± stderr)",
                ppl,
                ppl_rows,
                labels,
                log=_spread(ppl),
            ),
            "perplexity",
            "no perplexity metric",
        ),
        (
            make_panel("flips", "answer flips vs reference", "% of documents (± stderr)", flips, tasks, labels),
            "flips",
            "no multiple-choice task with reference=",
        ),
    ]
    sampled = sorted({t for r in runs for t in r.samples})
    skipped = [f"{name} ({why})" for panel, name, why in candidates if panel is None]
    if not sampled:
        skipped.append("per-document panels (no samples: run lm-eval with --log_samples)")
    return [p for p, _, _ in candidates if p is not None], sampled, skipped


def pooled_kl(entries: dict[str, dict[str, Any]]) -> float:
    """KL divergence per token over all scored tokens of all tasks: Σ(KLₜ·nₜ) / Σnₜ (ranking key)."""
    tokens = math.fsum(e.get("n_tokens", 0) for e in entries.values() if "kl_divergence" in e)
    if tokens <= 0:
        return math.inf
    return math.fsum(e["kl_divergence"] * e["n_tokens"] for e in entries.values() if "kl_divergence" in e) / tokens


def ranked(runs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(label, Run)`` pairs in leaderboard order: pooled KL, then label."""
    return sorted(runs, key=lambda pair: (pooled_kl(pair[1].reference), pair[0]))


def pooled_kl_stderr(entries: dict[str, dict[str, Any]]) -> float | None:
    """Standard error of :func:`pooled_kl`, tasks taken as independent samples: √Σ(nₜ·seₜ)² / Σnₜ.

    ``None`` where a task with a KL divergence has no standard error (one document) or no task has tokens.
    """
    kl = [e for e in entries.values() if "kl_divergence" in e and e.get("n_tokens", 0) > 0]
    if not kl or any(e.get("kl_divergence_stderr") is None for e in kl):
        return None
    tokens = math.fsum(e["n_tokens"] for e in kl)
    return math.sqrt(math.fsum((e["n_tokens"] * e["kl_divergence_stderr"]) ** 2 for e in kl)) / tokens


def leaderboard_panels(runs: list[tuple[str, Any]]) -> tuple[list[tuple[str, float, float, float | None]], list]:
    """What the leaderboard figure draws (:func:`distperp_harness.commands.plots.plot_leaderboard`), in leaderboard
    order.

    Returns:
        Scatter points ``(label, weight MB, pooled KL, its stderr)`` of the schemes with weight bytes and a KL
        divergence, and the dot panels with data (rows: schemes, series: tasks): ``delta_ppl`` (%, tasks without
        flips), ``flips`` (% of documents) and ``delta_acc`` (points) for multiple-choice tasks.
    """
    runs = ranked(runs)
    points = [
        (label, run.weight_bytes / 1e6, pooled_kl(run.reference), pooled_kl_stderr(run.reference))
        for label, run in runs
        if run.weight_bytes and 0 < pooled_kl(run.reference) < math.inf
    ]
    rows = [label for label, _ in runs]
    tasks = sorted({t for _, run in runs for t in run.reference})
    dppl, flips, dacc = {}, {}, {}
    for label, run in runs:
        for task, e in run.reference.items():
            if "flips" in e:
                flips[(label, task)] = (100 * e["flips"], _scaled(e.get("flips_stderr"), 100))
                if e.get("delta_acc") is not None:
                    dacc[(label, task)] = (100 * e["delta_acc"], _scaled(e.get("delta_acc_stderr"), 100))
            elif e.get("ln_ppl_ratio") is not None:
                ratio, se = e["ln_ppl_ratio"], e.get("ln_ppl_ratio_stderr")
                dppl[(label, task)] = (100 * math.expm1(ratio), _scaled(se, 100 * math.exp(ratio)))
    panels = [
        make_panel("delta_ppl", "Δ perplexity vs reference", "Δppl % (± stderr)", dppl, rows, tasks, zero=True),
        make_panel("flips", "answer flips vs reference", "% of documents (± stderr)", flips, rows, tasks),
        make_panel("delta_acc", "Δ accuracy vs reference", "points (± stderr)", dacc, rows, tasks, zero=True),
    ]
    return points, [p for p in panels if p is not None]


def _scaled(se: float | None, factor: float) -> float | None:
    """``se`` times ``factor`` (None stays None): the leaderboard's stderr scaling."""
    return None if se is None else se * factor
