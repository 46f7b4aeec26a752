"""``distperp check``: does distperp work on this machine? One command, one table, a verdict and an exit code.

For the ``--dtype`` run (bfloat16 by default, weights as loaded) and for ``quantize=int4``, through the real
``DistPerpLM`` and lm-eval's ``simple_evaluate`` on the rolling task ``distperp_wikitext2`` (the packaged
WikiText-format sample, or ``--text``):

- **load**: the model loads on ``--device``, in the dtype named in the row (the model's, as it ran); for int4, how
  many Linear layers were quantized (at least one);
- **scores**: every document's log-likelihood is finite; tokens/s of the scoring call;
- **same bits twice**: the same evaluation again in the same process gives the same per-document bits;
- **memory released**: once the run is dropped its model is collected, and on CUDA the allocated bytes are back
  at the baseline measured before the first run;
- **1 vs N processes** (``--processes``, 2 by default): ``accelerate launch -m lm_eval`` with N processes gives the
  per-document bits and the fingerprint of the in-process run. It needs N devices on CUDA (skipped with one); on
  CPU the processes form a gloo group.

Without ``--model`` it checks a small random Llama the package builds (every Linear int4-quantizable; cached).
Exits 0 when every check passes, 1 otherwise (a skipped check does not fail).
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import re
import subprocess
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distperp_harness.commands.exitcodes import for_failures
from distperp_harness.commands.release import cuda_baseline, released
from distperp_harness.commands.samples import logged_samples, newest_results, responses_by_doc
from distperp_harness.errors import InputError
from distperp_harness.report.atomic import atomic_write_text

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from distperp_harness.lm import DistPerpLM

TASK = "distperp_wikitext2"
OWN_FLAGS = {"pretrained": "--model", "device": "--device", "dtype": "--dtype", "max_length": "--max_length"}
"""model_args keys the check sets itself (``quantize`` and ``batch_size`` too): the flag that sets each instead."""


class Outcome(str, enum.Enum):
    """One check's verdict."""

    PASS = "pass"
    FAIL = "FAIL"
    SKIP = "skipped"


@dataclass(frozen=True)
class CheckRow:
    """One line of the table: which run, which check, its outcome and what was seen."""

    run: str
    check: str
    outcome: Outcome
    detail: str


@dataclass(frozen=True)
class Evaluation:
    """One ``simple_evaluate`` of the task: per-document bits (``float.hex``), fingerprint, metrics, seconds."""

    per_doc: dict[int, str]
    fingerprint: str
    token_perplexity: float
    tokens_per_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", "--pretrained", default=None, help="a local folder or hub id (default: a small random Llama)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="bfloat16", help="the first run's dtype (default bfloat16); the int4 run computes in it too"
    )
    parser.add_argument(
        "--processes", type=_at_least_one, default=2, help="processes of the launched run (default 2; 1: skip it)"
    )
    parser.add_argument("--text", default=None, help="a WikiText-format file (default: the packaged sample)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N documents")
    parser.add_argument(
        "--max_length", "--max-length", type=int, default=None, help="window length (default: the model's)"
    )
    parser.add_argument(
        "--model_args", default="", help="more model_args for every run, e.g. group_size=64,trust_remote_code=true"
    )
    parser.add_argument("--work", default=None, help="folder for the launched run's results (default: temporary)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more processes (1 skips the launched run)")
    return value


def device_for(requested: str | None) -> str:
    """``requested`` checked against this machine (``cpu``, ``cuda``, ``cuda:N``), or the default: cuda if any.

    Raises:
        InputError: another device, or a CUDA device torch does not see here.
    """
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise InputError(f"--device {device!r}: distperp check runs on cpu, cuda or cuda:N; pass one of those")
    if kind == "cuda" and int(index or 0) >= torch.cuda.device_count():
        raise InputError(
            f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s) here; pass --device cpu, "
            "another index, or check the driver (nvidia-smi)"
        )
    return device


