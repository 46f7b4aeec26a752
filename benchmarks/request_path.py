"""The request path of a ``loglikelihood`` call outside the model's forwards, per request: the CPU proxy of what a
GPU waits for (tokenizing, planning, gathering, building results).

    python -m benchmarks.request_path                                     # the tiny test model
    python -m benchmarks.request_path --model ~/.cache/distperp/smollm2-135m-instruct --questions 100

Work: MMLU-Pro-shaped requests (``--shots`` exemplars of ~120 words each shared by every question, a question,
``--options`` answers of a few words each), as lm-eval builds them (one ``Instance`` per answer), through the real
``DistPerpLM.loglikelihood`` in one process; ``--repeats`` times, median. Reported:

* *requests/s* of the whole call, and *outside batches ms per request*: the call's wall time minus the time spent
  scoring its batches (forwards and log-probabilities, ``Executor.score``): tokenizing, planning, gathering and
  building results, what a GPU waits for;
* *tokenizer requests/s*: the call's tokenization alone, as the call does it (``pre_encode`` in batches, the
  shared few-shot block tokenized once, then ``tok_encode`` from the memo), against the same batches of whole
  strings and against one ``tok_encode`` per string (the strings lm-eval asks for, each distinct string once),
  with the ids checked equal. The call itself runs both ways too (shared prefix once, whole strings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import WIKITEXT_TEST, lm_eval_model


def _words() -> list[str]:
    if WIKITEXT_TEST.exists():
        return WIKITEXT_TEST.read_text(encoding="utf-8").split()
    from distperp_harness.commands.tiny import sample_text

    return sample_text().split() * 8


def mmlu_pro_requests(questions: int, shots: int, options: int) -> list:
    """``(context, continuation)`` Instances shaped like lm-eval's MMLU-Pro 5-shot (exemplars shared by all)."""
    from lm_eval.api.instance import Instance

    words = _words()
    exemplars = "".join(
        f"Question: {' '.join(words[400 * k : 400 * k + 100])}?\nAnswer: Let's think step by step. "
        f"{' '.join(words[400 * k + 100 : 400 * k + 120])}. The answer is (B).\n\n"
        for k in range(shots)
    )
    out = []
    for q in range(questions):
        start = 20000 + 150 * q
        context = f"{exemplars}Question: {' '.join(words[start : start + 60])}?\nAnswer:"
        for o in range(options):
            answer = " " + " ".join(words[start + 60 + 3 * o : start + 63 + 3 * o])
            out.append(Instance("loglikelihood", {}, (context, answer), len(out)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a causal LM folder (default: the tiny test model)")
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--options", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    from distperp_harness.planning import encoding
    from distperp_harness.tokens import loglikelihood_strings

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model

            path = str(build_tiny_model(TEST_SPEC, Path(tmp) / "tiny"))
        lm = lm_eval_model("distperp").create_from_arg_string(
            f"pretrained={path},max_length=2048,device=cpu", {"batch_size": args.batch_size}
        )
    inside = [0.0]
    score = lm.executor.score

    def timed(*args, **kwargs):  # one scoring batch: its forwards and log-probabilities
        t0 = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    lm.executor.score = timed
    requests = mmlu_pro_requests(args.questions, args.shots, args.options)
    keys = list(dict.fromkeys(loglikelihood_strings(r.args for r in requests)))

    def batched() -> list:
        with lm.one_call():  # the call's memo, as loglikelihood opens it
            lm.pre_encode(keys)
            return [lm.tok_encode(*key) for key in keys]

    def one_by_one() -> list:
        return [lm.tok_encode(*key) for key in keys]

    def whole_strings(fn):  # the same, without tokenizing a shared prefix once
        def run():
            kept, encoding.MIN_GROUP = encoding.MIN_GROUP, 1 << 62
            try:
                return fn()
            finally:
                encoding.MIN_GROUP = kept

        return run

    def call() -> None:
        lm.loglikelihood(requests, disable_tqdm=True)

    if not batched() == whole_strings(batched)() == one_by_one():
        print("token ids DIFFER between batched and one-by-one tokenization")
        return 1
    sides = {"shared": batched, "whole": whole_strings(batched), "single": one_by_one}
    calls = {"shared": call, "whole": whole_strings(call)}
    tok: dict = {name: [] for name in sides}
    walls: dict = {name: [] for name in calls}
    outside: dict = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            tok[name].append(time.perf_counter() - t0)
        for name, fn in calls.items():
            inside[0] = 0.0
            t0 = time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - t0)
            outside[name].append(walls[name][-1] - inside[0])
    n = len(requests)
    print(
        f"model {Path(path).name if args.model else 'tiny test model'}, {args.questions} questions x {args.options} "
        f"options, {args.shots}-shot ({n} requests, {len(keys)} distinct strings), CPU, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}, median of {args.repeats}\n"
    )
    print("| measure | shared prefix once (as the call does) | whole strings |\n|---|---:|---:|")
    print(f"| loglikelihood call, requests/s | {n / statistics.median(walls['shared']):,.0f} | "
          f"{n / statistics.median(walls['whole']):,.0f} |")  # fmt: skip
    print(f"| outside batches, ms per request | {statistics.median(outside['shared']) / n * 1e3:.3f} | "
          f"{statistics.median(outside['whole']) / n * 1e3:.3f} |")  # fmt: skip
    share = {k: statistics.median(o / w for o, w in zip(outside[k], walls[k])) for k in calls}
    print(f"| outside batches, share of the call | {share['shared']:.1%} | {share['whole']:.1%} |")
    print(f"| tokenizer requests/s, batched | {n / statistics.median(tok['shared']):,.0f} | "
          f"{n / statistics.median(tok['whole']):,.0f} |")  # fmt: skip
    print(f"| tokenizer requests/s, one encode per string | {n / statistics.median(tok['single']):,.0f} | |")
    print("\ntoken ids: batched equal to one by one (shared prefix once and whole strings alike)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
