"""The ``lm_eval`` CLI end to end, ``hf`` against ``distperp``, where a user would measure: one table.

    python -m benchmarks.bench_cli --device cuda --model DIR            # one H200: ~6 minutes at the defaults
    python -m benchmarks.bench_cli --device cpu --questions 6 --tokens 3000 --max-length 128   # dry (make test)

Work, each run as its own ``python -m lm_eval`` process (start-up, task building, tokenizing and scoring: what a
user waits for):

* ``mmlu_pro``: lm-eval's ``leaderboard_mmlu_pro`` (its YAML: 5-shot, ten one-letter answers) on ``--questions``
  local questions in its schema (``_leaderboard_data``: lm-eval's task, only the data swapped; default 1,000);
* ``rolling``: ``distperp_local_docs`` (``loglikelihood_rolling``) over ``--tokens`` tokens (default 1M) of WikiText-2
  test and valid articles; past their ~0.6M tokens, the articles again with their paragraphs in reverse order, so no
  two documents or windows are copies (distperp computes an identical window once, ``hf`` would not);
* ``int4``: the first ``--int4-tokens`` tokens of those documents (default 262,144: torchao's kernel alone ran int4
  scoring at 0.13x of bf16 on an H200) through ``distperp`` in the model dtype, with ``quantize=int4``
  (``int4_prefill=auto``: products of many rows dequantized) and with ``int4_prefill=kernel``.

Per run: wall seconds of the process, the request phase (the sum of distperp's call records' ``total_seconds``: from
a call's start to its results; ``hf`` keeps no such record), tokens (rolling) or questions per wall second, and
against the first
row of the work: the wall-time ratio and whether the answers agree (MMLU-Pro: the chosen letter of every question;
rolling: the largest relative difference of a document's log-likelihood). ``hf`` sums bf16 log-probabilities
in bf16 (its documents' sums are rounded to bf16), so rolling rows differ from it by that rounding, not by a bug:
the float64 checks live in the tests. The bare-forward fraction is ``bench_scoring``'s (a forward without the
CLI around it). Exits 1 when a run fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._leaderboard_data import build_leaderboard_include
from benchmarks.common import WIKITEXT_TEST, WIKITEXT_VALID, environment, load_articles, use_offline_env

NO_HUB_KERNELS = {"USE_HUB_KERNELS": "0"}
"""transformers would swap layers for Hub kernels when a model loads onto a GPU, which fails offline."""


def rolling_docs(folder: Path, tokens: int, tokenizer) -> int:
    """Write documents of about ``tokens`` tokens to ``folder`` (one ``.txt`` each); the tokens written."""
    from distperp_harness.commands.tiny import sample_text

    articles = [load_articles(path) for path in (WIKITEXT_TEST, WIKITEXT_VALID) if path.is_file()]
    base = [a for group in articles for a in group] or [sample_text()]
    folder.mkdir(parents=True, exist_ok=True)
    total, i, turn = 0, 0, 0
    while total < tokens:
        text = base[i % len(base)]
        turn = i // len(base)
        if turn:  # the article again, paragraphs reversed and marked with the turn: no copy of a window
            text = "\n".join(f"{line} ( {turn} )" for line in reversed(text.splitlines()) if line.strip())
        (folder / f"doc{i:05d}.txt").write_text(text, encoding="utf-8")
        total += len(tokenizer(text)["input_ids"])
        i += 1
    return total


def rolling(args, folder: Path, target: int, tokenizer, others: list, first: bool = False):
    """``distperp`` in the model dtype and ``others`` (name, model, model_args; before it unless ``first``) on
    documents of about ``target`` tokens written to ``folder``: the work's label, task, rows and token count."""
    count = rolling_docs(folder / "docs", target, tokenizer)
    env = {"DISTPERP_DOCS_PATH": str(folder / "docs")}
    base = ("distperp", "distperp", f"pretrained={args.model},dtype={args.dtype},max_length={args.max_length}")
    runs = [base, *others] if first else [*others, base]
    rows = [lm_eval(args, name, model, margs, "distperp_local_docs", folder / f"run{i}", env)
            for i, (name, model, margs) in enumerate(runs)]  # fmt: skip
    return f"rolling, {count:,} tokens", "distperp_local_docs", rows, count


def lm_eval(args, name: str, model: str, model_args: str, task: str, out: Path, env: dict) -> dict:
    """One ``python -m lm_eval`` run; its wall time and results."""
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
        "--batch_size", str(args.batch_size), "--device", args.device, "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    if task == "leaderboard_mmlu_pro":
        cmd += ["--include_path", str(args.include)]
    start = time.perf_counter()
    env = environment({**NO_HUB_KERNELS, **env}, args.device)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"name": name, "failed": proc.returncode, "wall": wall}
    results = json.loads(Path(sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]).read_text())
    samples = [
        json.loads(line)
        for path in glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        for line in Path(path).read_text().splitlines()
    ]
    calls = (results["config"].get("distperp") or {}).get("calls", [])
    return {
        "name": name,
        "wall": wall,
        "request_phase": sum(c.get("total_seconds", c.get("seconds", 0.0)) for c in calls) if calls else None,
        "scored_tokens": sum(c.get("scored_tokens", 0) for c in calls) if calls else None,
        "per_doc": {s["doc_id"]: answer(task, s) for s in samples},
    }


