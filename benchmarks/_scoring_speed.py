"""``bench_scoring``'s speed: every scorer timed on the same work in alternating repeats, the real CLI once each
way (``--cli``), and the markdown table of speed and memory for ``benchmarks/README.md``."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._scoring_common import (
    DEFAULT_TOKENS,
    SCORERS,
    _model_args,
    _quiet,
    bare_batches,
    device_name,
    machine,
    make_lm,
    make_runner,
    model_facts,
    padded_tokens,
    probe_decision,
    requests_for,
    select_documents,
)
from benchmarks._scoring_memory import measure_memory
from benchmarks.common import PROJECT_TASKS, REPO_ROOT, environment, load_articles


@dataclass
class ModelResult:
    """Everything measured for one model."""

    model: str
    facts: dict[str, Any]
    docs: int
    tokens: int
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    scoring_tokens_per_s: list[float] = field(default_factory=list)
    ratio_hf: list[float] = field(default_factory=list)
    ratio_hf_cpu: list[float] = field(default_factory=list)
    padded_tokens: dict[str, int] = field(default_factory=dict)
    ratio_bare: list[float] = field(default_factory=list)
    ratio_bare_end_to_end: list[float] = field(default_factory=list)
    max_abs_diff_vs_hf: float | None = None
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _build_lms(scorers: list[str], path: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[str], set[str]]:
    """The scorers' models, the notes of optional ones that could not be built, and those skipped."""
    lms: dict[str, Any] = {}
    notes: list[str] = []
    skipped: set[str] = set()
    for scorer in scorers:
        if scorer == "bare":
            continue
        try:
            lms[scorer] = make_lm(scorer, path, args.max_length, args.batch_size, device=args.device, dtype=args.dtype)
        except Exception as exc:  # an optional path (int4) may not be available
            if scorer in ("hf", "distperp"):
                raise
            notes.append(f"{SCORERS[scorer]} skipped: {type(exc).__name__}: {str(exc)[:200]}")
            skipped.add(scorer)
    return lms, notes, skipped


def _record_repeat(
    result: ModelResult, tokens: int, seconds: dict[str, float], cpu: dict[str, float], stage: float | None
) -> None:
    """One repetition's throughputs and ratios, appended to ``result``."""
    for key, s in seconds.items():
        result.tokens_per_s[key].append(tokens / s)
    if "hf" in seconds:
        result.ratio_hf.append(seconds["hf"] / seconds["distperp"])
        result.ratio_hf_cpu.append(cpu["hf"] / cpu["distperp"])
    if stage is not None:
        result.scoring_tokens_per_s.append(tokens / stage)
    if "bare" in seconds and stage is not None:
        result.ratio_bare.append(seconds["bare"] / stage)
        result.ratio_bare_end_to_end.append(seconds["bare"] / seconds["distperp"])


def bench_model(name: str, path: Path, args: argparse.Namespace, lms: dict[str, Any] | None = None) -> ModelResult:
    """Time every scorer on ``name`` (alternating, ``args.repeats`` times) and measure scoring memory. ``lms``: the
    scorers' LM objects already built (``bench_families`` gives ``hf`` and ``distperp`` one shared model); by default
    each scorer loads ``path`` itself."""
    facts = model_facts(path)
    scorers = [s for s in args.scorers if s in SCORERS]
    if lms is None:
        lms, notes, skipped = _build_lms(scorers, path, args)
    else:
        lms, notes, skipped = {k: v for k, v in lms.items() if k in scorers}, [], set(scorers) - set(lms) - {"bare"}
    _quiet()  # distperp's LM sets its own log level when it is built
    notes.append(f"scoring paths {probe_decision(lms['distperp'])}")
    if "bare" in scorers:
        lms["bare"] = lms["distperp"]
    default = DEFAULT_TOKENS[args.quick].get(name, 1_000 if name.startswith("random-") else None)
    tokens_limit = args.tokens if args.tokens is not None else default
    tokens_limit = tokens_limit or None
    docs, tokens = select_documents(load_articles(Path(args.text)), lms["distperp"].tokenizer, tokens_limit)
    requests = requests_for(docs)
    batches = bare_batches(lms["distperp"], docs) if "bare" in lms else None
    runners = [make_runner(key, lm, requests, batches) for key, lm in lms.items()]
    result = ModelResult(
        name,
        facts,
        len(docs),
        tokens,
        {r.key: [] for r in runners},
        notes=notes,
        padded_tokens=padded_tokens(lms["distperp"], docs, args.batch_size),
    )
    print(
        f"{name}: {facts['params'] / 1e6:.1f}M parameters, vocab {facts['vocab']}; {len(docs)} articles, "
        f"{tokens} tokens; scorers {', '.join(r.key for r in runners)}",
        flush=True,
    )
    for rep in range(args.repeats):
        order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
        seconds: dict[str, float] = {}
        stage: float | None = None
        cpu: dict[str, float] = {}
        for runner in order:
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's hf always draws its inner progress bars
                inner = runner.run()
            seconds[runner.key] = time.perf_counter() - t0
            cpu[runner.key] = time.process_time() - c0
            if runner.key == "distperp":
                stage = inner
        _record_repeat(result, tokens, seconds, cpu, stage)
        print(
            f"  repeat {rep + 1}/{args.repeats}: "
            + ", ".join(f"{k} {tokens / s:,.0f} tok/s" for k, s in seconds.items()),
            flush=True,
        )
    by_key = {r.key: r for r in runners}
    if "hf" in by_key:
        result.max_abs_diff_vs_hf = max(abs(a - b) for a, b in zip(by_key["hf"].results, by_key["distperp"].results))
    del runners, lms
    gc.collect()
    if args.memory:
        for scorer in (s for s in scorers if s not in skipped and s in args.memory_scorers):
            measured = measure_memory(scorer, path, args)
            if measured is not None:
                result.memory[scorer] = measured
    return result


