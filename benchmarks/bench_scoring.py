"""Scoring speed and memory: lm-eval's ``hf`` model vs ``distperp`` on the same checkpoint, dtype, batch and work.

    python -m benchmarks.bench_scoring                 # both models, all scorers: ~13 min on 2 CPU cores
    python -m benchmarks.bench_scoring --quick         # small subsets: ~5 min
    python -m benchmarks.bench_scoring --models wt2-llama-5m --scorers hf,distperp --cli 62   # + the real CLI
    python -m benchmarks.bench_scoring --profile       # torch.profiler op breakdown instead of timing
    python -m benchmarks.bench_scoring --sweep 2,4,8,16,32,64 --models wt2-llama-5m   # tokens/s per batch size
    python -m benchmarks.bench_scoring --random-shape llama-1b --device cuda --dtype bfloat16 --no-memory

Work: ``loglikelihood_rolling`` over WikiText-2 test articles (``../shared/data/wikitext-2/test.txt``, read at run
time, split on top-level `` = Title = `` lines), disjoint windows of ``--max-length`` tokens, ``--batch-size`` rows,
float32, one process, CPU (``--device cuda --dtype bfloat16``: both scorers on ``cuda:0`` in that dtype). Both models
are built in-process with lm-eval's registry (``get_model(name).create_from_arg_string``) and called with the same
``Instance`` objects.

Models: ``../shared/models/wt2-llama-5m`` (5.5M parameters, vocab 8,192) and a random-init Llama with 52M
parameters and vocab 32,000 built in a temporary folder (it reuses the wt2-llama-5m tokenizer: a model vocab
larger than the tokenizer's is valid, the extra rows are never targets but are part of every softmax).
``--random-shape NAME`` scores a random-init model of a shape in :data:`RANDOM_SHAPES` instead (``llama-1b``:
Llama-3.2-1B's, for GPUs; ``tiny``: the test model's, for dry runs), built once into ``--workdir``.

Timing (in-process): each repeat runs every scorer once, in an order rotated per repeat (hf, distperp, bare, ...), so
slow phases of a shared machine hit all of them; tokens/s is scored tokens over the call's wall time. The table shows
the best repeat of each scorer (interference only ever slows a run down, so the fastest run is the least disturbed one);
the notes give medians, per-repeat ratios and the ratio of process CPU times. ``bare forward`` is ``model(ids).logits``
(no log-softmax) on exactly distperp's padded windows and batches, tensors built before the clock starts. ``distperp /
bare`` uses distperp's scoring stage (exchange, plan, forward, log-probs; its ``scoring_seconds``), not tokenization;
the end-to-end figure is printed too.

Memory (one fresh subprocess per scorer): load, build the requests, then score ``--memory-tokens`` tokens while
a thread samples the resident set size (``/proc/self/statm``) every millisecond. Peak memory of scoring is the
highest RSS during the call minus the RSS just before it (on CUDA: the allocator's peak during the call minus
what was allocated before it); when the call raised the process's high-water mark
(``getrusage`` ``ru_maxrss``), that exact kernel figure is used instead of the sampled one. torch on CPU allocates
through malloc, so RSS is what scoring really holds (``tracemalloc`` does not see torch tensors).

Sweep (``--sweep ROWS``, instead of timing; it was ``batch_sweep.py``): distperp's ``score_batch`` alone on
full-length windows of random ids at each row count, tokens/s per batch size and against the fastest size
(:mod:`benchmarks._scoring_sweep`).

Prints a markdown table (date, machine, versions) for ``benchmarks/README.md``; ``--json PATH`` saves raw numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks._scoring_common import RANDOM_MODEL, RANDOM_SHAPES, SCORERS, _quiet, resolve_model
from benchmarks._scoring_memory import memory_worker
from benchmarks._scoring_profile import profile_scorers
from benchmarks._scoring_speed import bench_model, cli_sanity, report
from benchmarks._scoring_sweep import sweep_rows
from benchmarks.common import WIKITEXT_TEST, use_offline_env

# What the parts measure: _scoring_speed.py (alternating timed repeats, the CLI check, the table), _scoring_memory.py
# (peak scoring memory in a fresh subprocess per scorer), _scoring_profile.py (--profile), _scoring_sweep.py
# (--sweep); _scoring_common.py holds what they share (models, work, scorers, machine), with bench_mc and bench_compile.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small subsets and 3 repeats (a few minutes)")
    p.add_argument(
        "--models",
        default=f"wt2-llama-5m,{RANDOM_MODEL}",
        help=f"comma-separated: wt2-llama-5m, random-<shape> ({', '.join(RANDOM_SHAPES)}), or model folders",
    )
    p.add_argument(
        "--random-shape",
        default=None,
        choices=tuple(RANDOM_SHAPES),
        help="score only a random-init model of this shape (the same as --models random-<shape>)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both scorers run (cuda: cuda:0)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype of both scorers"
    )
    p.add_argument("--scorers", default=",".join(SCORERS), help=f"comma-separated subset of {', '.join(SCORERS)}")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=None, help="alternating repeats (default 5, --quick 3)")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="score the first articles up to this many tokens (0: all; default per model); "
        "--sweep: tokens per size and round (default 65536)",
    )
    p.add_argument(
        "--memory-tokens",
        type=int,
        default=None,
        help="tokens scored by each memory subprocess (default: batch x max_length, x2 without --quick)",
    )
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory subprocesses")
    p.add_argument("--memory-scorers", default=None, help="scorers to measure memory of (default: all timed ones)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--text", default=str(WIKITEXT_TEST), help="WikiText test.txt")
    p.add_argument("--workdir", default=None, help="where to build the random model (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the raw numbers to this file")
    p.add_argument(
        "--cli",
        type=int,
        default=0,
        metavar="N",
        help="also run the real lm-eval CLI once each way on N documents of distperp_wikitext2",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: torch.profiler op breakdown of hf, distperp and the bare forward",
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="ROWS",
        help="instead of timing: tokens/s of score_batch at each of these row counts (comma-separated)",
    )
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    if args.random_shape:
        args.models = f"random-{args.random_shape}"
    args.memory_scorers = (
        args.scorers
        if args.memory_scorers is None
        else [s.strip() for s in args.memory_scorers.split(",") if s.strip()]
    )
    unknown = [s for s in args.scorers if s not in SCORERS]
    if unknown or "distperp" not in args.scorers:
        p.error(f"--scorers {','.join(args.scorers)}: allowed {', '.join(SCORERS)}; distperp is required")
    if args.repeats is None:
        args.repeats = 3 if args.quick or args.sweep else 5
    if args.memory_tokens is None:
        args.memory_tokens = (1 if args.quick else 2) * args.batch_size * args.max_length
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_offline_env(args.device)  # on CUDA torchao's kernels load (int4 scorers)
    if args.memory_worker:
        print(json.dumps(memory_worker(args)))
        return 0
    import torch

    _quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_scoring_") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if args.profile:
                print(profile_scorers(resolve_model(name, workdir), args), flush=True)
                continue
            if args.sweep:
                print(sweep_rows(resolve_model(name, workdir), args) + "\n", flush=True)
                continue
            results.append(bench_model(name, resolve_model(name, workdir), args))
            if args.cli:
                results[-1].notes.append(cli_sanity(resolve_model(name, workdir), args))
    if args.profile or args.sweep:
        return 0
    table = report(results, args)
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