def repeated(args, backends: tuple[str, ...], model_args: str, task: str, out: Path) -> list[dict]:
    """``--repeats`` runs of each backend, alternating which goes first; per backend the run of median wall time
    (its ``walls``: every repetition's)."""
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    for k in range(args.repeats):
        for b in backends if k % 2 == 0 else backends[::-1]:
            runs[b].append(lm_eval(args, b, b, model_args, task, out / f"{b}-{k}", {}))
    rows = []
    for b in backends:
        ordered = sorted(runs[b], key=lambda r: r["wall"])
        rows.append({**ordered[len(ordered) // 2], "walls": [round(r["wall"], 1) for r in runs[b]]})
    return rows


def answer(task: str, sample: dict):
    """A question's chosen answer index, or a document's log-likelihood."""
    first = [float(r[0] if isinstance(r, list) else r) for r in sample["filtered_resps"]]
    if task == "leaderboard_mmlu_pro":
        return max(range(len(first)), key=first.__getitem__)
    return first[0]


def agreement(task: str, row: dict, base: dict) -> str:
    if "per_doc" not in row or "per_doc" not in base:
        return "n/a"
    docs = sorted(base["per_doc"])
    if task == "leaderboard_mmlu_pro":
        same = sum(row["per_doc"].get(d) == base["per_doc"][d] for d in docs)
        return f"{same}/{len(docs)} answers equal" + ("" if same == len(docs) else " (DIFFER)")
    worst = max(abs(row["per_doc"][d] / base["per_doc"][d] - 1) for d in docs)
    return f"log-likelihood within {worst:.1e} (relative, worst document)"


def table(work: list[tuple[str, str, list[dict], int | None]]) -> str:
    lines = [
        "| work | backend | wall s | vs first row | request phase s | per wall second | agreement |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, task, rows, tokens in work:
        base = rows[0]
        for row in rows:
            if "failed" in row:
                lines.append(f"| {label} | {row['name']} | FAILED (exit {row['failed']}) | | | | |")
                continue
            phase = "n/a" if row["request_phase"] is None else f"{row['request_phase']:.1f}"
            count, unit = (tokens, "tokens") if tokens else (len(row["per_doc"]), "questions")
            rate = f"{count / row['wall']:,.1f} {unit}"
            walls = f" ({', '.join(map(str, row['walls']))})" if len(row.get("walls", ())) > 1 else ""
            lines.append(
                f"| {label} | {row['name']} | {row['wall']:.1f}{walls} | {base['wall'] / row['wall']:.2f}x | {phase} | "
                f"{rate} | {agreement(task, row, base)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", required=True, help="checkpoint folder (gpu_all.sh: gpu_check's 1B-shaped model)")
    p.add_argument("--dtype", default=None, help="model dtype of every run (cuda: bfloat16, cpu: float32)")
    p.add_argument("--questions", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=1_000_000, help="rolling work: hf vs distperp")
    p.add_argument(
        "--int4-tokens", type=int, default=262_144, help="int4 work: distperp vs int4 vs int4 with the kernel only"
    )
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", default="auto", help="both backends' --batch_size (hf: auto finds its own)")
    p.add_argument("--work-list", default="mmlu_pro,rolling,int4", help="which work to run")
    p.add_argument("--work", default=None, help="folder for data and outputs (default: a temporary one)")
    p.add_argument("--repeats", type=int, default=1, help="MMLU-Pro runs per backend, alternating (median reported)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    use_offline_env(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    root = Path(args.work or tempfile.mkdtemp(prefix="distperp-bench-cli-"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base_args = f"pretrained={args.model},dtype={args.dtype},max_length={args.max_length}"
    wanted = args.work_list.split(",")
    work = []
    if "mmlu_pro" in wanted:
        args.include = build_leaderboard_include(root / "leaderboard", docs_per_subtask=args.questions)
        rows = repeated(args, ("hf", "distperp"), base_args, "leaderboard_mmlu_pro", root / "mmlu")
        repeats = f", median of {args.repeats} alternating" if args.repeats > 1 else ""
        work.append((f"MMLU-Pro 5-shot, {args.questions} questions{repeats}", "leaderboard_mmlu_pro", rows, None))
    if "rolling" in wanted:
        work.append(rolling(args, root / "rolling", args.tokens, tokenizer, [("hf", "hf", base_args)]))
    if "int4" in wanted:
        int4 = base_args.replace(f"dtype={args.dtype}", "dtype=bfloat16")  # packed int4 needs a bf16 model
        runs = [
            ("distperp int4", "distperp", int4 + ",quantize=int4"),
            ("distperp int4 kernel", "distperp", int4 + ",quantize=int4,int4_prefill=kernel"),
        ]
        work.append(rolling(args, root / "int4", args.int4_tokens, tokenizer, runs, first=True))
    print(f"# lm_eval CLI, {args.device}, {args.dtype}, model {args.model}, batch_size {args.batch_size}")
    print(table(work))
    if args.json:
        Path(args.json).write_text(
            json.dumps([{"work": w, "tokens": n, "rows": r} for w, _, r, n in work], default=str)
        )
    return 1 if any("failed" in r for _, _, rows, _ in work for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
