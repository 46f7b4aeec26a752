"""``python -m distperp_harness compare RESULTS.json [...] [--plot out.png]``: runs side by side, leaderboard-style.

A run is one lm-eval results JSON (``results_*.json``; a folder means the newest one under it). The table has one
row per run and task: model, quantization scheme, processes, each perplexity metric with its standard error, KL
divergence, top-1 agreement and answer flips (with a reference: from the task's metrics where it has them, else
from ``config.distperp.reference.tasks``, so every task shows them), scoring throughput, weight bytes and the
fingerprint. The plot reads the per-document samples written next to the results (``--log_samples``): NLL per
token for every document and, with a reference, the mean KL divergence per token, runs side by side; and, where
runs have multiple-choice tasks with a reference, a panel of flips per task, runs side by side.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "kl_divergence",
           "top1_agreement", "flips", "flips_norm")


@dataclass(frozen=True)
class Run:
    """What the table and the plot need from one results JSON."""

    path: Path
    model: str
    scheme: str
    processes: int
    tasks: dict[str, dict[str, Any]]
    tokens_per_second: float | None
    weight_bytes: int | None
    fingerprint: str | None
    samples: dict[str, Path] = field(default_factory=dict)
    reference: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.model} {self.scheme} x{self.processes}"


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: p.stat().st_mtime_ns)
        if not found:
            raise FileNotFoundError(f"no results_*.json under {path}")
        return found[-1]
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such results file")
    return path


def load_run(path: str | Path) -> Run:
    """Read one lm-eval results JSON (or the newest under a folder)."""
    path = _resolve(path)
    data = json.loads(path.read_text())
    config = data.get("config", {})
    info = config.get("distperp") or {}
    options = info.get("options") or {}
    quant = info.get("quantization") or {}
    calls = info.get("calls") or []
    seconds = sum(c.get("total_seconds", 0.0) for c in calls)
    tokens = sum(c.get("scored_tokens", 0) for c in calls)
    stamp = path.stem.removeprefix("results_")
    samples = {task: s for task in data.get("results", {})
               for s in path.parent.glob(f"samples_{task}_{stamp}.jsonl")}
    model = str(options.get("pretrained") or config.get("model_args") or config.get("model", "?"))
    return Run(
        path=path,
        model=Path(model.split(",")[0].removeprefix("pretrained=")).name or model,
        scheme=_scheme(options, config),
        processes=int(info.get("world_size", 1)),
        tasks=data.get("results", {}),
        tokens_per_second=(tokens / seconds) if seconds > 0 else None,
        weight_bytes=quant.get("weight_bytes_after", info.get("weight_bytes")),
        fingerprint=info.get("fingerprint"),
        samples=samples,
        reference=(info.get("reference") or {}).get("tasks") or {},
    )


def value_and_stderr(run: Run, task: str, metric: str) -> tuple[Any, Any]:
    """A metric of one task: lm-eval's result where the task reports it, else the reference entry's."""
    values = run.tasks.get(task, {})
    if f"{metric},none" in values:
        return values[f"{metric},none"], values.get(f"{metric}_stderr,none")
    entry = run.reference.get(task, {})
    return entry.get(metric), entry.get(f"{metric}_stderr")


def _scheme(options: dict[str, Any], config: dict[str, Any]) -> str:
    """``int4:128`` (with the group size where the scheme has one), ``int8``, ``none``; lm-eval's model otherwise."""
    quantize = options.get("quantize")
    if quantize is None:
        return str(config.get("model", "?"))
    return f"{quantize}:{options['group_size']}" if quantize in ("int4", "8da4w") and "group_size" in options \
        else str(quantize)


def _cell(run: Run, task: str, metric: str) -> str:
    value, stderr = value_and_stderr(run, task, metric)
    if value is None or value == "N/A":
        return "–"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(stderr, (int, float)) and math.isfinite(stderr):
        text += f" ± {stderr:.2g}"
    return text


