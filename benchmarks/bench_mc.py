"""Multiple-choice scoring speed: lm-eval's ``hf`` vs ``distperp`` (shared rows) vs ``distperp share_prefix=false``.

    python -m benchmarks.bench_mc --threads 1          # wt2-llama-5m, WikiText-2 valid, 3 shapes: ~10 min
    python -m benchmarks.bench_mc --shapes hellaswag --repeats 2 --scorers hf,distperp
    python -m benchmarks.bench_mc --random-shape llama-1b --device cuda --dtype float32 --questions 50 --repeats 1
    python -m benchmarks.bench_mc --random-shape gemma3-270m --shapes mmlupro5 --batch-size 4 --share-model

Shapes (questions cut from WikiText-2 valid, ``../shared/data/wikitext-2/valid.txt``, read at run time; or the
shipped sample with ``--text``), as ``loglikelihood`` requests ``(context, continuation)``:

* ``mmlu0``: a ~95-token stem and four ~8-token options listed in the prompt (``A. ...`` .. ``D. ...`` then
  ``Answer:``), continuations ``" A"`` .. ``" D"`` (one token each for most tokenizers): every answer of a question
  has the same model input, which ``hf`` (its ``logits_cache``) and distperp both compute once;
* ``mmlu5``: the same with five solved questions before it (``fewshot_delimiter`` ``"\\n\\n"``);
* ``hellaswag``: a ~90-token context and four ~15-token endings: distperp computes the context once (a tree row);
* leaderboard few-shot shapes (lm-eval's ``fewshot_config: sampler: first_n``: every question of the task gets the same
  solved examples, so every prompt starts with the same block), with their templates' layout:
  ``mmlupro5`` (MMLU-Pro 5-shot, leaderboard template: ``Question: ...\nOptions:\nA. ..`` to ``J.``, answers ``" A"``
  .. ``" J"``; ~840-token prompts, ~700 shared), ``mmlu3`` (MMLU 3-shot, default template with its subject line;
  ~710 / ~530), ``bbh3`` (BBH 3-shot, leaderboard template, answers ``" (A)"`` .. ``" (D)"``, several tokens each;
  ~360 / ~260).

Each repeat runs every scorer once on the same ``Instance`` objects (in-process, built with lm-eval's registry, as
``bench_scoring`` does), in an order rotated per repeat. Scoring time is the wall time of
``lm.loglikelihood(requests)`` (tokenization included, start-up not); tokens/s counts the tokens of all requests
(context + continuation, each answer on its own: the unshared work), the same numerator for every scorer. The table
gives the best repeat (interference on a shared machine only slows runs down) and the median ratios; it also checks
that distperp's chosen answers equal ``hf``'s and gives the largest log-likelihood difference.

``hf``'s tokens computed are counted by a forward pre-hook on its model's body (every row of every forward, pads
included); distperp's come from its call records. The scoring paths distperp's probe decided are listed under the
table.

``--device cuda`` / ``--dtype``: every scorer on ``cuda:0`` in that dtype (lm-eval ``hf`` takes both too).
``--random-shape NAME``: a random-init model of ``_scoring_common.RANDOM_SHAPES`` (``llama-1b``: Llama-3.2-1B's shape;
``tiny``: the test model's; the families ``gemma3-270m``, ``qwen3-0.6b``, ``granite-3-2b``, ``gpt-oss-scaled`` and
their ``tiny-*`` variants), built once into ``--workdir``. ``--share-model``: the weights loaded once, the same
model object given to every scorer (one copy in memory: the 2.5B Granite in float32 fits a 24 GiB machine). Exits 1
when a scorer's chosen answers differ from
``hf``'s in float32 (a failed check); in bfloat16/float16 ``hf`` sums log-probs in that dtype, so near-ties of a
random model may flip: the count is reported, not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._scoring_common import (
    RANDOM_SHAPES,
    Counter,
    _quiet,
    device_name,
    load_model,
    machine,
    make_lm,
    probe_decision,
    resolve_model,
)
from benchmarks.common import SHARED_MODEL, WIKITEXT_VALID, use_offline_env

SCORERS = {"hf": ("hf", ""), "distperp": ("distperp", ""), "unshared": ("distperp", ",share_prefix=false")}
LABELS = {"hf": "lm-eval hf", "distperp": "distperp (shared rows)", "unshared": "distperp share_prefix=false"}
SHAPES = {"mmlu0": 300, "mmlu5": 50, "hellaswag": 300, "mmlupro5": 100, "mmlu3": 100, "bbh3": 150}
"""Shape name → default number of questions (sized so one scorer call takes seconds, not minutes, on 2 cores)."""


def _pieces(ids: list[int], decode, count: int, length: int, start: int = 0) -> list[str]:
    return [decode(ids[start + i * length : start + (i + 1) * length]).strip() for i in range(count)]


def build_questions(shape: str, ids: list[int], decode, n: int) -> list[tuple[list[tuple[str, str]], int]]:
    """``n`` questions of ``shape``: per question its four ``(context, continuation)`` pairs and the gold index."""
    letters = "ABCD"
    if shape == "hellaswag":
        out = []
        for q in range(n):
            context = decode(ids[q * 150 : q * 150 + 90]).strip()  # a 90-token context, four 15-token endings
            endings = _pieces(ids, decode, 4, 15, start=q * 150 + 90)
            out.append(([(context, " " + e) for e in endings], q % 4))
        return out
    if shape in FIRST_N:
        return _first_n_questions(FIRST_N[shape], ids, decode, n)
    shots = 5 if shape == "mmlu5" else 0

    def prompt(k: int) -> str:
        stem = decode(ids[k * 130 : k * 130 + 95]).strip()
        options = _pieces(ids, decode, 4, 8, start=k * 130 + 95)
        return stem + "".join(f"\n{letters[j]}. {o}" for j, o in enumerate(options)) + "\nAnswer:"

    out = []
    for q in range(n):
        k = q * (shots + 1)
        examples = "".join(f"{prompt(k + s)} {letters[(k + s) % 4]}\n\n" for s in range(shots))
        context = examples + prompt(k + shots)
        out.append(([(context, f" {letter}") for letter in letters], q % 4))
    return out


FIRST_N = {
    # shots, stem tokens, options, option tokens, option labels, answers, header, question template
    "mmlupro5": dict(
        shots=5,
        stem=40,
        options=10,
        option_tokens=5,
        labels="ABCDEFGHIJ",
        answer=" {}",
        header="The following are multiple choice questions (with answers) about history.\n",
        question="Question: {stem}\nOptions:\n{options}\nAnswer:",
        line="{}. {}",
        sep="\n\n",
    ),
    "mmlu3": dict(
        shots=3,
        stem=106,
        options=4,
        option_tokens=11,
        labels="ABCD",
        answer=" {}",
        header="The following are multiple choice questions (with answers) about high school history.\n\n",
        question="{stem}\n{options}\nAnswer:",
        line="{}. {}",
        sep="\n\n",
    ),
    "bbh3": dict(
        shots=3,
        stem=34,
        options=4,
        option_tokens=5,
        labels="ABCD",
        answer=" ({})",
        header="Select the option that completes the sentence.\n\n",
        question="Q: {stem}\nOptions:\n{options}\nA:",
        line="({}) {}",
        sep="\n\n",
    ),
}
"""Leaderboard few-shot layouts: the first ``shots`` documents are every question's examples (``first_n``)."""


