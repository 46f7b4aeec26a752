"""A series of checkpoints in one launch against one ``lm_eval --model distperp`` process per checkpoint.

    python -m benchmarks.bench_series                         # wt2-llama-5m, 5 stages, WikiText-2 + few-shot MC
    python -m benchmarks.bench_series --processes 2
    python -m benchmarks.bench_series --model TINY --checkpoints 2 --limit 2 --max-length 128   # dry (make test)
    python -m benchmarks.bench_series --model ~/.cache/distperp/smollm2-135m-instruct --adapters --checkpoints 4 \
        --limit 2 --max-length 256                            # 4 LoRA adapters of SmolLM2-135M: the base read once

The stages: ``--model``'s weights, each matrix multiplied by ``1 + 0.05·k`` plus seeded noise of ``0.01·k`` of its
spread (stage k = 0..N-1), saved as ``step_{1000·(k+1)}`` in a temporary run folder: N checkpoints of one
architecture and one tokenizer, as a training run writes them (``--adapters``: N random LoRA adapters of ``--model``
instead, :func:`write_adapters`, the series given ``--base``). Work per checkpoint: ``distperp_wikitext2`` (the
local WikiText-2 test file, ``--limit`` articles) and ``dptest_fewshot`` (2-shot multiple choice, multi-token
answers). Timed: the ``series`` launch, then each separate ``lm_eval`` run (wall seconds of each command, start-up
included: what a user waits for; and the CPU seconds of its processes), after one untimed process that imports both
(files read cold slow the first). With ``--repeats N`` both are timed N times, alternating which goes first, and
each timing is the fastest of its N: on a shared machine another user's load only adds time (to both: threads that
wait for a core spin). Printed: a table, the ratios series / sum of separate runs, and whether each checkpoint's
fingerprint (``config.distperp.fingerprint``) equals its separate run's. Exits 1 when one differs or a run fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import SHARED_MODEL, TEST_TASKS, WIKITEXT_TEST, environment
from distperp_harness.commands.launching import accelerate_launch_prefix

TASKS = "distperp_wikitext2,dptest_fewshot"


def write_stages(model: Path, run: Path, count: int) -> list[Path]:
    """``count`` perturbed copies of ``model`` (see the module docstring), ``run/step_<1000·(k+1)>``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for k in range(count):
        weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for parameter in weights.parameters():
                if parameter.dim() == 2:
                    noise = torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.01 * k
                    parameter.mul_(1 + 0.05 * k).add_(noise)
        folder = run / f"step_{1000 * (k + 1)}"
        weights.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out.append(folder)
    return out


def write_adapters(model: Path, run: Path, count: int, rank: int = 8) -> list[Path]:
    """``count`` LoRA adapters of ``model`` (rank ``rank`` on every attention and MLP projection, ``A`` and ``B``
    seeded random, 0.02 of unit spread: PEFT's own initialisation zeroes ``B``, which would change nothing), saved
    as ``run/adapter_{1000·(k+1)}``: the adapters of a sweep over one base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for k in range(count):
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        adapted = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        folder = run / f"adapter_{1000 * (k + 1)}"
        adapted.save_pretrained(str(folder))
        out.append(folder)
    return out


def _prefix(processes: int) -> list[str]:
    return accelerate_launch_prefix(processes) if processes > 1 else [sys.executable]


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process's waited-for descendants (every rank of a launch included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Timed:
    """One command's wall seconds and its processes' CPU seconds: on a shared machine the wall time of a command
    also holds the other users' load, the CPU time mostly does not."""

    wall: float
    cpu: float


def _timed(cmd: list[str], env: dict[str, str]) -> Timed:
    t0, c0 = time.perf_counter(), _cpu_seconds()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"bench_series: exit code {proc.returncode}: {' '.join(cmd)}")
    return Timed(time.perf_counter() - t0, _cpu_seconds() - c0)


