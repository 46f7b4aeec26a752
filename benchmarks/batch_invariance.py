"""What ``batch_invariant=true`` costs on a real model, and whether results move with the batch size without it.

    python benchmarks/batch_invariance.py --model ~/.cache/distperp/smollm2-135m-instruct --docs 2 --repeats 3

Tasks: lm-eval's own leaderboard YAMLs on local data (:mod:`leaderboard_data`): MMLU-Pro (5-shot, tree rows with a
shared prefix), MuSR (long narratives), a MATH-hard subtask (generation, ``--max-gen-toks``), with the chat
template as the leaderboard runs them, plus ``distperp_wikitext2`` (rolling windows) on WikiText-2. Four models are
built once in this process: the default mode and ``batch_invariant=true``, each at ``batch_size=auto`` and at 1.

Prints (1) per task, the documents whose results differ from ``batch_size=1`` in each mode, and the largest
log-likelihood difference; (2) the wall seconds inside ``loglikelihood``/``loglikelihood_rolling`` and
``generate_until`` at ``batch_size=auto``, default against invariant, alternating which goes first, medians of
``--repeats``, and the ratio (the cost of the option).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from leaderboard import Timer  # seconds inside each request method
from leaderboard_data import build_leaderboard_include

TASKS = ["leaderboard_mmlu_pro", "leaderboard_musr", "leaderboard_math_algebra_hard", "distperp_wikitext2"]
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


def _per_doc(samples: dict) -> dict[str, dict[int, list]]:
    """``{task: {doc_id: [first response per request]}}``."""
    return {task: {r["doc_id"]: [resp[0] for resp in r["resps"]] for r in rows} for task, rows in samples.items()}


def _lls(responses: list) -> list[float]:
    return [float(r[0] if isinstance(r, (list, tuple)) else r) for r in responses if not isinstance(r, str)]


def _differ(one: dict, other: dict) -> tuple[int, int, float]:
    """(documents that differ, documents, largest log-likelihood difference)."""
    worst, n = 0.0, 0
    for doc, resp in one.items():
        if resp != other[doc]:
            n += 1
            worst = max([worst, *(abs(a - b) for a, b in zip(_lls(resp), _lls(other[doc])))])
    return n, len(one), worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local HF folder (SmolLM2: see ../shared/models/*/README)")
    parser.add_argument("--docs", type=int, default=2, help="documents per leaderboard subtask")
    parser.add_argument("--wikitext-docs", type=int, default=3, help="also the limit of every task")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-gen-toks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.docs > args.wikitext_docs:
        parser.error("--docs must be at most --wikitext-docs (lm-eval's limit caps every task)")

    import lm_eval
    from lm_eval.tasks import TaskManager

    from distperp_harness.lm import DistPerpLM

    work = Path(tempfile.mkdtemp(prefix="distperp-invariance-"))
    folder = build_leaderboard_include(work, args.docs, text_path=WIKITEXT if WIKITEXT.exists() else None)
    manager = TaskManager(include_path=str(folder), metadata={"wikitext_path": str(WIKITEXT)})
    base = f"pretrained={args.model},max_length={args.max_length},dtype=float32,device=cpu"
    lms = {
        (mode, bs): DistPerpLM(**dict(kv.split("=") for kv in (base + extra).split(",")), batch_size=bs)
        for mode, extra in (("default", ""), ("invariant", ",batch_invariant=true"))
        for bs in ("auto", 1)
    }
    timers = {key: Timer(lm, KINDS) for key, lm in lms.items()}

    def evaluate(key):
        out = lm_eval.simple_evaluate(
            model=lms[key],
            tasks=TASKS,
            task_manager=manager,
            apply_chat_template=True,
            fewshot_as_multiturn=True,
            log_samples=True,
            gen_kwargs=f"max_gen_toks={args.max_gen_toks}",
            limit=args.wikitext_docs,  # caps WikiText's documents; the leaderboard tasks hold --docs <= it
        )
        return _per_doc(out["samples"])

    results = {key: evaluate(key) for key in lms}  # also the warm-up of every model
    print("| task | mode | documents differing from batch_size=1 | largest difference (nats) |\n|---|---|---:|---:|")
    for task in sorted(results[("default", 1)]):  # subtasks: the samples of a group are its tasks'
        for mode in ("default", "invariant"):
            n, total, worst = _differ(results[(mode, 1)][task], results[(mode, "auto")][task])
            print(f"| {task} | {mode} | {n} of {total} | {worst:.2e} |")

    seconds: dict[str, list[dict[str, float]]] = {"default": [], "invariant": []}
    for rep in range(args.repeats):
        order = ("default", "invariant") if rep % 2 == 0 else ("invariant", "default")
        for mode in order:
            timer = timers[(mode, "auto")]
            timer.reset()
            evaluate((mode, "auto"))
            seconds[mode].append(dict(timer.seconds))
    print(f"\n| batch_size=auto, median of {args.repeats} | default s | invariant s | invariant / default |")
    print("|---|---:|---:|---:|")
    for label, kinds in (("scoring", KINDS[:2]), ("generation", KINDS[2:]), ("all", KINDS)):
        d = statistics.median(sum(s[k] for k in kinds) for s in seconds["default"])
        i = statistics.median(sum(s[k] for k in kinds) for s in seconds["invariant"])
        print(f"| {label} | {d:.1f} | {i:.1f} | {i / d:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
