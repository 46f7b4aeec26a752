"""``batch_invariant=true`` on this machine's device: per-document results at ``batch_size`` 1, 3, 8 and ``auto``
must be the same bits; the default mode is shown beside it (its results may move with the batch size).

    python benchmarks/invariance_check.py --device cuda [--model DIR --dtype bfloat16]
    python benchmarks/invariance_check.py --device cpu          # dry mode (gpu_all.sh --device cpu)

Without ``--model`` the test model (random, tiny) is built under ``--work``. Tasks: the test tasks in ``tests/tasks``
(rolling windows, multiple choice in tree rows, few-shot multiple choice sharing a prefix, generation). Prints one
row per mode and batch size with the documents equal to ``batch_size=1`` of the same mode; an invariant row with a
difference prints DIFFER (``gpu_all.sh`` fails on it) and the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TASKS = ["dptest_rolling", "dptest_mc", "dptest_fewshot", "dptest_gen"]
SIZES = ("1", "3", "8", "auto")


def _per_doc(samples: dict) -> dict[str, dict[int, list]]:
    return {task: {r["doc_id"]: [repr(resp[0]) for resp in r["resps"]] for r in rows} for task, rows in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a local HF folder (default: the tiny test model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--work", default=None)
    args = parser.parse_args(argv)

    import lm_eval
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model

    work = Path(args.work or tempfile.mkdtemp(prefix="distperp-invariance-"))
    model = args.model or str(build_tiny_model(TEST_SPEC, work / "tiny"))
    manager = TaskManager(include_path=str(REPO / "tests" / "tasks"))
    runs = {}
    for mode, extra in (("invariant", ",batch_invariant=true"), ("default", "")):
        for bs in SIZES:
            out = lm_eval.simple_evaluate(
                model="distperp",
                model_args=f"pretrained={model},max_length=128,dtype={args.dtype}{extra}",
                tasks=TASKS,
                task_manager=manager,
                batch_size=bs,
                device=args.device,
                log_samples=True,
            )
            runs[(mode, bs)] = (_per_doc(out["samples"]), out["config"]["distperp"]["fingerprint"])
    print(f"| mode | batch_size | {' | '.join(TASKS)} | fingerprint | verdict |")
    print(f"|---|---|{'---:|' * len(TASKS)}---|---|")
    failed = False
    for mode in ("invariant", "default"):
        one = runs[(mode, "1")][0]
        for bs in SIZES:
            docs, fingerprint = runs[(mode, bs)]
            equal = [sum(one[t][d] == docs[t][d] for d in one[t]) for t in TASKS]
            same = all(e == len(one[t]) for e, t in zip(equal, TASKS))
            verdict = "same bits" if same else ("DIFFER" if mode == "invariant" else "moves with the batch size")
            failed |= mode == "invariant" and not same
            cells = " | ".join(f"{e}/{len(one[t])}" for e, t in zip(equal, TASKS))
            print(f"| {mode} | {bs} | {cells} | {fingerprint} | {verdict} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
