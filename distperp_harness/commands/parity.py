"""``distperp parity``: your checkpoint through lm-eval's ``hf`` and through ``distperp``, request by request.

Both models run in this process through ``lm_eval.simple_evaluate`` with the same tasks, dtype, batch size, window
length and ``--limit``, one after the other (the first is freed before the second loads). For every request:

- ``loglikelihood``: the difference of the two log-likelihoods, whether the greedy flags agree, and per document
  with several answers whether the chosen answer (the highest log-likelihood) is the same;
- ``loglikelihood_rolling``: the difference of the document totals;
- ``generate_until``: whether the texts are the same.

A value agrees when ``|distperp - hf| <= atol + rtol * |hf|``. The defaults follow ``--dtype``: float32/float64
``atol=1e-3`` nats (``hf``'s float32 log-softmax alone is off by up to 3e-4 nats per answer on a 49k vocabulary),
``rtol=1e-5``; bfloat16/float16 ``atol=0.1``, ``rtol=5e-3`` (the two backends batch differently, and low-precision
kernels round by batch shape). A task **agrees** when every value agrees and every choice and generation is the
same; the command exits 0 when every task agrees, 1 otherwise. A chosen answer that flips where ``hf``'s two best
answers are within the tolerance of each other is a *near tie*: counted apart, it does not fail the task. Beside each
task's largest difference the table prints the tolerance at that value (a whole document's total of -1,500 nats
allows 7.6 nats in bfloat16, an answer's of -2 nats 0.11). Metrics are printed side by side.

Default task: ``distperp_wikitext2`` on the packaged WikiText-format sample (offline). Any lm-eval task works
(``--tasks hellaswag,arc_easy --limit 100``) where its data can be loaded.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from distperp_harness.commands.exitcodes import for_failures
from distperp_harness.commands.samples import responses_by_doc
from distperp_harness.errors import InputError
from distperp_harness.report.atomic import atomic_write_text

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

TOLERANCES = {"float32": (1e-3, 1e-5), "float64": (1e-3, 1e-5), "bfloat16": (0.1, 5e-3), "float16": (0.1, 5e-3)}
"""dtype -> (atol in nats, rtol): the defaults of ``--atol`` and ``--rtol``."""


class Verdict(str, enum.Enum):
    AGREE = "agree"
    DIFFER = "DIFFER"


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def at(self, hf: float) -> float:
        """The largest difference allowed beside ``hf``'s value: ``atol + rtol * |hf|`` (nats)."""
        return self.atol + self.rtol * abs(hf)

    def agrees(self, hf: float, dp: float) -> bool:
        return math.isfinite(dp) and abs(dp - hf) <= self.at(hf)