def model_args_for(args: argparse.Namespace, model: str, device: str) -> dict[str, Any]:
    """The ``--dtype`` run's ``model_args``: the flags, then ``--model_args`` (lm-eval's parsing).

    Raises:
        InputError: ``--model_args`` sets a key the check sets itself.
    """
    from lm_eval.utils import simple_parse_args_string

    extra = simple_parse_args_string(args.model_args)
    taken = sorted(set(extra) & {*OWN_FLAGS, "quantize", "batch_size"})
    if taken:
        flags = ", ".join(f"{key} (use {OWN_FLAGS[key]})" for key in taken if key in OWN_FLAGS)
        raise InputError(
            f"--model_args {args.model_args!r} sets {', '.join(taken)}, which distperp check sets itself: "
            f"{flags or f'quantize and batch_size are the runs themselves ({args.dtype} and int4, batch_size=auto)'}"
        )
    base: dict[str, Any] = {"pretrained": model, "device": device, "dtype": args.dtype, "batch_size": "auto"}
    if args.max_length:
        base["max_length"] = args.max_length
    return {**base, **extra}


def _bits(samples: list[dict]) -> dict[int, str]:
    """Document id -> the hex bits of its log-likelihood."""
    return {doc: float(resps[0]).hex() for doc, resps in responses_by_doc(samples).items()}


def _evaluate(lm: DistPerpLM, manager: TaskManager | None, limit: int | None) -> Evaluation:
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=True, limit=limit)
    call = lm.stats.calls[-1].to_dict()
    return Evaluation(
        per_doc=_bits(out["samples"][TASK]),
        fingerprint=str(out["config"]["distperp"]["fingerprint"]),
        token_perplexity=float(out["results"][TASK]["token_perplexity,none"]),
        tokens_per_s=call["scored_tokens"] / max(call["scoring_seconds"], 1e-9),
    )


def load_detail(seconds: float, lm: Any) -> str:
    """The load row's detail: time, weight size, device and the dtype the model ran in (its parameters', e.g.
    ``bfloat16``: what ``--dtype`` asked for, or with ``auto`` what the checkpoint holds)."""
    dtype = getattr(lm.model, "dtype", None)  # a transformers model's; else its first parameter's
    if dtype is None:
        dtype = next((p.dtype for p in lm.model.parameters()), "unknown")
    dtype = str(dtype).removeprefix("torch.")
    return f"{seconds:.1f} s, {lm.weight_bytes / 2**20:.1f} MiB of weights on {lm.device}, dtype {dtype}"


def load_row(name: str, load: str, report: Any, quantized_run: bool) -> CheckRow:
    """The load check: for a quantized run, at least one Linear layer must have been quantized."""
    if not quantized_run:
        return CheckRow(name, "load", Outcome.PASS, load)
    count = len(report.quantized) if report is not None and report.config_name is not None else 0
    skipped = report.skipped if report is not None else {}
    load += f"; {count} of {count + len(skipped)} Linear layers quantized"
    load += f" (kept: {next(iter(skipped.values()))})" if skipped else ""
    return CheckRow(name, "load", Outcome.PASS if count else Outcome.FAIL, load)


def score_rows(name: str, first: Evaluation, again: Evaluation) -> list[CheckRow]:
    """The scores check (every document finite) and the same-bits-twice check of two evaluations of one run."""
    finite = all(math.isfinite(float.fromhex(v)) for v in first.per_doc.values())
    scores = (
        f"{len(first.per_doc)} documents, token perplexity {first.token_perplexity:.4g}, "
        f"{first.tokens_per_s:,.0f} tokens/s" + ("" if finite else "; NOT FINITE")
    )
    differ = sum(first.per_doc[d] != again.per_doc.get(d) for d in first.per_doc) + len(
        set(again.per_doc) - set(first.per_doc)
    )
    return [
        CheckRow(name, "scores", Outcome.PASS if finite and first.per_doc else Outcome.FAIL, scores),
        CheckRow(
            name,
            "same bits twice",
            Outcome.FAIL if differ else Outcome.PASS,
            f"{differ} of {len(first.per_doc)} documents differ" if differ else "every document equal",
        ),
    ]