# ------------------------------------------------------------------------------------------------------ report
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else format(value, spec) + unit


def cli_sanity(path: Path, args: argparse.Namespace) -> str:
    """The real CLI once each way: ``python -m lm_eval --model hf|distperp ... --tasks distperp_wikitext2 --limit N``
    on the local WikiText file; wall time of each command (start-up included) and the ratio."""
    tasks = PROJECT_TASKS
    if not (tasks / "distperp_wikitext2.yaml").is_file():
        return f"CLI sanity skipped: {tasks}/distperp_wikitext2.yaml not found"
    env = environment({"DISTPERP_WIKITEXT_PATH": str(Path(args.text).parent)}, args.device)
    seconds = {}
    for name in ("hf", "distperp"):
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            name,
            "--model_args",
            _model_args(path, args.max_length).replace(",device=cpu", ""),
            "--device",
            "cpu",
            "--tasks",
            "distperp_wikitext2",
            "--include_path",
            str(tasks),
            "--batch_size",
            str(args.batch_size),
            "--limit",
            str(args.cli),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
        seconds[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            return f"CLI sanity: {name} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
    return (
        f"CLI sanity ({path.name}, distperp_wikitext2 --limit {args.cli}, wall time with start-up): hf "
        f"{seconds['hf']:.1f} s, distperp {seconds['distperp']:.1f} s, ratio {seconds['hf'] / seconds['distperp']:.2f}"
    )


def _best(values: list[float]) -> float | None:
    return max(values) if values else None


def report(results: list[ModelResult], args: argparse.Namespace) -> str:
    """The markdown table (and header lines) for ``benchmarks/README.md``.

    Throughput is the best of the alternating repeats (the run least disturbed by other load: interference on a
    shared machine only ever slows a run down); the notes under the table give the medians as well.
    """
    import lm_eval
    import torch
    import transformers

    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} · torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) · transformers {transformers.__version__} · lm-eval "
        f"{lm_eval.__version__} · 1 process · {args.dtype} on {device_name(args.device)} · "
        f"batch size {args.batch_size} · "
        f"max_length {args.max_length} · "
        f"best of {args.repeats} alternating repeats",
        "",
        "| model | scorer | tokens/s | vs hf | vs bare forward | peak scoring memory | vs hf |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        label = f"{r.model} ({r.facts['params'] / 1e6:.1f}M, vocab {r.facts['vocab']:,}; {r.tokens:,} tok)"
        hf_tps = _best(r.tokens_per_s.get("hf", []))
        bare_tps = _best(r.tokens_per_s.get("bare", []))
        hf_mem = r.memory.get("hf", {}).get("peak_delta")
        for key, tps_list in r.tokens_per_s.items():
            tps = _best(tps_list)
            vs_hf = tps / hf_tps if hf_tps and tps and key != "hf" else None
            stage = _best(r.scoring_tokens_per_s) if key == "distperp" else None
            vs_bare = stage / bare_tps if stage and bare_tps else None
            mem = r.memory.get(key, {}).get("peak_delta")
            mem_ratio = mem / hf_mem if mem is not None and hf_mem and key != "hf" else None
            mib = _fmt(mem / 2**20 if mem is not None else None, ",.0f", " MiB")
            lines.append(
                f"| {label} | {SCORERS[key]} | {_fmt(tps, ',.0f')} | {_fmt(vs_hf, '.2f', '×')} | "
                f"{_fmt(vs_bare, '.2f')} | {mib} | {_fmt(mem_ratio, '.2f', '×')} |"
            )
            label = ""
    lines.append("")
    for r in results:
        medians = ", ".join(f"{k} {_fmt(_median(v), ',.0f')}" for k, v in r.tokens_per_s.items())
        extra = [
            f"median tokens/s: {medians}",
            f"distperp scoring stage (no tokenization) best {_fmt(_best(r.scoring_tokens_per_s), ',.0f')} tok/s",
        ]
        if r.ratio_bare:
            extra.append(
                f"distperp / bare per repeat (median): scoring stage {_median(r.ratio_bare):.2f}, end to end "
                f"{_fmt(_median(r.ratio_bare_end_to_end), '.2f')}"
            )
        if r.ratio_hf:
            extra.append(
                f"distperp / hf per repeat: {', '.join(f'{x:.2f}' for x in r.ratio_hf)} (median "
                f"{_median(r.ratio_hf):.2f}; on process CPU time {_fmt(_median(r.ratio_hf_cpu), '.2f')})"
            )
        pad = r.padded_tokens
        extra.append(
            f"positions computed (padding included): hf {pad['hf']:,}, distperp {pad['distperp']:,} "
            f"for {pad['scored']:,} scored"
        )
        if r.max_abs_diff_vs_hf is not None:
            extra.append(f"max |hf - distperp| per document {r.max_abs_diff_vs_hf:.2g} nats")
        lines.append(f"- {r.model}: " + "; ".join(extra) + ".")
        for note in r.notes:
            lines.append(f"- {r.model}: {note}")
    return "\n".join(lines)