def _first_n_questions(spec: dict, ids: list[int], decode, n: int) -> list[tuple[list[tuple[str, str]], int]]:
    width = spec["stem"] + spec["options"] * spec["option_tokens"] + 10

    def prompt(k: int) -> str:
        start = k * width
        stem = decode(ids[start : start + spec["stem"]]).strip()
        opts = _pieces(ids, decode, spec["options"], spec["option_tokens"], start=start + spec["stem"])
        options = "\n".join(spec["line"].format(spec["labels"][j], o) for j, o in enumerate(opts))
        return spec["question"].format(stem=stem, options=options)

    labels = spec["labels"]
    block = spec["header"] + "".join(
        prompt(k) + spec["answer"].format(labels[k % len(labels)]) + spec["sep"] for k in range(spec["shots"])
    )
    return [
        ([(block + prompt(spec["shots"] + q), spec["answer"].format(letter)) for letter in labels], q % len(labels))
        for q in range(n)
    ]


def requests_for(questions) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [
        Instance("loglikelihood", {"q": q}, pair, j)
        for q, (pairs, _) in enumerate(questions)
        for j, pair in enumerate(pairs)
    ]


def run_shape(
    shape: str, lms: dict[str, Any], tokenizer, ids: list[int], args, counters: dict[str, Counter] | None = None
) -> dict[str, Any]:
    """Alternating repeats of every scorer on one shape; returns seconds per scorer and the accuracy checks.
    ``counters``: a :class:`~benchmarks._scoring_common.Counter` per scorer that has no statistics of its own
    (``hf``), reset before each of its calls: the positions its last call ran through the model (``positions``)."""
    questions = build_questions(shape, ids, lambda t: tokenizer.decode(t), args.questions or SHAPES[shape])
    requests = requests_for(questions)
    tokens = sum(len(tokenizer.encode(c + x, add_special_tokens=False)) for c, x in (r.args for r in requests))
    seconds: dict[str, list[float]] = {k: [] for k in lms}
    results: dict[str, list[float]] = {}
    greedy: dict[str, list[bool]] = {}
    calls: dict[str, dict] = {}
    positions: dict[str, int] = {}
    counters = counters or {}
    keys = list(lms)
    for rep in range(args.repeats):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            gc.collect()
            if key in counters:
                counters[key].reset()
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # hf draws its progress bars
                out = lms[key].loglikelihood(requests, disable_tqdm=True)
            seconds[key].append(time.perf_counter() - t0)
            if key in counters:
                positions[key] = counters[key].positions
            results[key] = [float(ll) for ll, _ in out]
            greedy[key] = [bool(g) for _, g in out]
            if hasattr(lms[key], "stats"):
                calls[key] = lms[key].stats.calls[-1].to_dict()
        print(
            f"  {shape} repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {seconds[k][-1]:.2f} s" for k in keys),
            flush=True,
        )
    prompt_tokens = [len(tokenizer.encode(pairs[0][0], add_special_tokens=False)) for pairs, _ in questions]
    report: dict[str, Any] = {
        "shape": shape,
        "questions": len(questions),
        "tokens": tokens,
        "seconds": seconds,
        "prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
        "calls": {
            k: {f: c[f] for f in ("units", "rows", "computed_tokens", "tokens_saved", "computed_tokens_per_context")}
            for k, c in calls.items()
        },
        "positions": positions,
    }
    if "hf" in results:
        for key in (k for k in results if k != "hf"):
            report[f"max_abs_diff_{key}"] = max(abs(a - b) for a, b in zip(results["hf"], results[key]))
            options = len(questions[0][0])
            chosen = _answers(results["hf"], options), _answers(results[key], options)
            report[f"answers_equal_{key}"] = chosen[0] == chosen[1]
            report[f"answers_differing_{key}"] = sum(a != b for a, b in zip(*chosen))
            report[f"greedy_equal_{key}"] = greedy["hf"] == greedy[key]
    return report