def rows_alone_row(name: str, lm: Any) -> CheckRow:
    """Whether this device and dtype give a row the same bits alone and in batches when it attends alone
    (:func:`~distperp_harness.run.scoring.engine.invariance.rows_check`), and which small products decode steps
    compute as they are (:func:`~distperp_harness.model.row_products.measure_row_sizes`): where rows do not,
    ``batch_invariant=true`` scores a row per forward and ``auto`` batches as ``false`` (slower or batch-dependent,
    not wrong), so that is a skipped row, not a failure."""
    from distperp_harness.model.row_products import measure_row_sizes
    from distperp_harness.run.scoring.engine.invariance import rows_check

    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    try:
        why = rows_check(lm.model, lm.device, pad, lm.max_length, lm.reference)
        sizes = measure_row_sizes(lm.model)
    except Exception as error:  # the check reports any failure as a failed row
        return CheckRow(name, "rows attend alone", Outcome.FAIL, _failure(error))
    if why is None:
        detail = f"every unit's bits equal alone and in batches; decode steps: {sizes.describe()}"
        return CheckRow(name, "rows attend alone", Outcome.PASS, detail)
    fallback = "batch_invariant=true scores a row per forward, auto batches as false"
    return CheckRow(name, "rows attend alone", Outcome.SKIP, f"{why}: {fallback}")


def _failure(error: BaseException) -> str:
    """One line: the error's type and message, newlines folded (a table cell)."""
    return f"{type(error).__name__}: " + " / ".join(line for line in str(error).splitlines() if line.strip())


def run_in_process(
    name: str, model_args: dict[str, Any], manager: TaskManager | None, limit: int | None, baseline: int | None
) -> tuple[list[CheckRow], Evaluation | None]:
    """Rows of one in-process run, and its first evaluation (``None`` when it did not load or score)."""
    from distperp_harness.lm import DistPerpLM

    t0 = time.perf_counter()
    try:
        lm = DistPerpLM(**model_args)
    except Exception as error:  # the check reports any failure to load as a failed row
        return [CheckRow(name, "load", Outcome.FAIL, _failure(error))], None
    load = load_detail(time.perf_counter() - t0, lm)
    rows = [load_row(name, load, lm.quant_report, "quantize" in model_args)]
    first: Evaluation | None = None
    try:
        first, again = _evaluate(lm, manager, limit), _evaluate(lm, manager, limit)
        rows += score_rows(name, first, again)
    except Exception as error:  # a failure while scoring fails the row; the release is still checked
        rows += [
            CheckRow(name, "scores", Outcome.FAIL, _failure(error)),
            CheckRow(name, "same bits twice", Outcome.SKIP, "nothing scored"),
        ]
        first = None
    rows.append(rows_alone_row(name, lm))
    model_ref = weakref.ref(lm.model)
    del lm
    release = released(model_ref, baseline)
    rows.append(CheckRow(name, "memory released", Outcome.PASS if release.ok else Outcome.FAIL, release.detail))
    return rows, first


def _launch_failure(output: str) -> str:
    """What a failed launch said: distperp's own one-line messages (which rank failed, while doing what), else the
    end of its output."""
    said = list(dict.fromkeys(re.findall(r"distperp: (?:rank \d+ |error).*", output)))
    return " / ".join(said[:2]) if said else f"its output ends: {output[-1500:]}"


