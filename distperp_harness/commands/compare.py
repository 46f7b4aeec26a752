"""``python -m distperp_harness compare RESULTS.json [...] [--plot out.png]``: runs side by side, leaderboard-style.

A run is one lm-eval results JSON (``results_*.json``; a folder means the newest one under it). The table has one
row per run and task: model, quantization scheme, processes, each perplexity metric with its standard error, KL
divergence, top-1 agreement and answer flips (with a reference: from the task's metrics where it has them, else
from ``config.distperp.reference.tasks``, so every task shows them), scoring throughput, weight bytes and the
fingerprint. ``--plot`` draws the panels that have data (:func:`distperp_harness.commands.plots.plot_compare`): per
task, KL divergence, top-1 agreement, perplexity and answer flips, runs side by side; with the per-document samples
written next to the results (``--log_samples``), NLL per token (and KL per token) for every document.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distperp_harness.commands.panels import (  # re-exported: what callers read runs through
    PPL_METRICS,  # noqa: F401 - re-exported
    compare_panels,  # noqa: F401 - re-exported
    per_document,  # noqa: F401 - re-exported
    run_labels,  # noqa: F401 - re-exported
    value_and_stderr,
)
from distperp_harness.errors import InputError, MissingInput

METRICS = (
    "token_perplexity",
    "word_perplexity",
    "byte_perplexity",
    "bits_per_byte",
    "kl_divergence",
    "top1_agreement",
    "flips",
    "flips_norm",
)


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
    reference_weight_bytes: int | None = None
    reference_dtype: str | None = None
    documents: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    limit: float | None = None

    @property
    def label(self) -> str:
        return f"{self.model} {self.scheme} x{self.processes}"


def results_files(path: str | Path) -> list[Path]:
    """The results JSON ``path`` names, or every ``results_*.json`` under the folder ``path``, oldest first.

    Raises:
        MissingInput: no such file or folder, or a folder without results (the message says which and the fix); a
            ``FileNotFoundError`` and an :class:`InputError` (one ``distperp: error`` line from the command line).
    """
    path = Path(path)
    fix = "Fix: give a results_*.json file or a folder lm-eval wrote with --output_path"
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: p.stat().st_mtime_ns)
        if not found:
            raise MissingInput(f"{path}: no results_*.json under it (lm-eval writes them under --output_path). {fix}")
        return found
    if not path.exists():
        raise MissingInput(f"{path}: no such results file or folder. {fix}")
    return [path]


def _resolve(path: str | Path) -> Path:
    return results_files(path)[-1]


def _model_name(options: dict[str, Any], config: dict[str, Any]) -> str:
    """The model's name (the last part of its path or hub id): distperp's ``pretrained`` option, else lm-eval's
    ``model_args`` (a dict, or a ``k=v,...`` string)."""
    args = config.get("model_args")
    if isinstance(args, str):
        args = dict(part.split("=", 1) for part in args.split(",") if "=" in part)
    source = options.get("pretrained") or (args or {}).get("pretrained") or config.get("model", "?")
    return Path(str(source).rstrip("/")).name or str(source)


def read_results(path: Path) -> dict[str, Any]:
    """The JSON object in the results file ``path``.

    Raises:
        InputError: the file cannot be read, is not JSON (cut short by a full disk, say) or not a JSON object; the
            message names the file, what is wrong (``JSONDecodeError at line L col C``) and the fix.
    """
    fix = "Fix: rerun the evaluation that wrote it, or leave this file out (a folder compares every results_*.json)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{path}: not a results file (JSONDecodeError at line {exc.lineno} col {exc.colno}: {exc.msg}; "
            f"{path.stat().st_size} bytes: cut short or not lm-eval's results JSON). {fix}"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a results file (cannot be read: {type(exc).__name__}: {exc}). {fix}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a results file (a JSON {type(data).__name__}, not an object). {fix}")
    return data


def load_run(path: str | Path) -> Run:
    """Read one lm-eval results JSON (or the newest under a folder); :class:`InputError` naming a file that is not
    one (see :func:`read_results`)."""
    path = _resolve(path)
    data = read_results(path)
    config = data.get("config", {})
    info = config.get("distperp") or {}
    options = info.get("options") or {}
    quant = info.get("quantization") or {}
    calls = info.get("calls") or []
    seconds = sum(c.get("total_seconds", 0.0) for c in calls)
    tokens = sum(c.get("scored_tokens", 0) for c in calls)
    stamp = path.stem.removeprefix("results_")
    samples = {task: s for task in data.get("results", {}) for s in path.parent.glob(f"samples_{task}_{stamp}.jsonl")}
    return Run(
        path=path,
        model=_model_name(options, config),
        scheme=_scheme(options, config),
        processes=int(info.get("world_size", 1)),
        tasks=data.get("results", {}),
        tokens_per_second=(tokens / seconds) if seconds > 0 else None,
        weight_bytes=quant.get("weight_bytes_after", info.get("weight_bytes")),
        fingerprint=info.get("fingerprint"),
        samples=samples,
        reference=(info.get("reference") or {}).get("tasks") or {},
        reference_weight_bytes=(info.get("reference") or {}).get("weight_bytes"),
        reference_dtype=(info.get("reference") or {}).get("dtype"),
        documents={
            task: (_count(n.get("effective")), _count(n.get("original")))
            for task, n in (data.get("n-samples") or {}).items()
            if isinstance(n, dict)
        },
        limit=config.get("limit") if isinstance(config.get("limit"), (int, float)) else None,
    )


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def documents_cell(run: Run, task: str) -> str:
    """``effective/original`` documents of ``task`` (lm-eval's ``n-samples``), with the run's ``--limit`` when it
    had one: ``4/62 (limit 4)``; ``–`` when the results do not say."""
    effective, original = run.documents.get(task, (None, None))
    if effective is None:
        return "–"
    text = f"{effective}/{original}" if original is not None else str(effective)
    return text + (f" (limit {run.limit:g})" if run.limit is not None else "")


def _scheme(options: dict[str, Any], config: dict[str, Any]) -> str:
    """``int4:128`` (with the group size where the scheme has one), ``int8``, ``none``; lm-eval's model otherwise."""
    quantize = options.get("quantize")
    if quantize is None:
        return str(config.get("model", "?"))
    return (
        f"{quantize}:{options['group_size']}"
        if quantize in ("int4", "8da4w") and "group_size" in options
        else str(quantize)
    )


def _cell(run: Run, task: str, metric: str) -> str:
    value, stderr = value_and_stderr(run, task, metric)
    if value is None or value == "N/A":
        return "–"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(stderr, (int, float)) and math.isfinite(stderr):
        text += f" ± {stderr:.2g}"
    return text


def markdown_table(runs: list[Run]) -> str:
    """One row per (run, task): the documents evaluated (:func:`documents_cell`), a column for every metric present in
    any run, throughput, weights and the fingerprint."""
    metrics = [
        m
        for m in METRICS
        if any(value_and_stderr(r, t, m)[0] is not None for r in runs for t in {*r.tasks, *r.reference})
    ]
    head = ["model", "scheme", "procs", "task", "docs", *metrics, "tok/s", "weights MB", "fingerprint"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for task in sorted({*run.tasks, *run.reference}):
            row = [
                run.model,
                run.scheme,
                str(run.processes),
                task,
                documents_cell(run, task),
                *(_cell(run, task, m) for m in metrics),
                f"{run.tokens_per_second:.0f}" if run.tokens_per_second else "–",
                f"{run.weight_bytes / 1e6:.2f}" if run.weight_bytes else "–",
                run.fingerprint or "–",
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_runs(runs: list[Run], out: str | Path) -> Path:
    """PNG of the panels that have data (see :func:`distperp_harness.commands.plots.plot_compare`); returns its path."""
    from distperp_harness.commands.plots import plot_compare

    return plot_compare(runs, out).path


def run_compare(paths: list[str], plot: str | None = None, same_bits: list[str] | None = None) -> int:
    """CLI body: print the table of every results file the paths name (a folder: all of them, oldest first); write
    the plot when asked, and say in one line what it drew; with ``same_bits`` (two paths), one line saying whether
    those two runs are the same bits (:func:`~.samebits.same_bits`). The exit code (:mod:`~.exitcodes`): 0, or 3
    when the figure could not be drawn or the two runs differ; a missing path or a file that is not a results file
    raises :class:`InputError` (one ``distperp: error`` line from the command line, exit 1)."""
    from distperp_harness.commands.exitcodes import ExitCode
    from distperp_harness.commands.samebits import same_bits as compare_bits

    files = [f for p in paths for f in results_files(p)]
    pair = [load_run(p) for p in same_bits or ()]
    runs = [load_run(f) for f in files]
    code = ExitCode.OK
    if runs:
        print(markdown_table(runs))
    if plot:
        from distperp_harness.commands.plots import PlotUnavailable, plot_compare

        try:
            print(plot_compare(runs or pair, plot).line("compare"))
        except (PlotUnavailable, ValueError) as error:
            print(f"compare: no plot: {error}")
            code = ExitCode.FAILED
    if pair:
        equal, line = compare_bits(pair[0], pair[1])
        print(line)
        code = code if equal else ExitCode.FAILED
    return code
