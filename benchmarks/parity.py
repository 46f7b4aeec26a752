"""Agreement of ``--model distperp`` with lm-eval's ``hf`` on one checkpoint, for the three request types.

    python benchmarks/parity.py [--model ../shared/models/wt2-llama-5m] [--wikitext ../shared/data/wikitext-2/test.txt]

Runs both models in-process through ``lm_eval.simple_evaluate`` (fp32, same batch size and max_length) on the test
tasks in ``tests/tasks`` (multiple choice → loglikelihood, rolling, generate_until) and, given a WikiText file,
``distperp_wikitext2``; prints per-request maximum differences and the metrics side by side.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT.parent / "shared/models/wt2-llama-5m"))
    parser.add_argument("--wikitext", default=str(ROOT.parent / "shared/data/wikitext-2/test.txt"))
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")

    import shutil
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    include = Path(tempfile.mkdtemp(prefix="parity-tasks-"))
    shutil.copytree(ROOT / "tests" / "tasks", include / "dptest")
    shutil.copytree(ROOT / "tasks" / "distperp", include / "distperp")
    tasks = ["dptest_mc", "dptest_rolling", "dptest_gen"]
    metadata = {}
    if args.wikitext and Path(args.wikitext).exists():
        tasks.append("distperp_wikitext2")
        metadata["wikitext_path"] = args.wikitext
    runs = {}
    for model in ("hf", "distperp"):
        runs[model] = lm_eval.simple_evaluate(
            model=model,
            model_args=f"pretrained={args.model},max_length={args.max_length},dtype=float32",
            tasks=tasks,
            task_manager=TaskManager(include_path=str(include), metadata=metadata),
            batch_size=args.batch_size,
            device="cpu",
            log_samples=True,
            limit=args.limit,
        )

    def samples(model, task):
        return {s["doc_id"]: s for s in runs[model]["samples"][task]}

    report = {}
    for task in tasks:
        hf, dp = samples("hf", task), samples("distperp", task)
        if task == "dptest_gen":
            same = sum(hf[i]["resps"] == dp[i]["resps"] for i in hf)
            report[task] = {"generations identical": f"{same}/{len(hf)}"}
            continue
        if task == "dptest_mc":
            diffs = [abs(float(a[0][0]) - float(b[0][0])) for i in hf for a, b in zip(hf[i]["resps"], dp[i]["resps"])]
            greedy = all(a[0][1] == b[0][1] for i in hf for a, b in zip(hf[i]["resps"], dp[i]["resps"]))
            report[task] = {
                "max abs diff": max(diffs),
                "greedy flags equal": greedy,
                "acc": (runs["hf"]["results"][task]["acc,none"], runs["distperp"]["results"][task]["acc,none"]),
                "acc_norm": (
                    runs["hf"]["results"][task]["acc_norm,none"],
                    runs["distperp"]["results"][task]["acc_norm,none"],
                ),
            }
            continue
        rel = [
            abs(float(hf[i]["resps"][0][0]) - float(dp[i]["resps"][0][0])) / abs(float(hf[i]["resps"][0][0]))
            for i in hf
        ]
        report[task] = {"max rel diff per document": max(rel)}
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            a = runs["hf"]["results"][task][f"{metric},none"]
            b = runs["distperp"]["results"][task][f"{metric},none"]
            report[task][metric] = (a, b, abs(a - b) / abs(a))
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
