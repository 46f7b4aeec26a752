"""Families on the fast path (issue 55): lm-eval ``hf`` vs ``distperp`` per model family, three workloads, one table.

    python -m benchmarks.bench_families --threads 1 --workdir /tmp/distperp-families   # 4 families + SmolLM2: ~2 h
    python -m benchmarks.bench_families --families gemma3-270m --workloads mmlupro5 --repeats 3
    python -m benchmarks.bench_families --dry                                 # tiny-<family> shapes: seconds

Families (``--families``): random-init models of the smallest published configurations of Gemma 3, Qwen 3 and
Granite and a gpt-oss-20b scaled down (``_scoring_common.RANDOM_SHAPES``, sources and scaling in
``_scoring_common.FAMILY_SOURCES``), built once into ``--workdir``; ``smollm2`` is the pretrained
SmolLM2-135M-Instruct (Llama family, ``~/.cache/distperp/smollm2-135m-instruct``), the reference point, when present.
``--dry``: the ``tiny-<family>`` shapes (the same features at test sizes) on the packaged sample, one repeat.

Per family, one process, float32 on the CPU: the weights are loaded once and the same model object is given to
``hf`` and ``distperp`` (``pretrained=<model>``; one copy in memory, the 2.5B Granite fits), each built with lm-eval's
registry; distperp's build runs its probe (the build time of each side is reported). Workloads, each by the function
of its own benchmark, both sides alternating (order rotated per repeat), median of ``--repeats``:

* ``mmlupro5``: ``bench_mc``'s MMLU-Pro 5-shot shape (leaderboard template, 10 options, ``first_n`` shots: every
  prompt starts with the same ~700-token block), ``--questions`` questions cut from WikiText-2 valid;
* ``rolling``: ``bench_scoring``'s ``loglikelihood_rolling`` over the first WikiText-2 test articles up to
  ``--rolling-tokens`` tokens (disjoint windows of ``--max-length``);
* ``generate``: ``bench_generate``'s ``instruct`` shape, ``--prompts`` greedy generations of at most ``--new-tokens``
  tokens (no stop string: a random model rarely ends early).

Tokens computed: distperp's own call records (``config.distperp.calls[*]``: ``computed_tokens``, and the unshared
work, ``computed_tokens + tokens_saved``); ``hf``'s positions are counted by a forward pre-hook on the model's body
(``_scoring_common.Counter``: every row of every forward, pads included). Rolling: the padded windows each side
computes (``_scoring_common.padded_tokens``). Peak memory: one more, untimed, call of each side while a thread samples
the process's resident set size (``_scoring_memory.RssSampler``), the peak less the size before the call, per row of
``--batch-size`` (``hf`` holds ``[rows, length, vocab]`` logits and their log-softmax; distperp the scored positions'
head only). The probe's decision is the one distperp's run record keeps (``config.distperp.paths``).

Targets (issue 55): every family whose probe grants the fast path at >= 3x ``hf`` on MMLU-Pro 5-shot, >= 1x on
rolling and on generation; the last table says met or missed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import bench_generate, bench_mc
from benchmarks._scoring_common import (
    FAMILY_SOURCES,
    Counter,
    _quiet,
    load_model,
    machine,
    make_lm,
    probe_decision,
    requests_for,
    resolve_model,
    select_documents,
)
from benchmarks._scoring_memory import RssSampler
from benchmarks._scoring_speed import bench_model
from benchmarks.common import SMOLLM2, WIKITEXT_TEST, WIKITEXT_VALID, load_articles, use_offline_env

FAMILIES = ("gemma3-270m", "qwen3-0.6b", "granite-3-2b", "gpt-oss-scaled", "smollm2")
"""The families measured by default: the four shapes of ``RANDOM_SHAPES`` and the pretrained reference."""
DRY = {"gemma3-270m": "tiny-gemma3", "qwen3-0.6b": "tiny-qwen3", "granite-3-2b": "tiny-granite"}
DRY["gpt-oss-scaled"] = "tiny-gpt-oss"
"""``--dry``: each family's tiny shape."""
WORKLOADS = ("mmlupro5", "rolling", "generate")
TARGETS = {"mmlupro5": 3.0, "rolling": 1.0, "generate": 1.0}
"""The issue's targets: distperp over ``hf`` (speed) per workload."""


