"""``python -m distperp_harness compare RESULTS.json [...] [--plot out.png]``: runs side by side, leaderboard-style.

A run is one lm-eval results JSON (``results_*.json``; a folder means the newest one under it). The table has one
row per run and task: model, quantization scheme, processes, each perplexity metric with its standard error, KL
divergence and top-1 agreement (with a reference), scoring throughput, weight bytes and the fingerprint. The plot
reads the per-document samples written next to the results (``--log_samples``): NLL per token for every
document and, with a reference, the mean KL divergence per token, runs side by side.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "kl_divergence",
           "top1_agreement")


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
        scheme=options.get("quantize", config.get("model", "?")),
        processes=int(info.get("world_size", 1)),
        tasks=data.get("results", {}),
        tokens_per_second=(tokens / seconds) if seconds > 0 else None,
        weight_bytes=quant.get("weight_bytes_after", info.get("weight_bytes")),
        fingerprint=info.get("fingerprint"),
        samples=samples,
    )


def _cell(values: dict[str, Any], metric: str) -> str:
    value = values.get(f"{metric},none")
    if value is None or value == "N/A":
        return "–"
    stderr = values.get(f"{metric}_stderr,none")
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(stderr, (int, float)) and math.isfinite(stderr):
        text += f" ± {stderr:.2g}"
    return text


def markdown_table(runs: list[Run]) -> str:
    """One row per (run, task), columns for every metric present in any run."""
    metrics = [m for m in METRICS if any(f"{m},none" in t for r in runs for t in r.tasks.values())]
    head = ["model", "scheme", "procs", "task", *metrics, "tok/s", "weights MB", "fingerprint"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for task, values in sorted(run.tasks.items()):
            row = [run.model, run.scheme, str(run.processes), task, *(_cell(values, m) for m in metrics),
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


def plot_runs(runs: list[Run], out: str | Path) -> Path:
    """PNG: per task, per-document NLL/token for each run and, where present, KL/token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for r in runs for t in r.samples})
    if not tasks:
        raise ValueError("no per-document samples next to these results; rerun lm-eval with --log_samples")
    has_kl = any(per_document(r, t)["kl_per_token"] for r in runs for t in tasks if t in r.samples)
    fig, axes = plt.subplots(len(tasks), 2 if has_kl else 1, figsize=(12 if has_kl else 7, 3.6 * len(tasks)),
                             squeeze=False)
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
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_compare(paths: list[str], plot: str | None = None) -> int:
    """CLI body: print the table; write the plot when asked."""
    runs = [load_run(p) for p in paths]
    print(markdown_table(runs))
    if plot:
        print(f"plot written to {plot_runs(runs, plot)}")
    return 0
