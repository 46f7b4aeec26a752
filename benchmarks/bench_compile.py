"""``compile=true`` vs eager: whole process and scoring only, compile time included, cold and warm compile caches.

    python -m benchmarks.bench_compile                         # WikiText-2 test (all) + hellaswag: ~6 min, 2 cores
    python -m benchmarks.bench_compile --tokens 100000 --work rolling
    python -m benchmarks.bench_compile --scorers eager,cold,warm --questions 100

Work (``--work``): ``rolling`` is ``loglikelihood_rolling`` over WikiText-2 test articles (the first ones up to
``--tokens`` tokens; 0: all 62), as ``bench_scoring`` runs it; ``mc`` is ``bench_mc``'s ``hellaswag`` shape (a
~90-token context and four ~15-token endings per question, tree rows with their mask) as ``loglikelihood``.

Scorers, each a fresh process (``python -m benchmarks.bench_compile --worker ...``, same model, dtype float32, batch
size and ``max_length``): ``hf`` (lm-eval's), ``eager`` (distperp), ``cold`` (distperp ``compile=true`` with an empty
``TORCHINDUCTOR_CACHE_DIR``: a first run), ``warm`` (the same again: the on-disk caches that ``cold`` filled).
Whole process is the parent's wall time of the worker (interpreter start, imports, load, compile, requests, scoring,
exit); scoring is the wall time of the lm-eval call less any compiling inside it (the tree-mask graph compiles when
the first plan with tree rows needs it); ``+ compile`` adds all compile seconds (warm-up forwards included) to it,
which is what compiling costs a run that loads once. ``vs hf`` divides ``hf``'s whole-process time
by the row's; ``vs eager`` divides eager's scoring time by the row's scoring (+ compile). Each scorer runs
``--repeats`` times in rotated order (a shared machine: the table takes each scorer's fastest run, since interference
only slows a run down); ``cold`` runs once per work (a fresh cache each time it runs).

Prints a markdown table; ``--json PATH`` saves the raw numbers. The largest |compiled - eager| and |eager - hf|
log-likelihood per request are printed under it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._scoring_common import _quiet, machine, make_lm, requests_for, select_documents
from benchmarks.bench_mc import build_questions
from benchmarks.bench_mc import requests_for as mc_requests
from benchmarks.common import (
    REPO_ROOT,
    SHARED_MODEL,
    WIKITEXT_TEST,
    WIKITEXT_VALID,
    environment,
    load_articles,
    module_command,
)

SCORERS = {
    "hf": ("hf", ""),
    "eager": ("distperp", ""),
    "cold": ("distperp", ",compile=true"),
    "warm": ("distperp", ",compile=true"),
}
LABELS = {
    "hf": "lm-eval hf",
    "eager": "distperp eager",
    "cold": "distperp compile=true, cold caches",
    "warm": "distperp compile=true, warm caches",
}


# ------------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One scorer on one work, in this process: load, build the requests, score once; seconds and results."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    name, extra = SCORERS[args.worker]
    t0 = time.perf_counter()
    lm = make_lm(name, Path(args.model), args.max_length, args.batch_size, extra)
    load_s = time.perf_counter() - t0
    _quiet()
    if args.work == "rolling":
        docs, tokens = select_documents(load_articles(Path(args.text)), lm.tokenizer, args.tokens or None)
        requests = requests_for(docs)

        def call() -> list[float]:
            return [float(x) for x in lm.loglikelihood_rolling(requests, disable_tqdm=True)]
    else:
        ids = lm.tokenizer.encode(Path(args.mc_text).read_text(encoding="utf-8"), add_special_tokens=False)
        questions = build_questions("hellaswag", ids, lambda t: lm.tokenizer.decode(t), args.questions)
        requests = mc_requests(questions)
        tokens = sum(len(lm.tokenizer.encode(c + x, add_special_tokens=False)) for c, x in (r.args for r in requests))

        def call() -> list[float]:
            return [float(ll) for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]

    compiled = getattr(lm, "compiled", None)
    compile_before = compiled.seconds if compiled is not None else 0.0
    t1 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):  # hf draws its progress bars
        results = call()
    # a graph compiled during the call (the tree-mask graph, when the first plan with tree rows needs it) is
    # compile time, not scoring: it is in compile_seconds
    score_s = time.perf_counter() - t1 - ((compiled.seconds - compile_before) if compiled is not None else 0.0)
    info = compiled.to_dict() if compiled is not None else None
    return {
        "scorer": args.worker,
        "work": args.work,
        "tokens": tokens,
        "load_s": load_s,
        "score_s": score_s,
        "compile": info,
        "results": results,
    }


def run_worker(scorer: str, work: str, args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    """:func:`worker` in a fresh process; adds ``process_s`` (its whole wall time, start-up and exit included)."""
    cmd = module_command(
        "bench_compile",
        "--worker",
        scorer,
        "--work",
        work,
        "--model",
        args.model,
        "--max-length",
        str(args.max_length),
        "--batch-size",
        str(args.batch_size),
        "--tokens",
        str(args.tokens),
        "--questions",
        str(args.questions),
        "--text",
        args.text,
        "--mc-text",
        args.mc_text,
        "--threads",
        str(args.threads),
    )
    env = environment({"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)})
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
    process_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{scorer} on {work} failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}")
    out = json.loads(lines[-1])
    out["process_s"] = process_s
    return out


# ------------------------------------------------------------------------------------------------------ report
def _best(runs: list[dict], key: str) -> float:
    return min(r[key] for r in runs)


def table(runs: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> str:
    import lm_eval
    import torch
    import transformers

    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} (shared with other jobs) · torch "
        f"{torch.__version__} "
        f"({args.threads or torch.get_num_threads()} threads) · transformers {transformers.__version__} · "
        f"lm-eval {lm_eval.__version__} · {Path(args.model).name} · 1 process · float32 · batch size "
        f"{args.batch_size} · max_length {args.max_length} · fastest of {args.repeats} (cold: 1)",
        "",
        "| work | scorer | whole process s | vs hf | load s | compile s | scoring s | scoring tok/s | "
        "scoring + compile s | vs eager (scoring) | vs eager (+ compile) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for work, by_scorer in runs.items():
        first = next(iter(by_scorer.values()))[0]
        label = (
            f"WikiText-2 test rolling ({first['tokens']:,} tok)"
            if work == "rolling"
            else f"hellaswag shape ({args.questions} q, {first['tokens']:,} tok)"
        )
        hf_process = _best(by_scorer["hf"], "process_s") if "hf" in by_scorer else None
        eager_score = _best(by_scorer["eager"], "score_s") if "eager" in by_scorer else None
        for scorer, rs in by_scorer.items():
            process, score = _best(rs, "process_s"), _best(rs, "score_s")
            info = rs[0]["compile"] or {}
            compile_s = min((r["compile"] or {}).get("compile_seconds", 0.0) for r in rs) if info.get("active") else 0.0
            vs_hf = f"{hf_process / process:.2f}×" if hf_process and scorer != "hf" else "—"
            vs_eager = f"{eager_score / score:.2f}×" if eager_score and scorer not in ("hf", "eager") else "—"
            vs_eager_c = (
                f"{eager_score / (score + compile_s):.2f}×" if eager_score and scorer not in ("hf", "eager") else "—"
            )
            lines.append(
                f"| {label} | {LABELS[scorer]} | {process:.1f} | {vs_hf} | {_best(rs, 'load_s'):.1f} | "
                f"{compile_s:.1f} | {score:.2f} | {rs[0]['tokens'] / score:,.0f} | {score + compile_s:.2f} | "
                f"{vs_eager} | {vs_eager_c} |"
            )
            label = ""
            if info:
                shown = {
                    k: info.get(k)
                    for k in ("active", "reason", "graphs", "recompilations", "compiled_calls", "eager_calls")
                }
                cache = info.get("cache") or {}
                notes.append(
                    f"- {work} {scorer}: compile {json.dumps(shown)}; cache hits/misses "
                    f"{cache.get('hits')}/{cache.get('misses')}"
                )
        ref = {k: v[-1]["results"] for k, v in by_scorer.items()}
        for a, b in (("eager", "warm"), ("eager", "cold"), ("hf", "eager")):
            if a in ref and b in ref:
                diff = max(abs(x - y) for x, y in zip(ref[a], ref[b]))
                notes.append(f"- {work}: max |{a} - {b}| per request {diff:.2g} nats")
    return "\n".join(lines + [""] + notes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(SHARED_MODEL))
    p.add_argument("--work", default="rolling,mc", help="comma-separated: rolling, mc")
    p.add_argument("--scorers", default=",".join(SCORERS), help=f"comma-separated subset of {', '.join(SCORERS)}")
    p.add_argument("--tokens", type=int, default=0, help="rolling: first articles up to this many tokens (0: all)")
    p.add_argument("--questions", type=int, default=300, help="mc: hellaswag-shaped questions")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1, help="runs of each scorer but cold (fastest one shown)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--text", default=str(WIKITEXT_TEST))
    p.add_argument("--mc-text", default=str(WIKITEXT_VALID))
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and "warm" in args.scorers and "cold" not in args.scorers:
        p.error("--scorers warm needs cold first (it fills the compile caches)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    scorers = [s for s in args.scorers.split(",") if s]
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as tmp:
        for work in [w for w in args.work.split(",") if w]:
            cache = Path(tmp) / f"inductor-{work}"  # empty: the cold run fills it, the warm runs read it
            runs[work] = {s: [] for s in scorers}
            for rep in range(args.repeats):
                order = scorers[rep % len(scorers) :] + scorers[: rep % len(scorers)]
                for scorer in order:
                    if scorer == "cold" and runs[work]["cold"]:
                        continue
                    if scorer == "warm" and not runs[work].get("cold"):
                        run_once = run_worker("cold", work, args, cache)
                        runs[work]["cold"].append(run_once)
                    out = run_worker(scorer, work, args, cache)
                    runs[work][scorer].append(out)
                    print(
                        f"  {work} {scorer}: process {out['process_s']:.1f} s, scoring {out['score_s']:.2f} s",
                        flush=True,
                    )
    print()
    print(table(runs, args))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