def family_path(family: str, args: argparse.Namespace) -> Path:
    """The checkpoint folder of ``family``: SmolLM2's, or the random shape built (once) in ``--workdir``."""
    if family == "smollm2":
        return SMOLLM2
    return resolve_model(f"random-{DRY.get(family, family) if args.dry else family}", Path(args.workdir))


SMOLLM2_SHAPE = "HuggingFaceTB/SmolLM2-135M-Instruct, pretrained (llama): hidden 576, 30 layers, 9 / 3 KV heads, "
SMOLLM2_SHAPE += "vocab 49,152, tied head"


def published(family: str, args: argparse.Namespace) -> str:
    """The published shape ``family`` has (its source and what was scaled)."""
    if family == "smollm2":
        return SMOLLM2_SHAPE
    shape = DRY.get(family, family) if args.dry else family
    return FAMILY_SOURCES.get(shape, shape)


def peak_per_row(call: Any, rows: int) -> float:
    """Bytes the process's resident set grew by during ``call()`` at its peak, per row."""
    gc.collect()
    with contextlib.redirect_stderr(io.StringIO()), RssSampler() as sampler:
        before = sampler.peak
        call()
    return max(0, sampler.peak - before) / rows


def mmlupro5(lms: dict[str, Any], counter: Counter, args: argparse.Namespace) -> dict[str, Any]:
    """``bench_mc``'s MMLU-Pro 5-shot shape, both sides alternating; tokens computed and peak memory per row."""
    tokenizer = lms["distperp"].tokenizer
    ids = tokenizer.encode(Path(args.mc_text).read_text(encoding="utf-8"), add_special_tokens=False)
    shape = SimpleNamespace(questions=args.questions, repeats=args.repeats)
    report = bench_mc.run_shape("mmlupro5", lms, tokenizer, ids, shape, {"hf": counter})
    call = report["calls"]["distperp"]
    out = {
        "seconds": report["seconds"],
        "ratios": [h / d for h, d in zip(report["seconds"]["hf"], report["seconds"]["distperp"])],
        "tokens": {"hf": report["positions"]["hf"], "distperp": call["computed_tokens"]},
        "unshared": call["computed_tokens"] + call["tokens_saved"],
        "rows": f"{call['rows']} rows for {call['units']} answers",
        "prompt_tokens": report["prompt_tokens"],
        "answers_equal": report["answers_equal_distperp"],
        "max_abs_diff": report["max_abs_diff_distperp"],
    }
    if args.memory:
        requests = bench_mc.requests_for(
            bench_mc.build_questions("mmlupro5", ids, lambda t: tokenizer.decode(t), args.questions)
        )
        out["memory_per_row"] = {
            key: peak_per_row(lambda lm=lm: lm.loglikelihood(requests, disable_tqdm=True), args.batch_size)
            for key, lm in lms.items()
        }
    return out


