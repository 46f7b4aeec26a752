"""Bytes two processes move to score an MMLU-Pro-shaped task: what distperp's exchange costs on a real launch.

    python -m benchmarks.traffic                      # launches itself under accelerate with 2 processes
    python -m benchmarks.traffic --questions 300 --model ../shared/models/wt2-llama-5m

Builds ``--questions`` leaderboard MMLU-Pro 5-shot questions (``bench_mc``'s ``mmlupro5`` layout: one few-shot block,
10 one-token options), scores them with ``--model distperp`` on 2 processes (gloo, loopback), and prints

* the payload bytes each rank received from the others through distperp's collectives, from the start of the run
  (the model's start-up exchanges included) to the end of the call, and
* the machine's loopback traffic over the same span (``/proc/net/dev``, every byte on ``lo``: payloads, gloo and
  store framing, and anything else running — run it on a quiet machine).

Target: at most 4 MB in all for 300 questions (19.6 MB before records replaced tokens in the exchange).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import common


def loopback_bytes() -> int:
    """Bytes received on ``lo`` since boot (0 where /proc/net/dev is missing)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except OSError:
        pass
    return 0


def job(args) -> None:
    """One rank of the launch: build the questions, score them, report."""
    import torch

    torch.set_num_threads(1)
    start = loopback_bytes()
    from benchmarks.bench_mc import build_questions, requests_for
    from distperp_harness.lm import DistPerpLM

    lm = DistPerpLM(pretrained=args.model, max_length=args.max_length, batch_size=args.batch_size, device="cpu")
    ids = lm.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)
    questions = build_questions("mmlupro5", ids, lambda t: lm.tokenizer.decode(t), args.questions)
    mine = requests_for(questions)[lm.rank :: lm.world_size]  # lm-eval's split, one document's options together
    lm.loglikelihood(mine, disable_tqdm=True)
    totals = lm.collective.all_gather_object(
        (getattr(lm.collective, "bytes_received", 0), getattr(lm.collective, "bytes_sent", 0)), "traffic"
    )
    moved = loopback_bytes() - start
    if lm.rank == 0:
        call = lm.stats.calls[-1].to_dict()
        prompt = len(lm.tokenizer.encode(questions[0][0][0][0], add_special_tokens=False))
        print(
            f"{args.questions} questions x 10 options, {prompt}-token prompts, {call['units']} units, "
            f"{call['batches']} batches, claiming {call['claiming']}, per rank {call['per_rank']}"
        )
        for r, (received, sent) in enumerate(totals):
            print(
                f"rank {r}: received {received / 1e6:.3f} MB, sent {sent / 1e6:.3f} MB through distperp's collectives"
            )
        print(
            f"collective payloads received in all: {sum(r for r, _ in totals) / 1e6:.3f} MB; loopback traffic "
            f"over the run: {moved / 1e6:.3f} MB"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(common.SHARED_MODEL))
    p.add_argument("--text", default=str(common.WIKITEXT_TEST))
    p.add_argument("--questions", type=int, default=300)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", default="8")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job(args)
        return 0
    job_args = ["--job", "--model", args.model, "--text", args.text, "--questions", args.questions]
    job_args += ["--max-length", args.max_length, "--batch-size", args.batch_size]
    return common.launch("traffic", job_args, 2, extra_env={"OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())