def _fingerprint(folder: Path) -> str:
    newest = max(glob.glob(f"{folder}/**/results_*.json", recursive=True))
    return json.loads(Path(newest).read_text())["config"]["distperp"]["fingerprint"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_series", description=__doc__)
    parser.add_argument("--model", type=Path, default=SHARED_MODEL, help="the model the stages perturb")
    parser.add_argument("--checkpoints", type=int, default=5, help="stages (default 5)")
    parser.add_argument("--limit", type=int, default=20, help="documents per task (default 20)")
    parser.add_argument("--processes", type=int, default=1, help="processes of every launch (default 1)")
    parser.add_argument("--max-length", type=int, default=512, help="max_length= (default 512)")
    parser.add_argument("--batch-size", default="8", help="batch_size= (default 8)")
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="the checkpoints are LoRA adapters of --model (write_adapters), evaluated as pretrained=MODEL,peft=...",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of both (each timing the fastest of them; default 1)"
    )
    args = parser.parse_args(argv)
    wikitext = str(WIKITEXT_TEST) if WIKITEXT_TEST.is_file() else "sample"
    env = environment({"DISTPERP_WIKITEXT_PATH": wikitext})
    include = str(TEST_TASKS)  # distperp_wikitext2 is found without it (distperp adds its own tasks)
    model_args = f"max_length={args.max_length}"
    # the same tasks, batch size and documents on both sides
    work = ["--tasks", TASKS, "--include_path", include, "--batch_size", args.batch_size, "--limit", str(args.limit)]
    with tempfile.TemporaryDirectory(prefix="bench_series_") as tmp:
        root = Path(tmp)
        write = write_adapters if args.adapters else write_stages
        stages = write(args.model, root / "run", args.checkpoints)
        base = ["--base", str(args.model)] if args.adapters else []

        def own(stage: Path) -> str:
            return f"pretrained={args.model},peft={stage}" if args.adapters else f"pretrained={stage}"

        warm = "import lm_eval.evaluator, distperp_harness.lm"  # untimed: the first process reads cold files
        subprocess.run([sys.executable, "-c", warm], env=env, capture_output=True, check=False)

        def run_series(out: Path) -> Timed:
            return _timed(
                [
                    *_prefix(args.processes),
                    "-m",
                    "distperp_harness",
                    "series",
                    "--checkpoints",
                    str(root / "run"),
                    "--model_args",
                    model_args,
                    *work,
                    "--output_path",
                    str(out),
                    *base,
                ],  # fmt: skip
                env,
            )

        def run_separate(stage: Path, out: Path) -> Timed:
            return _timed(
                [
                    *_prefix(args.processes),
                    "-m",
                    "lm_eval",
                    "--model",
                    "distperp",
                    "--model_args",
                    f"{own(stage)},{model_args}",
                    *work,
                    "--output_path",
                    str(out),
                ],  # fmt: skip
                env,
            )

        rounds: list[tuple[Timed, list[Timed]]] = []
        same: dict[str, bool] = {}
        for r in range(args.repeats):  # odd rounds run the separate runs first: a load that drifts hits both alike
            out = root / f"round{r}"
            series = run_series(out / "series") if r % 2 == 0 else None
            separate = [run_separate(stage, out / "separate" / stage.name) for stage in stages]
            series = series or run_series(out / "series")
            rounds.append((series, separate))
            for stage in stages:
                equal = _fingerprint(out / "series" / stage.name) == _fingerprint(out / "separate" / stage.name)
                same[stage.name] = same.get(stage.name, True) and equal
    series = Timed(min(t.wall for t, _ in rounds), min(t.cpu for t, _ in rounds))
    separate = [
        Timed(min(sep[i].wall for _, sep in rounds), min(sep[i].cpu for _, sep in rounds)) for i in range(len(stages))
    ]
    wall, cpu = sum(t.wall for t in separate), sum(t.cpu for t in separate)
    of = f" (fastest of {args.repeats})" if args.repeats > 1 else ""
    print(f"| work{of} | processes | wall s | CPU s |\n|---|---|---|---|")
    print(f"| series of {len(stages)} | {args.processes} | {series.wall:.1f} | {series.cpu:.1f} |")
    for stage, timed in zip(stages, separate):
        print(f"| lm_eval {stage.name} | {args.processes} | {timed.wall:.1f} | {timed.cpu:.1f} |")
    print(f"| lm_eval, all {len(stages)} | {args.processes} | {wall:.1f} | {cpu:.1f} |")
    for r, (one, sep) in enumerate(rounds if args.repeats > 1 else []):
        print(f"round {r}: series {one.wall:.1f} s, separate {sum(t.wall for t in sep):.1f} s (wall)")
    print(
        f"\nseries / separate: {series.wall / wall:.2f}x wall, {series.cpu / cpu:.2f}x CPU ({args.model.name}, "
        f"{TASKS}, --limit {args.limit}, max_length={args.max_length}); fingerprints equal: "
        + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in same.items())
    )
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