def rolling(name: str, path: Path, lms: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``bench_scoring``'s rolling perplexity (``bench_model`` on the given LMs), and peak memory per row."""
    run = SimpleNamespace(
        scorers=["hf", "distperp"],
        quick=False,
        tokens=args.rolling_tokens,
        text=args.text,
        repeats=args.repeats,
        batch_size=args.batch_size,
        max_length=args.max_length,
        memory=False,
    )
    result = bench_model(name, path, run, lms=lms)
    out = {
        "ratios": result.ratio_hf,
        "tokens_per_s": result.tokens_per_s,
        "tokens": {"hf": result.padded_tokens["hf"], "distperp": result.padded_tokens["distperp"]},
        "scored": result.padded_tokens["scored"],
        "max_abs_diff": result.max_abs_diff_vs_hf,
    }
    if args.memory:
        docs, _ = select_documents(load_articles(Path(args.text)), lms["distperp"].tokenizer, args.rolling_tokens)
        requests = requests_for(docs)
        out["memory_per_row"] = {
            key: peak_per_row(lambda lm=lm: lm.loglikelihood_rolling(requests, disable_tqdm=True), args.batch_size)
            for key, lm in lms.items()
        }
    return out


def generate(lms: dict[str, Any], counter: Counter, args: argparse.Namespace) -> dict[str, Any]:
    """``bench_generate``'s ``instruct`` shape (greedy, alternating), positions computed by each side."""
    run = SimpleNamespace(prompts=args.prompts, instruct_new=args.new_tokens, task_new=None, repeats=args.repeats)
    with tempfile.TemporaryDirectory() as folder:
        report = bench_generate.run_shape("instruct", lms, {"hf": counter}, run, Path(folder))
    rows = report["rows"]
    useful = report["useful"]
    return {
        "median_s": {k: rows[k]["median_s"] for k in rows},
        "ratio": rows["hf"]["median_s"] / rows["distperp"]["median_s"],
        "seconds": report["seconds"],
        "tokens": {k: round(rows[k]["decode_per_useful"] * useful) + rows[k]["prefill"] for k in rows},
        "useful": useful,
        "texts_equal": f"{report['same']['distperp']}/{report['requests']}",
    }


def run_family(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every workload of ``args.workloads`` on ``family``, one loaded model shared by both sides."""
    import torch

    path = family_path(family, args)
    model = load_model(path)
    built = {}
    lms = {}
    for key in ("hf", "distperp"):
        start = time.perf_counter()
        lms[key] = make_lm(key, path, args.max_length, args.batch_size, model=model)
        built[key] = time.perf_counter() - start
    _quiet()
    counter = Counter(model)
    out: dict[str, Any] = {
        "family": family,
        "published": published(family, args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention": model.config._attn_implementation,
        "decision": probe_decision(lms["distperp"]),
        "probe": lms["distperp"].prepared.paths["model"].get("evidence", {}),
        "build_seconds": built,
        "threads": torch.get_num_threads(),
    }
    print(f"\n== {family}: {out['published']}\n   {out['decision']}", flush=True)
    if "mmlupro5" in args.workloads:
        out["mmlupro5"] = mmlupro5(lms, counter, args)
    if "rolling" in args.workloads:
        out["rolling"] = rolling(family, path, lms, args)
    if "generate" in args.workloads:
        out["generate"] = generate(lms, counter, args)
    counter.remove()
    del lms, model
    gc.collect()
    return out


def _ratio(values: list[float] | float | None) -> str:
    if values is None:
        return "—"
    if isinstance(values, float):
        return f"{values:.2f}×"
    return f"{statistics.median(values):.2f}× ({min(values):.2f}-{max(values):.2f})"


def _mib(report: dict[str, Any] | None) -> str:
    memory = (report or {}).get("memory_per_row")
    if not memory:
        return "—"
    return f"{memory['hf'] / 2**20:,.0f} / {memory['distperp'] / 2**20:,.0f}"


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown tables (the results, then the targets) and the notes under them."""
    import lm_eval
    import torch
    import transformers

    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} · torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) · transformers {transformers.__version__} · lm-eval "
        f"{lm_eval.__version__} · 1 process · float32 on cpu · batch size {args.batch_size} · max_length "
        f"{args.max_length} · median of {args.repeats} alternating repeats (range in brackets)",
        "",
        "| family | published shape | probe decision | MMLU-Pro 5-shot vs hf | rolling vs hf | generation vs hf | "
        "tokens computed distperp / hf (MMLU-Pro; rolling; generation) | peak MiB per row hf / distperp "
        "(MMLU-Pro; rolling) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mc, roll, gen = r.get("mmlupro5"), r.get("rolling"), r.get("generate")
        tokens = "; ".join(
            f"{w['tokens']['distperp']:,} / {w['tokens']['hf']:,}" if w else "—" for w in (mc, roll, gen)
        )
        lines.append(
            f"| {r['family']} ({r['parameters'] / 1e6:,.1f}M, {r['attention']}) | {r['published']} | "
            f"{r['decision']} | {_ratio(mc and mc['ratios'])} | {_ratio(roll and roll['ratios'])} | "
            f"{_ratio(gen and gen['ratio'])} | {tokens} | {_mib(mc)}; {_mib(roll)} |"
        )
    lines += ["", "| family | " + " | ".join(f"{w} ≥ {TARGETS[w]:g}×" for w in args.workloads) + " |"]
    lines.append("|---|" + "---|" * len(args.workloads))
    for r in results:
        cells = []
        for w in args.workloads:
            ratios = r[w]["ratios"] if w != "generate" else [r[w]["ratio"]]
            median = statistics.median(ratios)
            cells.append(f"{median:.3f}× {'met' if median >= TARGETS[w] else 'MISSED'}")
        lines.append(f"| {r['family']} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in results:
        notes = [
            f"built hf {r['build_seconds']['hf']:.1f} s, distperp {r['build_seconds']['distperp']:.1f} s (its probe: "
            f"{r['probe'].get('probe_tokens', 0):,} tokens)"
        ]
        if "mmlupro5" in r:
            mc = r["mmlupro5"]
            per = ", ".join(f"{h:.2f} / {d:.2f}" for h, d in zip(mc["seconds"]["hf"], mc["seconds"]["distperp"]))
            notes.append(
                f"MMLU-Pro {args.questions} q ({mc['prompt_tokens']:.0f}-token prompts), s hf / distperp: {per}; "
                f"distperp {mc['rows']}, unshared work {mc['unshared']:,} tokens; answers "
                f"{'equal' if mc['answers_equal'] else 'DIFFER'}, max |Δ ll| {mc['max_abs_diff']:.2g}"
            )
        if "rolling" in r:
            roll = r["rolling"]
            notes.append(
                f"rolling {roll['scored']:,} tokens, per repeat {', '.join(f'{x:.2f}' for x in roll['ratios'])}; "
                f"max |Δ| per document {roll['max_abs_diff']:.2g} nats"
            )
        if "generate" in r:
            gen = r["generate"]
            per = ", ".join(f"{h:.2f} / {d:.2f}" for h, d in zip(gen["seconds"]["hf"], gen["seconds"]["distperp"]))
            notes.append(
                f"generation {args.prompts} prompts, {gen['useful']} new tokens, s hf / distperp: {per}; texts "
                f"equal {gen['texts_equal']}"
            )
        lines.append(f"- {r['family']}: " + "; ".join(notes) + ".")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    p.add_argument("--questions", type=int, default=8, help="MMLU-Pro 5-shot questions")
    p.add_argument("--rolling-tokens", type=int, default=4096, help="rolling: the first articles up to this many")
    p.add_argument("--prompts", type=int, default=4, help="generation prompts")
    p.add_argument("--new-tokens", type=int, default=32, help="generation: new tokens at most")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--text", default=str(WIKITEXT_TEST), help="WikiText test.txt (rolling)")
    p.add_argument("--mc-text", default=str(WIKITEXT_VALID), help="text the questions are cut from")
    p.add_argument("--workdir", default=None, help="where the random models are built, once (default: a temp folder)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the untimed memory calls")
    p.add_argument("--json", default=None, help="also write the raw numbers to this file")
    p.add_argument(
        "--dry",
        action="store_true",
        help="the tiny-<family> shapes, small work, one repeat (the test; give --text/--mc-text the packaged sample)",
    )
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [f for f in args.families if f not in FAMILIES] + [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown families or workloads: {', '.join(unknown)}")
    if args.dry:
        args.families = [f for f in args.families if f != "smollm2"]
        args.questions, args.rolling_tokens, args.prompts, args.new_tokens = 2, 300, 2, 4
        args.repeats, args.max_length, args.batch_size = 1, 128, 2
    if "smollm2" in args.families and not (SMOLLM2 / "config.json").is_file():
        print(f"note: {SMOLLM2} not found (see ../shared/models/smollm2-135m-instruct/README.md); smollm2 skipped")
        args.families.remove("smollm2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_offline_env()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_families_") as tmp:
        args.workdir = args.workdir or tmp
        for family in args.families:
            results.append(run_family(family, args))
    print()
    print(table(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
