"""The sharded-weights check (issue 12): peak memory of loading and scoring, sharded vs not, and equal bits.

    python benchmarks/shard_check.py                       # every visible GPU, one process each (>= 2 GPUs)
    python benchmarks/shard_check.py --device cpu          # dry mode: 2 CPU processes, the tiny test model

For each run (``--runs``: ``none`` = the model in bfloat16 on GPU / float32 on CPU, ``int4`` =
``quantize=int4,reference=base``) two ``accelerate launch`` runs of the real ``DistPerpLM``, ``shard_size=1`` and
``shard_size=<processes>``, score the same rolling documents. Per run the table shows the largest per-rank peak
of the load stage (CUDA allocator; host ``VmHWM`` on CPU), weight bytes resident per rank (model, reference),
the largest per-rank peak of scoring, and whether the sharded fingerprint equals the unsharded one (it must).

Default model: the random Llama-3.2-1B-shaped model of ``gpu_check.py`` (built into ``--work``); ``--model PATH``
uses a local checkpoint. Exits 1 when bits differ or the sharded run holds more than 0.6x the weights per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# benchmarks/ is this script's folder, hence on sys.path
from gpu_check import base_parser, build_model, documents, gib, parse  # noqa: E402


def model_args(args: argparse.Namespace, run: str, shard_size: int) -> dict:
    kwargs = dict(pretrained=str(args.model), device=args.device, batch_size=args.batch_size,
                  max_length=args.max_length, shard_size=shard_size)
    if args.device == "cuda":
        kwargs["dtype"] = "bfloat16"
    if run == "int4":
        kwargs.update(quantize="int4", reference="base")
    return kwargs


def worker(args: argparse.Namespace) -> None:
    """One launched process: load, score, and (rank 0) write what the table needs."""
    from distperp_harness.lm import DistPerpLM

    lm = DistPerpLM(**model_args(args, args.run, args.shard_size))
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)  # scoring's peak, not the load's
    lm.loglikelihood_rolling([SimpleNamespace(args=(d,)) for d in documents(args.tokens)], disable_tqdm=True)
    info = lm.get_model_info()["distperp"]
    if lm.rank == 0:
        Path(args.work, "result.json").write_text(json.dumps({
            "fingerprint": info["fingerprint"], "sharding": info["sharding"],
            "load": info["load_memory_per_rank"], "score": info["calls"][-1]["peak_memory_bytes_per_rank"]}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, run: str, shard_size: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           str(args.processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), __file__, "--worker", "--run", run,
           "--shard-size", str(shard_size), "--model", str(args.model), "--device", args.device,
           "--tokens", str(args.tokens), "--max-length", str(args.max_length), "--batch-size", args.batch_size,
           "--work", str(out)]
    subprocess.run(cmd, check=True, timeout=args.launch_timeout, cwd=REPO)
    result = json.loads((out / "result.json").read_text())
    load = [m["device_peak_bytes"] if m["device_peak_bytes"] is not None else m["host_peak_rss_bytes"]
            for m in result["load"]]
    sharding = result["sharding"]
    return dict(run=run, shard_size=shard_size, fingerprint=result["fingerprint"],
                load_peak=max((x for x in load if x is not None), default=None),
                model_bytes=max(sharding["model_bytes_per_rank"]),
                reference_bytes=max(r or 0 for r in sharding["reference_bytes_per_rank"]),
                score_peak=max(result["score"]), replicated=sum(map(len, sharding["replicated"].values())))


def table(rows: list[dict]) -> str:
    lines = ["| run | shard_size | load peak GiB (max rank) | model GiB/rank | reference GiB/rank | "
             "scoring peak GiB (max rank) | fingerprint | bits vs shard_size=1 |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['shard_size']} | {gib(r['load_peak'])} | {gib(r['model_bytes'])} | "
                     f"{gib(r['reference_bytes'])} | {gib(r['score_peak'])} | {r['fingerprint']} | "
                     f"{r.get('same', 'reference')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, 300)
    parser.add_argument("--runs", default="none,int4", help="comma-separated: none, int4 (with reference=base)")
    parser.add_argument("--processes", type=int, default=None, help="cuda: visible GPUs; cpu: 2")
    parser.add_argument("--tokens", type=int, default=None, help="tokens scored per run (cuda 32768, cpu 1500)")
    parser.add_argument("--batch-size", default="4", help="rows per batch (an integer: the same plan in every run)")
    parser.add_argument("--run", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--shard-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parse(parser, argv, tokens=(32768, 1500))
    cuda = args.device == "cuda"
    if args.worker:
        worker(args)
        return 0
    if cuda and torch.cuda.device_count() < 2:
        parser.error("needs at least 2 visible GPUs (one process each); --device cpu runs the dry mode")
    args.processes = args.processes or (torch.cuda.device_count() if cuda else 2)
    args.work = args.work or tempfile.mkdtemp(prefix="distperp-shard-check-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.model = build_model(args)
    rows = []
    for run in args.runs.split(","):
        whole, sharded = (launch(args, run, size, Path(args.work) / f"{run}-{size}") for size in (1, args.processes))
        sharded["same"] = "equal" if sharded["fingerprint"] == whole["fingerprint"] else "DIFFERENT"
        total = lambda r: r["model_bytes"] + r["reference_bytes"]  # noqa: E731
        sharded["ratio"] = total(sharded) / total(whole)
        rows += [whole, sharded]
    print(table(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    ok = all(r.get("same", "equal") == "equal" and r.get("ratio", 0) <= 0.6 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
