"""Batch invariance: with ``batch_invariant=true`` every document's results are the same bits at every batch size
(on this machine's device); ``batch_invariant=false`` is shown beside it (its results may move with the batch size),
and ``--cost-repeats`` measures what invariance costs.

    python -m benchmarks.invariance_check --device cuda [--model DIR --dtype bfloat16]
    python -m benchmarks.invariance_check --device cpu          # dry mode (gpu_all.sh --device cpu)
    python -m benchmarks.invariance_check --device cpu --suite leaderboard --sizes 1,auto --cost-repeats 3 \\
        --model ~/.cache/distperp/smollm2-135m-instruct        # the real model's cost (was batch_invariance.py)

Suites (``--suite``):

* ``test`` (default): the test tasks in ``tests/tasks`` (rolling windows, multiple choice in tree rows, few-shot
  multiple choice sharing a prefix, generation), ``max_length`` 128;
* ``leaderboard``: lm-eval's own leaderboard YAMLs on local data (:mod:`benchmarks._leaderboard_data`): MMLU-Pro
  (5-shot, tree rows with a shared prefix), MuSR (long narratives), a MATH-hard subtask (generation,
  ``--max-gen-toks``), with the chat template as the leaderboard runs them, plus ``distperp_wikitext2`` (rolling
  windows) on WikiText-2 (``../shared``); ``--docs`` documents per subtask, ``--wikitext-docs`` the limit of every
  task; ``max_length`` 512.

Without ``--model`` the test model (random, tiny) is built under ``--work``. Each mode and batch size of ``--sizes``
gets its own model, built in this process. Prints one row per mode and batch size: per task the documents equal to
``batch_size=1`` of the same mode (with the largest log-likelihood difference where some differ), the largest
difference of the row (nats), the run's fingerprint and a verdict. An invariant row with a difference prints DIFFER
(``gpu_all.sh`` fails on it) and the script exits 1.

``--cost-repeats N``: then the wall seconds inside ``loglikelihood``/``loglikelihood_rolling`` and ``generate_until``
at each batch size of ``--cost-sizes`` (default ``auto``), ``false`` against invariant, alternating which goes first,
medians of ``N``, and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import TEST_TASKS, WIKITEXT_TEST, lm_eval_model, use_offline_env, write_sample_copies
from benchmarks.leaderboard import PLAIN_CHAT_TEMPLATE, Timer  # Timer: seconds inside each request method
from distperp_harness.commands.samples import responses_by_doc

SUITES = {
    "test": ["dptest_rolling", "dptest_mc", "dptest_fewshot", "dptest_gen"],
    "leaderboard": [
        "leaderboard_mmlu_pro",
        "leaderboard_musr",
        "leaderboard_math_algebra_hard",
        "distperp_wikitext2",
    ],
}
"""The tasks of each ``--suite`` (a group's subtasks get their own columns)."""
MODES = {"invariant": ",batch_invariant=true", "false": ",batch_invariant=false"}
"""The two modes compared (the default, ``auto``, is ``true`` on a CPU whose kernels pass its check)."""
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def _per_doc(samples: dict) -> dict[str, dict[int, list]]:
    """``{task: {doc_id: [first response of each request]}}``."""
    return {task: responses_by_doc(rows) for task, rows in samples.items()}


def _lls(responses: list) -> list[float]:
    return [float(r[0] if isinstance(r, (list, tuple)) else r) for r in responses if not isinstance(r, str)]


def _compare(one: dict[int, list], other: dict[int, list]) -> tuple[int, float]:
    """(documents whose responses are the same bits, largest log-likelihood difference in nats)."""
    equal, worst = 0, 0.0
    for doc, resp in one.items():
        if [repr(r) for r in resp] == [repr(r) for r in other[doc]]:
            equal += 1
        else:
            worst = max([worst, *(abs(a - b) for a, b in zip(_lls(resp), _lls(other[doc])))])
    return equal, worst


def _columns(names, suite: list[str]) -> list[str]:
    """Task columns in the suite's order, a group's subtasks together."""
    rank = {t: next((i for i, p in enumerate(suite) if t.startswith(p)), len(suite)) for t in names}
    return sorted(names, key=lambda t: (rank[t], t))


def _evaluate(lm, args: argparse.Namespace, manager) -> tuple[dict[str, dict[int, list]], str]:
    """One ``simple_evaluate`` of the suite on ``lm``: its responses per task and document, and the fingerprint."""
    import lm_eval

    suite = {}
    if args.suite == "leaderboard":
        suite = dict(
            apply_chat_template=True,
            fewshot_as_multiturn=True,
            gen_kwargs=f"max_gen_toks={args.max_gen_toks}",
            limit=args.wikitext_docs,  # caps WikiText's documents; the leaderboard tasks hold --docs <= it
        )
    out = lm_eval.simple_evaluate(model=lm, tasks=SUITES[args.suite], task_manager=manager, log_samples=True, **suite)
    return _per_doc(out["samples"]), out["config"]["distperp"]["fingerprint"]


def _task_manager(args: argparse.Namespace, work: Path):
    from lm_eval.tasks import TaskManager

    if args.suite == "test":
        return TaskManager(include_path=str(TEST_TASKS))
    from benchmarks._leaderboard_data import build_leaderboard_include

    text = WIKITEXT_TEST if WIKITEXT_TEST.exists() else None
    folder = build_leaderboard_include(work / "leaderboard", args.docs, text_path=text)
    if text is None:  # no ../shared: the packaged sample, in copies, as gpu_all.sh does
        (work / "wikitext-2").mkdir(parents=True, exist_ok=True)
    wikitext = text or write_sample_copies(work / "wikitext-2" / "test.txt")
    return TaskManager(include_path=str(folder), metadata={"wikitext_path": str(wikitext)})


def _table(runs: dict, suite: list[str]) -> tuple[list[str], bool]:
    """The table's lines and whether an invariant row differs."""
    failed = False
    first = runs[next(iter(runs))][0]
    tasks = _columns(first, suite)
    lines = [
        f"| mode | batch_size | {' | '.join(tasks)} | largest difference (nats) | fingerprint | verdict |",
        f"|---|---|{'---:|' * len(tasks)}---:|---|---|",
    ]
    for mode, bs in runs:
        one = runs[(mode, "1")][0]
        docs, fingerprint = runs[(mode, bs)]
        compared = [_compare(one[t], docs[t]) for t in tasks]
        same = all(e == len(one[t]) for (e, _), t in zip(compared, tasks))
        verdict = "same bits" if same else ("DIFFER" if mode == "invariant" else "moves with the batch size")
        failed |= mode == "invariant" and not same
        cells = " | ".join(
            f"{e}/{len(one[t])}" + ("" if e == len(one[t]) else f" ({w:.2e})") for (e, w), t in zip(compared, tasks)
        )
        worst = max((w for _, w in compared), default=0.0)
        lines.append(f"| {mode} | {bs} | {cells} | {worst:.2e} | {fingerprint} | {verdict} |")
    return lines, failed


def _cost(lms: dict, timers: dict, args: argparse.Namespace, manager, size: str = "auto") -> list[str]:
    """Wall seconds inside the request methods at ``batch_size=size``, ``false`` against invariant (module doc)."""
    seconds: dict[str, list[dict[str, float]]] = {"false": [], "invariant": []}
    tokens: dict[str, dict[str, int]] = {}
    for rep in range(args.cost_repeats):
        for mode in ("false", "invariant") if rep % 2 == 0 else ("invariant", "false"):
            timers[mode].reset()
            before = len(lms[mode].stats.calls)
            _evaluate(lms[mode], args, manager)
            seconds[mode].append(dict(timers[mode].seconds))
            tokens[mode] = _tokens_computed(lms[mode].stats.calls[before:])
    lines = [
        f"| batch_size={size}, median of {args.cost_repeats} | false s | invariant s | invariant / false "
        "| tokens computed, false | invariant |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, kinds in (("scoring", KINDS[:2]), ("generation", KINDS[2:]), ("all", KINDS)):
        d = statistics.median(sum(s[k] for k in kinds) for s in seconds["false"])
        i = statistics.median(sum(s[k] for k in kinds) for s in seconds["invariant"])
        counts = " | ".join(str(tokens.get(m, {}).get(label, "n/a")) for m in ("false", "invariant"))
        lines.append(f"| {label} | {d:.1f} | {i:.1f} | {f'{i / d:.2f}x' if d else 'n/a'} | {counts} |")
    return lines


def _tokens_computed(calls: list) -> dict[str, int]:
    """Positions the model computed in ``calls`` (one evaluation): scoring's computed tokens, generation's prefill
    and decode positions (pads included), and their sum."""
    scoring = sum(getattr(c, "computed_tokens", 0) for c in calls if c.kind != "generate_until")
    generation = sum(c.prefill_positions + c.decode_positions for c in calls if c.kind == "generate_until")
    return {"scoring": scoring, "generation": generation, "all": scoring + generation}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a local HF folder (default: the tiny test model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--work", default=None, help="folder for the built model and data (default: a temporary one)")
    parser.add_argument("--suite", default="test", choices=tuple(SUITES))
    parser.add_argument("--sizes", default="1,3,8,auto", help="batch sizes, comma-separated; 1 is always run")
    parser.add_argument("--max-length", type=int, default=None, help="default: test 128, leaderboard 512")
    parser.add_argument("--docs", type=int, default=2, help="leaderboard: documents per subtask")
    parser.add_argument("--wikitext-docs", type=int, default=3, help="leaderboard: also the limit of every task")
    parser.add_argument("--max-gen-toks", type=int, default=64, help="leaderboard: new tokens at most")
    parser.add_argument("--cost-repeats", type=int, default=0, help="time default vs invariant, N times each")
    parser.add_argument("--cost-sizes", default="auto", help="batch sizes the cost is timed at, comma-separated")
    args = parser.parse_args(argv)
    if args.docs > args.wikitext_docs:
        parser.error(f"--docs {args.docs} must be at most --wikitext-docs {args.wikitext_docs} (it caps every task)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.sizes = ["1", *(s for s in sizes if s != "1")]
    args.max_length = args.max_length or (128 if args.suite == "test" else 512)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_offline_env(args.device)
    from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model

    work = Path(args.work or tempfile.mkdtemp(prefix="distperp-invariance-"))
    model = args.model or str(build_tiny_model(TEST_SPEC, work / "tiny"))
    manager = _task_manager(args, work)
    base = f"pretrained={model},max_length={args.max_length},dtype={args.dtype}"
    cls = lm_eval_model("distperp")
    plain = []

    def build(extra: str, bs: str):
        lm = cls.create_from_arg_string(base + extra, {"batch_size": bs, "device": args.device})
        if args.suite == "leaderboard" and getattr(lm.tokenizer, "chat_template", None) is None:
            lm.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE  # as leaderboard.py frames a model without one
            plain.append(bs)
        return lm

    runs = {}
    for mode, extra in MODES.items():
        for bs in args.sizes:
            lm = build(extra, bs)
            runs[(mode, bs)] = _evaluate(lm, args, manager)
            del lm
            gc.collect()
    lines, failed = _table(runs, SUITES[args.suite])
    if plain:
        print("(the model has no chat template: a plain 'role: text' frame is used, as leaderboard.py does)\n")
    print("\n".join(lines))
    for size in [s.strip() for s in args.cost_sizes.split(",") if s.strip()] if args.cost_repeats else []:
        kept = {mode: build(extra, size) for mode, extra in MODES.items()}
        for lm in kept.values():
            _evaluate(lm, args, manager)  # warm-up
        timers = {mode: Timer(lm, KINDS) for mode, lm in kept.items()}
        print("\n" + "\n".join(_cost(kept, timers, args, manager, size)), flush=True)
        del kept, timers
        gc.collect()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