def launched(processes: int, model_args: dict[str, Any], metadata: dict, limit: int | None, out: Path) -> Evaluation:
    """The same evaluation under ``accelerate launch`` with ``processes`` processes (lm-eval's command line), its
    results written into ``out`` (a fresh folder)."""
    from distperp_harness.commands.launching import lm_eval_command, offline_env
    from distperp_harness.commands.taskdir import tasks_path

    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    extra = ["--limit", str(limit)] if limit is not None else []
    cmd = lm_eval_command(
        processes, args, TASK, output_path=out, include_path=tasks_path(), metadata=metadata, extra=extra
    )
    proc = subprocess.run(cmd, env=offline_env(keep_set=True), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {_launch_failure(proc.stderr or proc.stdout)}")
    results = newest_results(out)
    return Evaluation(
        per_doc=_bits(logged_samples(out, TASK)),
        fingerprint=str(results["config"]["distperp"]["fingerprint"]),
        token_perplexity=float(results["results"][TASK]["token_perplexity,none"]),
        tokens_per_s=0.0,
    )


def processes_row(
    args: argparse.Namespace, device: str, model_args: dict[str, Any], metadata: dict, one: Evaluation | None
) -> CheckRow:
    """1 vs ``--processes`` processes: the launched run's per-document bits and fingerprint against ``one``'s."""
    name = f"1 vs {max(args.processes, 2)} processes"
    if args.processes < 2:
        return CheckRow(name, "same bits", Outcome.SKIP, "--processes 1")
    if one is None:
        return CheckRow(name, "same bits", Outcome.SKIP, "the one-process run did not score")
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < args.processes:
            return CheckRow(name, "same bits", Outcome.SKIP, f"{torch.cuda.device_count()} CUDA device(s) here")
        model_args = {**model_args, "device": "cuda"}  # each process takes its own device
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"launch-{args.processes}-", dir=args.work))  # never an earlier run's files
    try:
        many = launched(args.processes, model_args, metadata, args.limit, out)
    except Exception as error:  # a failed launch is a failed check, with its output's tail
        return CheckRow(name, "same bits", Outcome.FAIL, f"the launched run failed: {_failure(error)}")
    same = many.per_doc == one.per_doc and many.fingerprint == one.fingerprint
    detail = f"fingerprint {one.fingerprint} / {many.fingerprint}; {len(many.per_doc)} documents"
    return CheckRow(name, "same bits", Outcome.PASS if same else Outcome.FAIL, detail)


def cached_model() -> str:
    """The folder of the check's own model (built once into the cache: about a second)."""
    from distperp_harness.commands.tiny import CHECK_SPEC, cached_tiny_model

    return str(cached_tiny_model(CHECK_SPEC))


def run_check(args: argparse.Namespace) -> int:
    """Run every check, print the table and the verdict; the exit code (:mod:`~.exitcodes`): 0 when nothing failed,
    3 when a check failed."""
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.taskdir import tasks_path
    from distperp_harness.commands.tiny import sample_text_path

    device = device_for(args.device)
    model = args.model or cached_model()
    base = model_args_for(args, model, device)
    metadata = {"wikitext_path": str(args.text or sample_text_path())}
    manager = TaskManager(include_path=str(tasks_path()), metadata=metadata)
    baseline = cuda_baseline() if device.startswith("cuda") else None
    rows, first = run_in_process(args.dtype, base, manager, args.limit, baseline)
    int4_rows, _ = run_in_process("int4", {**base, "quantize": "int4"}, manager, args.limit, baseline)
    rows += int4_rows
    rows.append(processes_row(args, device, base, metadata, first))
    print(f"\ndistperp check: {model} on {device}\n")
    print("| run | check | outcome | detail |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row.run} | {row.check} | {row.outcome.value} | {row.detail} |")
    failed = [row for row in rows if row.outcome is Outcome.FAIL]
    passed = sum(row.outcome is Outcome.PASS for row in rows)
    print(
        f"\n{'FAILED' if failed else 'OK'}: {passed} passed, {len(failed)} failed, "
        f"{sum(row.outcome is Outcome.SKIP for row in rows)} skipped"
    )
    if args.json:
        atomic_write_text(args.json, json.dumps([{**asdict(r), "outcome": r.outcome.value} for r in rows], indent=2))
    return for_failures(len(failed))
