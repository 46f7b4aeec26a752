"""``distperp check``: does distperp work on this machine? One command, one table, a verdict and an exit code.

For the unquantized run (``--dtype``, bfloat16 by default) and for ``quantize=int4``, through the real
``DistPerpLM`` and lm-eval's ``simple_evaluate`` on the rolling task ``distperp_wikitext2`` (the packaged
WikiText-format sample, or ``--text``):

- **load**: the model loads on ``--device``; for int4, how many Linear layers were quantized (at least one);
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
import gc
import json
import math
import subprocess
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from distperp_harness.lm import DistPerpLM

TASK = "distperp_wikitext2"
RELEASE_SLACK = 16 << 20
"""Allocated CUDA bytes a run may leave behind (the caching allocator's own bookkeeping)."""


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
    parser.add_argument("--model", default=None, help="a local folder or hub id (default: a small random Llama)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="bfloat16", help="the unquantized run's dtype (default bfloat16)")
    parser.add_argument("--processes", type=int, default=2, help="processes of the launched run (default 2; 1: skip)")
    parser.add_argument("--text", default=None, help="a WikiText-format file (default: the packaged sample)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N documents")
    parser.add_argument("--max-length", type=int, default=None, help="window length (default: the model's)")
    parser.add_argument(
        "--model_args", default="", help="more model_args for every run, e.g. group_size=64,trust_remote_code=true"
    )
    parser.add_argument("--work", default=None, help="folder for the launched run's results (default: temporary)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def device_for(requested: str | None) -> str:
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: distperp check runs on cpu or cuda; pass --device cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; pass --device cpu or check the driver")
    return device


def _per_doc(samples: list[dict]) -> dict[int, str]:
    """Document id -> the hex bits of its log-likelihood (the first response: lm-eval pads with copies)."""
    return {int(s["doc_id"]): float(s["resps"][0][0]).hex() for s in samples}


def _evaluate(lm: DistPerpLM, manager: TaskManager | None, limit: int | None) -> Evaluation:
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=True, limit=limit)
    call = lm.stats.calls[-1].to_dict()
    return Evaluation(
        per_doc=_per_doc(out["samples"][TASK]),
        fingerprint=str(out["config"]["distperp"]["fingerprint"]),
        token_perplexity=float(out["results"][TASK]["token_perplexity,none"]),
        tokens_per_s=call["scored_tokens"] / max(call["scoring_seconds"], 1e-9),
    )


def cuda_baseline() -> int | None:
    """Allocated CUDA bytes before any run, cuBLAS's workspaces left out (see :func:`released`); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # the process's first product
    torch.cuda.synchronize()
    _drop_cublas_workspaces()
    return int(torch.cuda.memory_allocated())


def _drop_cublas_workspaces() -> None:
    """cuBLAS keeps a workspace per handle in the caching allocator, made at the process's first product and kept
    for the process (torch's, not a run's): left out of both sides of the release check."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@dataclass(frozen=True)
class Release:
    """What was left of a dropped run: whether its model was collected, and on CUDA the allocated bytes above the
    baseline (``None`` without one)."""

    collected: bool
    left_bytes: int | None

    @property
    def ok(self) -> bool:
        return self.collected and (self.left_bytes is None or self.left_bytes <= RELEASE_SLACK)

    @property
    def detail(self) -> str:
        text = "model collected" if self.collected else "model still referenced after gc.collect()"
        if self.left_bytes is not None:
            text += f"; {self.left_bytes / 2**20:+.1f} MiB allocated vs the baseline"
        return text


def released(model_ref: weakref.ref, baseline: int | None) -> Release:
    """Collect garbage (``DistPerpLM`` sits in reference cycles; torchao's bound ``extra_repr`` adds one), then
    whether the run's model is gone and, on CUDA, the allocated bytes against ``baseline``, measured as the baseline
    was: with cuBLAS's per-handle workspaces dropped (one Hopper workspace is 32 MiB)."""
    import torch

    gc.collect()
    left = None
    if baseline is not None:
        torch.cuda.synchronize()
        _drop_cublas_workspaces()
        torch.cuda.empty_cache()
        left = int(torch.cuda.memory_allocated()) - baseline
    return Release(collected=model_ref() is None, left_bytes=left)


def run_in_process(
    name: str, model_args: dict[str, Any], manager: TaskManager | None, limit: int | None, baseline: int | None
) -> tuple[list[CheckRow], Evaluation | None]:
    """Rows of one in-process run, and its first evaluation (``None`` when the model did not load)."""
    from distperp_harness.lm import DistPerpLM

    rows: list[CheckRow] = []
    t0 = time.perf_counter()
    try:
        lm = DistPerpLM(**model_args)
    except Exception as error:  # the check reports any failure to load as a failed row
        return [CheckRow(name, "load", Outcome.FAIL, f"{type(error).__name__}: {error}")], None
    load = f"{time.perf_counter() - t0:.1f} s, {lm.weight_bytes / 2**20:.1f} MiB of weights on {lm.device}"
    report = lm.quant_report
    if report is not None and report.config_name is not None:
        count = len(report.quantized)
        load += f"; {count} of {count + len(report.skipped)} Linear layers quantized"
        load += f" (kept: {next(iter(report.skipped.values()))})" if report.skipped else ""
        rows.append(CheckRow(name, "load", Outcome.PASS if count else Outcome.FAIL, load))
    else:
        rows.append(CheckRow(name, "load", Outcome.PASS, load))
    first, again = _evaluate(lm, manager, limit), _evaluate(lm, manager, limit)
    finite = all(math.isfinite(float.fromhex(v)) for v in first.per_doc.values())
    rows.append(
        CheckRow(
            name,
            "scores",
            Outcome.PASS if finite and first.per_doc else Outcome.FAIL,
            f"{len(first.per_doc)} documents, token perplexity {first.token_perplexity:.4g}, "
            f"{first.tokens_per_s:,.0f} tokens/s" + ("" if finite else "; NOT FINITE"),
        )
    )
    same = first.per_doc == again.per_doc
    differ = sum(first.per_doc[d] != again.per_doc.get(d) for d in first.per_doc)
    rows.append(
        CheckRow(
            name,
            "same bits twice",
            Outcome.PASS if same else Outcome.FAIL,
            "every document equal" if same else f"{differ} of {len(first.per_doc)} documents differ",
        )
    )
    model_ref = weakref.ref(lm.model)
    del lm
    release = released(model_ref, baseline)
    rows.append(CheckRow(name, "memory released", Outcome.PASS if release.ok else Outcome.FAIL, release.detail))
    return rows, first


def launched(processes: int, model_args: dict, metadata: dict, limit: int | None, out: Path) -> Evaluation:
    """The same evaluation under ``accelerate launch`` with ``processes`` processes (lm-eval's command line)."""
    from distperp_harness.commands.launching import accelerate_launch_prefix, offline_env
    from distperp_harness.commands.taskdir import tasks_path

    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [
        *accelerate_launch_prefix(processes),
        "-m", "lm_eval", "--model", "distperp", "--model_args", args, "--tasks", TASK,
        "--include_path", str(tasks_path()), "--metadata", json.dumps(metadata),
        "--log_samples", "--output_path", str(out),
        *(["--limit", str(limit)] if limit is not None else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=offline_env(keep_set=True), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = [json.loads(line) for p in out.rglob(f"samples_{TASK}_*.jsonl") for line in p.read_text().splitlines()]
    return Evaluation(
        per_doc=_per_doc([s for s in samples if s]),
        fingerprint=str(results["config"]["distperp"]["fingerprint"]),
        token_perplexity=float(results["results"][TASK]["token_perplexity,none"]),
        tokens_per_s=0.0,
    )


def processes_row(
    args: argparse.Namespace, device: str, model_args: dict[str, Any], metadata: dict, one: Evaluation | None
) -> CheckRow:
    name = f"1 vs {max(args.processes, 2)} processes"
    if args.processes < 2:
        return CheckRow(name, "same bits", Outcome.SKIP, "--processes 1")
    if one is None:
        return CheckRow(name, "same bits", Outcome.SKIP, "the one-process run did not score")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < args.processes:
            return CheckRow(name, "same bits", Outcome.SKIP, f"{torch.cuda.device_count()} CUDA device(s) here")
    out = Path(args.work or tempfile.mkdtemp(prefix="distperp-check-")) / f"launch-{args.processes}"
    try:
        many = launched(args.processes, model_args, metadata, args.limit, out)
    except Exception as error:  # a failed launch is a failed check, with its output's tail
        return CheckRow(name, "same bits", Outcome.FAIL, f"the launched run failed: {error}")
    same = many.per_doc == one.per_doc and many.fingerprint == one.fingerprint
    detail = f"fingerprint {one.fingerprint} / {many.fingerprint}; {len(many.per_doc)} documents"
    return CheckRow(name, "same bits", Outcome.PASS if same else Outcome.FAIL, detail)


def cached_model() -> str:
    """The folder of the check's own model (built once into the cache: about a second)."""
    from distperp_harness.commands.tiny import CHECK_SPEC, cached_tiny_model

    return str(cached_tiny_model(CHECK_SPEC))


def run_check(args: argparse.Namespace) -> int:
    """Run every check, print the table and the verdict; 0 when nothing failed."""
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    from distperp_harness.commands.taskdir import tasks_path
    from distperp_harness.commands.tiny import sample_text_path

    device = device_for(args.device)
    model = args.model or cached_model()
    metadata = {"wikitext_path": str(args.text or sample_text_path())}
    manager = TaskManager(include_path=str(tasks_path()), metadata=metadata)
    base: dict[str, Any] = {"pretrained": model, "device": device, "dtype": args.dtype, "batch_size": "auto"}
    if args.max_length:
        base["max_length"] = args.max_length
    base.update(simple_parse_args_string(args.model_args))  # lm-eval's own parsing of --model_args
    baseline = cuda_baseline() if device == "cuda" else None
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
        Path(args.json).write_text(json.dumps([{**asdict(r), "outcome": r.outcome.value} for r in rows], indent=2))
    return 1 if failed else 0