def markdown_table(runs: list[Run]) -> str:
    """One row per (run, task), columns for every metric present in any run."""
    metrics = [m for m in METRICS if any(value_and_stderr(r, t, m)[0] is not None for r in runs
                                         for t in {*r.tasks, *r.reference})]
    head = ["model", "scheme", "procs", "task", *metrics, "tok/s", "weights MB", "fingerprint"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for task in sorted({*run.tasks, *run.reference}):
            row = [run.model, run.scheme, str(run.processes), task, *(_cell(run, task, m) for m in metrics),
                   f"{run.tokens_per_second:.0f}" if run.tokens_per_second else "–",
                   f"{run.weight_bytes / 1e6:.2f}" if run.weight_bytes else "–", run.fingerprint or "–"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def per_document(run: Run, task: str) -> dict[str, list[float]]:
    """Per-document NLL per token (and mean KL per token with a reference), in document order."""
    path = run.samples.get(task)
    if path is None:
        raise FileNotFoundError(f"{run.path}: no samples for {task} (run lm-eval with --log_samples)")
    rows = sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda r: r["doc_id"])
    nll, kl = [], []
    for row in rows:
        ll, n = row["token_perplexity"]
        nll.append(-ll / n if n else float("nan"))
        if "kl_divergence" in row:
            kl_sum, n_kl = row["kl_divergence"]
            kl.append(kl_sum / n_kl if n_kl else float("nan"))
    return {"nll_per_token": nll, "kl_per_token": kl}


def flips_by_task(runs: list[Run]) -> dict[str, list[tuple[float, float | None] | None]]:
    """Per multiple-choice task, each run's ``(flips, stderr)`` (``None`` where the run has no such entry)."""
    tasks = sorted({t for r in runs for t, e in r.reference.items() if "flips" in e})
    return {t: [(r.reference[t]["flips"], r.reference[t].get("flips_stderr")) if "flips" in r.reference.get(t, {})
                else None for r in runs] for t in tasks}


def plot_runs(runs: list[Run], out: str | Path) -> Path:
    """PNG: per task, per-document NLL/token for each run and, where present, KL/token; then flips per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for r in runs for t in r.samples})
    flips = flips_by_task(runs)
    if not tasks and not flips:
        raise ValueError("nothing to plot: no per-document samples next to these results (rerun lm-eval with "
                         "--log_samples) and no multiple-choice task with reference= (no flips)")
    has_kl = any(per_document(r, t)["kl_per_token"] for r in runs for t in tasks if t in r.samples)
    columns = 2 if has_kl else 1
    fig, axes = plt.subplots(len(tasks) + bool(flips), columns, figsize=(12 if has_kl else 7,
                             3.6 * (len(tasks) + bool(flips))), squeeze=False)
    width = 0.8 / len(runs)
    for i, task in enumerate(tasks):
        docs = {j: per_document(run, task) for j, run in enumerate(runs) if task in run.samples}
        with_kl = [j for j in docs if docs[j]["kl_per_token"]]
        for j, d in docs.items():
            xs = [k + (j - (len(runs) - 1) / 2) * width for k in range(len(d["nll_per_token"]))]
            axes[i][0].bar(xs, d["nll_per_token"], width=width, label=runs[j].label)
            if j in with_kl:
                kl_width = 0.8 / len(with_kl)
                slot = with_kl.index(j) - (len(with_kl) - 1) / 2
                axes[i][1].bar([k + slot * kl_width for k in range(len(d["kl_per_token"]))], d["kl_per_token"],
                               width=kl_width, label=runs[j].label)
        axes[i][0].set(title=f"{task}: NLL per token by document", xlabel="document", ylabel="nats / token")
        axes[i][0].legend(fontsize=8)
        if has_kl:
            axes[i][1].set(title=f"{task}: KL(reference || model) per token", xlabel="document",
                           ylabel="nats / token")
            axes[i][1].legend(fontsize=8)
    if flips:
        _plot_flips(axes[len(tasks)][0], runs, flips)
        for ax in axes[len(tasks)][1:]:
            ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_flips(ax, runs: list[Run], flips: dict[str, list]) -> None:
    """Grouped bars: share of documents whose answer differs from the reference's, ± stderr, per task and run."""
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        xs, ys, errs = [], [], []
        for k, values in enumerate(flips.values()):
            if values[j] is not None:
                xs.append(k + (j - (len(runs) - 1) / 2) * width)
                ys.append(values[j][0])
                errs.append(values[j][1] or 0.0)
        if xs:
            ax.bar(xs, ys, width=width, yerr=errs, capsize=2, label=run.label)
    ax.set_xticks(range(len(flips)), list(flips), rotation=20, fontsize=8)
    ax.set(title="answer flips vs reference (share of documents, ± stderr)", ylabel="flips")
    ax.legend(fontsize=8)


def run_compare(paths: list[str], plot: str | None = None) -> int:
    """CLI body: print the table; write the plot when asked."""
    runs = [load_run(p) for p in paths]
    print(markdown_table(runs))
    if plot:
        print(f"plot written to {plot_runs(runs, plot)}")
    return 0