def _answers(lls: list[float], options: int = 4) -> list[int]:
    return [max(range(options), key=lambda j: lls[q + j]) for q in range(0, len(lls), options)]


def table(reports: list[dict[str, Any]], args) -> str:
    import lm_eval
    import torch
    import transformers

    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} · torch {torch.__version__} "
        f"({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}) · "
        f"transformers {transformers.__version__} · lm-eval "
        f"{lm_eval.__version__} · {Path(args.model).name} · 1 process · {args.dtype} on "
        f"{device_name(args.device)} · batch size "
        f"{args.batch_size} · best of {args.repeats} alternating repeats",
        "",
        "| shape | scorer | scoring s | tokens/s | vs hf | vs unshared | rows | tokens computed | per question |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        best = {k: min(v) for k, v in r["seconds"].items()}
        label = f"{r['shape']} ({r['questions']} q, {r['prompt_tokens']:.0f}-token prompts)"
        for key, s in best.items():
            call = r["calls"].get(key, {})
            vs_hf = f"{best['hf'] / s:.2f}×" if "hf" in best and key != "hf" else "—"
            vs_un = f"{best['unshared'] / s:.2f}×" if "unshared" in best and key == "distperp" else "—"
            rows = f"{call['rows']:,} / {call['units']:,}" if call else "—"
            counted = call["computed_tokens"] if call else r.get("positions", {}).get(key)
            computed = f"{counted:,}" if counted is not None else "—"
            per_question = f"{counted / r['questions']:,.0f}" if counted is not None else "—"
            lines.append(
                f"| {label} | {LABELS[key]} | {s:.2f} | {r['tokens'] / s:,.0f} | {vs_hf} | {vs_un} | "
                f"{rows} | {computed} | {per_question} |"
            )
            label = ""
    lines.append("")
    for r in reports:
        ratios = []
        n = len(r["seconds"].get("hf", []))
        for key in ("distperp", "unshared"):
            if "hf" in r["seconds"] and key in r["seconds"]:
                per = [a / b for a, b in zip(r["seconds"]["hf"], r["seconds"][key])][:n]
                ratios.append(f"hf/{key} median {statistics.median(per):.2f}")
        if "unshared" in r["seconds"] and "distperp" in r["seconds"]:
            per = [a / b for a, b in zip(r["seconds"]["unshared"], r["seconds"]["distperp"])]
            ratios.append(f"unshared/distperp median {statistics.median(per):.2f}")
        checks = [
            f"{k.removeprefix('max_abs_diff_')}: max |Δ ll| vs hf {v:.2g}"
            for k, v in r.items()
            if k.startswith("max_abs_diff_")
        ]
        checks += [
            f"{k.removeprefix('answers_equal_')}: chosen answers "
            + (
                "equal"
                if v
                else "DIFFER"
                if args.dtype == "float32"
                else f"differ on {r['answers_differing_' + k.removeprefix('answers_equal_')]} of {r['questions']} "
                f"({args.dtype} rounding in hf: not checked)"
            )
            for k, v in r.items()
            if k.startswith("answers_equal_")
        ]
        lines.append(f"- {r['shape']}: " + "; ".join(ratios + checks) + ".")
    for key, decision in getattr(args, "decisions", {}).items():
        lines.append(f"- {LABELS[key]}: scoring paths {decision}.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(SHARED_MODEL), help="model folder (default ../shared/models/wt2-llama-5m)")
    p.add_argument("--text", default=str(WIKITEXT_VALID), help="text to cut questions from (WikiText valid.txt)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--scorers", default=",".join(SCORERS), help=f"comma-separated subset of {', '.join(SCORERS)}")
    p.add_argument("--questions", type=int, default=None, help="questions per shape (default: per shape)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every scorer runs (cuda: cuda:0)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype of every scorer"
    )
    p.add_argument(
        "--random-shape",
        default=None,
        choices=tuple(RANDOM_SHAPES),
        help="a random-init model of this shape instead of --model (built in --workdir)",
    )
    p.add_argument("--workdir", default=None, help="where to build the random model (default: a temp folder)")
    p.add_argument(
        "--share-model",
        action="store_true",
        help="load the weights once and give the same model object to every scorer (one copy in memory)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_offline_env(args.device)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_shape:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_mc_"))
        args.model = str(resolve_model(f"random-{args.random_shape}", workdir))
    shared = load_model(Path(args.model), args.device, args.dtype) if args.share_model else None
    lms = {
        key: make_lm(
            SCORERS[key][0],
            Path(args.model),
            args.max_length,
            args.batch_size,
            SCORERS[key][1],
            device=args.device,
            dtype=args.dtype,
            model=shared,
        )
        for key in args.scorers.split(",")
    }
    _quiet()
    args.decisions = {key: probe_decision(lm) for key, lm in lms.items() if key != "hf"}
    counters = {"hf": Counter(lms["hf"].model)} if "hf" in lms else {}
    tokenizer = next(iter(lms.values())).tokenizer
    ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)
    reports = []
    for shape in args.shapes.split(","):
        reports.append(run_shape(shape, lms, tokenizer, ids, args, counters))
    print(table(reports, args))
    failed = args.dtype == "float32" and not all(
        v for r in reports for k, v in r.items() if k.startswith("answers_equal_")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
