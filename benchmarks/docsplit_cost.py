"""What distperp's document split costs a rank at MMLU size (docs/scale.md: "Document splitting").

A synthetic task in a temporary folder: 14,042 documents of MMLU-like length (a 40-80 word question, four 3-10 word
choices, MMLU's prompt template), multiple choice with 4 choices, 5-shot from a 285-document dev split with lm-eval's
default random sampler. Times, in one process, lm-eval's ``build_all_requests`` for every document (what each rank
now pays when the wrapper acts) against a 1/64 share (what lm-eval builds per rank at 64 ranks), and the whole
``docsplit.build_split`` for one rank of 64 (``--split``); medians; then the memory the built instances hold (with
the documents they reference, each object counted once) and the growth of the process's peak RSS.

    python -m benchmarks.docsplit_cost [--docs 14042] [--ranks 64] [--repeats 3] [--full-repeats 3] [--split]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "what",
    "no",
    "more",
    "can",
    "who",
    "will",
    "out",
    "up",
    "about",
    "into",
    "them",
    "then",
    "other",
    "than",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "any",
    "time",
    "only",
    "new",
    "very",
    "people",
    "like",
    "energy",
    "cell",
    "market",
    "law",
    "court",
    "theory",
    "river",
    "acid",
    "enzyme",
    "value",
    "function",
]


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_docs(folder: Path, n: int, seed: int = 0) -> dict[str, Path]:
    rng = random.Random(seed)
    paths = {}
    for split, count in (("test", n), ("dev", 285)):
        rows = [
            {
                "question": _text(rng, 40, 80) + "?",
                "choices": [_text(rng, 3, 10) for _ in range(4)],
                "answer": rng.randrange(4),
            }
            for _ in range(count)
        ]
        paths[split] = folder / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def make_task(paths: dict[str, Path]):
    import datasets
    from lm_eval.api.task import ConfigurableTask

    def load(**_):
        return datasets.DatasetDict(
            {
                split: datasets.Dataset.from_list([json.loads(line) for line in path.read_text().splitlines()])
                for split, path in paths.items()
            }
        )

    task = ConfigurableTask(
        config={
            "task": "synthetic_mmlu",
            "dataset_path": "",
            "custom_dataset": load,
            "output_type": "multiple_choice",
            "test_split": "test",
            "fewshot_split": "dev",
            "num_fewshot": 5,
            "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
            "D. {{choices[3]}}\nAnswer:",
            "doc_to_choice": ["A", "B", "C", "D"],
            "doc_to_target": "answer",
            "description": "The following are multiple choice questions (with answers) about synthetic text.\n\n",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    )
    task.set_fewshot_seed(1234)
    return task


def timed(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def deep_bytes(instances) -> int:
    """Bytes of the instances and everything they reference (arguments, documents), each object counted once."""
    seen, stack, total = set(), list(instances), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.append(obj.__dict__)
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=14042)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="builds of a 1/ranks share timed (median)")
    parser.add_argument("--full-repeats", type=int, default=3, help="builds of all documents timed (median)")
    parser.add_argument("--split", action="store_true", help="also time docsplit.build_split for one rank")
    args = parser.parse_args(argv)
    import lm_eval.api.task as task_module

    from distperp_harness.docsplit import build_split

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    task_module.tqdm = lambda it, **_: it  # no progress bars in the timings
    build = task_module.Task.build_all_requests
    build = getattr(build, "__wrapped__", build)
    with tempfile.TemporaryDirectory() as tmp:
        task = make_task(write_docs(Path(tmp), args.docs))

        def build_all():
            task.set_fewshot_seed(1234)
            build(task, rank=0, world_size=1)

        def share():
            task.set_fewshot_seed(1234)
            build(task, rank=5, world_size=args.ranks)

        share_s = timed(share, args.repeats)
        share_instances, share_bytes = len(task.instances), deep_bytes(task.instances)
        task._instances = None
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        all_s = timed(build_all, args.full_repeats)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        n_instances, all_bytes = len(task.instances), deep_bytes(task.instances)
        prompt = task.instances[-1].arguments[0]
        if args.split:
            t0 = time.perf_counter()
            task.set_fewshot_seed(1234)
            build_split(task, build, rank=5, world_size=args.ranks)
            split_s = time.perf_counter() - t0
            assert len(task.instances) == share_instances
    print(
        f"synthetic MMLU: {args.docs} docs, 4 choices, 5-shot (default random sampler); prompt "
        f"{len(prompt)} chars (last document)"
    )
    print(
        f"build_all_requests, all documents ({n_instances} instances): {all_s:.2f} s "
        f"({1e3 * all_s / args.docs:.2f} ms/doc); median of {args.full_repeats}"
    )
    print(
        f"build_all_requests, 1/{args.ranks} share ({share_instances} instances): {share_s:.3f} s; "
        f"median of {args.repeats}"
    )
    if args.split:
        print(f"docsplit.build_split, one rank of {args.ranks} (all built, its share kept): {split_s:.2f} s")
    print(
        f"instances with their documents: all {all_bytes / 2**20:.1f} MiB, 1/{args.ranks} share "
        f"{share_bytes / 2**20:.2f} MiB; peak RSS grew {(rss1 - rss0) / 1024:.0f} MiB during the full builds "
        f"(to {rss1 / 1024:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