@dataclass
class TaskParity:
    """One task's comparison (counts over its requests and documents) and its metrics, hf then distperp."""

    task: str
    values: int = 0
    values_outside: int = 0
    max_abs_diff: float = 0.0
    max_diff_tolerance: float = 0.0
    """The tolerance at the value of ``max_abs_diff`` (``atol + rtol * |hf|``): a whole document's log-likelihood is
    large, so its relative part allows nats where a single answer's allows a fraction of one."""
    greedy_differ: int = 0
    choices: int = 0
    choices_differ: int = 0
    near_ties: int = 0
    generations: int = 0
    generations_differ: int = 0
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def verdict(self) -> Verdict:
        differ = self.values_outside + self.greedy_differ + self.choices_differ + self.generations_differ
        return Verdict.DIFFER if differ or not (self.values or self.generations) else Verdict.AGREE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "--pretrained",
        required=True,
        help="the checkpoint: a folder or hub id (pretrained=)",
    )
    parser.add_argument("--tasks", default="distperp_wikitext2", help="comma-separated lm-eval tasks")
    parser.add_argument("--include_path", default=None, help="a folder of your own task YAMLs")
    parser.add_argument(
        "--metadata", default=None, help="JSON for the tasks, added to the packaged sample's wikitext_path"
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N documents of each task")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
    parser.add_argument("--batch_size", default="8", help="both models' batch size (default 8; lm-eval's is 1)")
    parser.add_argument("--max_length", type=int, default=None)
    parser.add_argument(
        "--model_args", default="", help="more model_args for both, e.g. trust_remote_code=true,revision=main"
    )
    parser.add_argument("--atol", type=float, default=None, help="nats (default: by --dtype)")
    parser.add_argument("--rtol", type=float, default=None, help="relative (default: by --dtype)")
    parser.add_argument("--json", default=None, help="also write the comparison to this JSON file")


def compare_task(task: str, hf: list[dict], dp: list[dict], tolerance: Tolerance) -> TaskParity:
    """Compare the logged samples of one task, request by request (pure: no model, no lm-eval call)."""
    parity = TaskParity(task)
    hf_docs, dp_docs = responses_by_doc(hf), responses_by_doc(dp)
    if set(hf_docs) != set(dp_docs):
        raise ValueError(f"{task}: the two runs scored different documents ({len(hf_docs)} vs {len(dp_docs)})")
    for doc, hf_resps in hf_docs.items():
        scores: dict[str, list[float]] = defaultdict(list)
        for a, b in zip(hf_resps, dp_docs[doc], strict=True):
            if isinstance(a, str):
                parity.generations += 1
                parity.generations_differ += a != b
                continue
            pair = isinstance(a, (list, tuple))
            x, y = (float(a[0]), float(b[0])) if pair else (float(a), float(b))
            parity.values += 1
            parity.values_outside += not tolerance.agrees(x, y)
            diff = abs(y - x) if math.isfinite(abs(y - x)) else math.inf
            if parity.values == 1 or diff > parity.max_abs_diff:
                parity.max_abs_diff, parity.max_diff_tolerance = diff, tolerance.at(x)
            if pair:
                parity.greedy_differ += bool(a[1]) != bool(b[1])
                scores["hf"].append(x)
                scores["dp"].append(y)
        if len(scores["hf"]) > 1:
            parity.choices += 1
            if _argmax(scores["hf"]) != _argmax(scores["dp"]):
                if _near_tie(scores["hf"], tolerance):
                    parity.near_ties += 1
                else:
                    parity.choices_differ += 1
    return parity


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _near_tie(values: list[float], tolerance: Tolerance) -> bool:
    """Whether the two best answers are within the tolerance of each other: either may win."""
    best, second = sorted(values, reverse=True)[:2]
    return best - second <= tolerance.atol + tolerance.rtol * abs(best)


def metrics(hf: dict, dp: dict) -> dict[str, tuple[float, float]]:
    """Numeric metrics of one task (standard errors left out), hf's value then distperp's."""
    return {
        key: (float(value), float(dp[key]))
        for key, value in hf.items()
        if "_stderr" not in key and "," in key and isinstance(value, (int, float)) and key in dp
    }


RESERVED = {"pretrained": "--model", "dtype": "--dtype", "max_length": "--max_length", "batch_size": "--batch_size",
            "device": "--device"}  # fmt: skip
"""model_args keys both runs take from a flag (the tolerance follows ``--dtype``): the flag to use instead."""


def check_model_args(model_args: str) -> None:
    """Raises :class:`InputError` when ``--model_args`` sets what a flag sets for both runs."""
    from lm_eval.utils import simple_parse_args_string

    taken = sorted(set(simple_parse_args_string(model_args)) & set(RESERVED))
    if taken:
        flags = ", ".join(f"{key} (use {RESERVED[key]})" for key in taken)
        raise InputError(f"--model_args {model_args!r} sets {flags}: both runs take these from the flags")


def task_metadata(given: str | None) -> dict:
    """``--metadata`` (JSON) over the default: the packaged sample as ``wikitext_path``.

    Raises:
        InputError: ``given`` is not a JSON object.
    """
    from distperp_harness.commands.tiny import sample_text_path

    try:
        extra = json.loads(given) if given else {}
    except json.JSONDecodeError as error:
        raise InputError(
            f'--metadata {given!r} is not JSON ({error}); e.g. \'{{"wikitext_path": "test.txt"}}\''
        ) from None
    if not isinstance(extra, dict):
        raise InputError(f'--metadata {given!r} must be a JSON object, e.g. \'{{"wikitext_path": "test.txt"}}\'')
    return {"wikitext_path": str(sample_text_path()), **extra}


def _evaluate(model: str, args: argparse.Namespace, device: str, manager: TaskManager) -> dict:
    import lm_eval
    import torch

    model_args = f"pretrained={args.model},dtype={args.dtype}"
    model_args += f",max_length={args.max_length}" if args.max_length else ""
    model_args += f",{args.model_args}" if args.model_args else ""
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=args.tasks.split(","),
        task_manager=manager,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=device,
        limit=args.limit,
        log_samples=True,
    )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_parity(args: argparse.Namespace) -> int:
    """Run both models, print the comparison and the verdict; the exit code (:mod:`~.exitcodes`): 0 when every
    task agrees, 3 when one differs."""
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.check import device_for

    device = device_for(args.device)
    check_model_args(args.model_args)
    atol, rtol = TOLERANCES[args.dtype]
    tolerance = Tolerance(args.atol if args.atol is not None else atol, args.rtol if args.rtol is not None else rtol)
    metadata = task_metadata(args.metadata)
    manager = TaskManager(include_path=args.include_path, metadata=metadata)
    runs = {name: _evaluate(name, args, device, manager) for name in ("hf", "distperp")}
    tasks = sorted(runs["hf"]["samples"])
    report = []
    for task in tasks:
        parity = compare_task(task, runs["hf"]["samples"][task], runs["distperp"]["samples"][task], tolerance)
        parity.metrics = metrics(runs["hf"]["results"].get(task, {}), runs["distperp"]["results"].get(task, {}))
        report.append(parity)
    print(
        f"\ndistperp parity: {args.model}, {args.dtype} on {device}; a value agrees when "
        f"|distperp - hf| <= {tolerance.atol:g} + {tolerance.rtol:g} x |hf|\n"
    )
    print("| task | values outside / all | max abs diff (tolerance there) | greedy flags differ | choices differ "
          "| near ties | generations differ | verdict |\n|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for p in report:
        print(
            f"| {p.task} | {p.values_outside}/{p.values} | {p.max_abs_diff:.3g} ({p.max_diff_tolerance:.3g}) | "
            f"{p.greedy_differ} | "
            f"{p.choices_differ}/{p.choices} | {p.near_ties} | {p.generations_differ}/{p.generations} | "
            f"{p.verdict.value} |"
        )
    print("\n| task | metric | hf | distperp | relative difference |\n|---|---|---:|---:|---:|")
    for p in report:
        for key, (a, b) in p.metrics.items():
            rel = abs(b - a) / abs(a) if a else abs(b - a)
            print(f"| {p.task} | {key} | {a:.6g} | {b:.6g} | {rel:.2e} |")
    differ = [p.task for p in report if p.verdict is Verdict.DIFFER]
    print(f"\n{'DIFFER: ' + ', '.join(differ) if differ else 'AGREE'}: {len(report) - len(differ)} of {len(report)} "
          "tasks agree")  # fmt: skip
    if args.json:
        rows = [{**asdict(p), "verdict": p.verdict.value} for p in report]
        atomic_write_text(args.json, json.dumps({"tolerance": asdict(tolerance), "tasks": rows}, indent=2))
    return for_failures(len(differ))
