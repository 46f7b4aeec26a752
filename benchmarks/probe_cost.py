"""What the probe's decision costs (issue 62's target: at most 1 s on CPU whatever the model's size).

Each run is a fresh process (as a real run pays it: no verdict kept, nothing warmed): it builds the model (a random
one of a published shape from ``benchmarks._scoring_common.RANDOM_SHAPES``, or a local folder in float32), then
times ``probe()`` alone for a run at ``batch_size=auto`` and the model's own context (the probe caps it). Prints each
run's seconds and the median.

    python -m benchmarks.probe_cost --shape gemma3-270m [--runs 5] [--threads 2]
    python -m benchmarks.probe_cost --model ~/.cache/distperp/smollm2-135m-instruct --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one_run(shape: str | None, model_dir: str | None, threads: int) -> float:
    """Seconds of one ``probe()`` on a freshly built model (a shape without ``model_type`` is a Llama), in this
    process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.run.rules import Batching
    from distperp_harness.run.runtime import attention_coefficient, row_budget
    from distperp_harness.run.scoring.engine import probe as probing
    from distperp_harness.run.scoring.engine.probe_cases import Target

    torch.set_num_threads(threads)
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        from benchmarks._scoring_common import RANDOM_SHAPES

        settings = dict(RANDOM_SHAPES[shape or "gemma3-270m"])
        kind, impl = settings.pop("model_type", "llama"), settings.pop("attn_implementation", "sdpa")
        torch.manual_seed(0)
        config = AutoConfig.for_model(kind, **settings)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    length = model.config.max_position_embeddings
    tokens, _ = row_budget(Batching(None, 4096, 64), length, attention_coefficient(model))
    start = time.perf_counter()
    probing.probe(model, torch.device("cpu"), 0, Target(length, tokens))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="a key of RANDOM_SHAPES (default gemma3-270m)")
    parser.add_argument("--model", default=None, help="a local Hugging Face folder instead of a random shape")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run: print its seconds
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.shape, args.model, args.threads)))
        return
    child = [sys.executable, "-m", "benchmarks.probe_cost", "--one", "--threads", str(args.threads)]
    child += ["--shape", args.shape] if args.shape else []
    child += ["--model", args.model] if args.model else []
    seconds = []
    for _ in range(args.runs):
        proc = subprocess.run(child, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"a run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        seconds.append(float(proc.stdout.strip().splitlines()[-1]))
        print(f"probe {seconds[-1]:.2f} s", flush=True)
    what = args.model or args.shape or "gemma3-270m"
    print(
        f"{what}: median {statistics.median(seconds):.2f} s over {len(seconds)} runs "
        f"({min(seconds):.2f}-{max(seconds):.2f} s), {args.threads} threads"
    )


if __name__ == "__main__":
    main()
