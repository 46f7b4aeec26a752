"""``python -m distperp_harness demo``: the main job on embedded defaults, offline, in a few minutes on 2 CPU cores.

1. Build (once, cached) the demo model: a small Llama trained briefly on the packaged WikiText-format sample.
2. ``accelerate launch`` with N processes: ``lm_eval --model distperp`` on ``distperp_wikitext2`` over the
   sample, fp32. lm-eval prints its results table.
3. The same with ``quantize=int4,reference=base``: perplexities, KL divergence and top-1 agreement vs fp32.
4. One process, fp32: per-document results and the fingerprint must equal the N-process run's, bit for bit.
5. A comparison table of the runs, and their figure (``compare.png``, when matplotlib is installed) in the
   current folder, or in ``--out`` when given (the runs' results folders go there too; by default to a temporary
   folder, named at the end).

The exit code (:mod:`~.exitcodes`): 0 when 1 and N processes gave the same bits, 3 when not.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from distperp_harness.commands.launching import lm_eval_command, offline_env
from distperp_harness.commands.samples import responses_by_doc
from distperp_harness.commands.taskdir import tasks_path

TASK = "distperp_wikitext2"


def _launch(processes: int, model_args: str, out: Path, sample: Path) -> float:
    """Run lm-eval under ``accelerate launch``; stream its output; return wall seconds."""
    cmd = lm_eval_command(
        processes,
        model_args,
        TASK,
        output_path=out,
        include_path=tasks_path(),
        metadata={"wikitext_path": str(sample)},
        extra=["--batch_size", "4"],
    )
    print(
        f"\n$ accelerate launch --num_processes {processes} -m lm_eval --model distperp "
        f"--model_args {model_args} --tasks {TASK} ...",
        flush=True,
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env=offline_env(keep_set=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wall = time.perf_counter() - t0
    table = [line for line in proc.stdout.splitlines() if line.startswith(("|", "distperp ("))]
    print("\n".join(table) if proc.returncode == 0 else proc.stdout[-4000:], flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo run failed (exit {proc.returncode})")
    return wall


def _per_doc(samples: Path) -> dict[int, list]:
    return responses_by_doc(json.loads(line) for line in samples.read_text().splitlines() if line.strip())


def run_demo(out: str | None = None, processes: int = 2) -> int:
    """Run the demo; the exit code: 0 when the 1-process and N-process results are identical, 3 when not."""
    from distperp_harness.commands.exitcodes import for_failures
    from distperp_harness.commands.tiny import DEMO_SPEC, cached_tiny_model, sample_text_path

    t0 = time.perf_counter()
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="distperp-demo-"))
    figure = (Path(out) if out else Path.cwd()) / "compare.png"  # where the user stands, or --out
    print("distperp demo: building (or reusing) the demo model ...", flush=True)
    model = cached_tiny_model(DEMO_SPEC)
    sample = sample_text_path()
    print(f"model: {model}\ndata:  {sample} (WikiText-format sample shipped with the package)", flush=True)
    base = f"pretrained={model},max_length=256"
    configs = {
        f"fp32, {processes} processes": (processes, base),
        f"int4 vs fp32, {processes} processes": (processes, f"{base},quantize=int4,reference=base"),
        "fp32, 1 process": (1, base),
    }
    folders = {}
    for i, (name, (n, args)) in enumerate(configs.items()):
        folders[name] = root / f"run{i}"
        _launch(n, args, folders[name], sample)

    from distperp_harness.commands.compare import load_run, markdown_table

    runs = {name: load_run(folder) for name, folder in folders.items()}
    many, one = runs[f"fp32, {processes} processes"], runs["fp32, 1 process"]
    fingerprints = [many.fingerprint, one.fingerprint]
    identical = _per_doc(many.samples[TASK]) == _per_doc(one.samples[TASK]) and fingerprints[0] == fingerprints[1]
    print("\n" + markdown_table(list(runs.values())))
    print(
        f"\n1 process vs {processes} processes: per-document log-likelihoods and fingerprint "
        f"{'IDENTICAL' if identical else 'DIFFERENT'} ({fingerprints[0]} / {fingerprints[1]})"
    )
    from distperp_harness.commands.plots import PlotUnavailable, plot_compare

    try:
        print(plot_compare(list(runs.values()), figure).line("demo"))
    except PlotUnavailable as error:
        print(f"demo: no figure: {error}")
    print(f"results in {root}; demo took {time.perf_counter() - t0:.0f} s")
    return for_failures(not identical)
