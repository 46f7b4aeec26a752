"""What a model bigger than one device costs: ``shard_size=N`` (FSDP2) against ``tp_size=N`` (tensor parallel),
counted from the collectives themselves, with a projection to Llama-3.1-70B in bf16 on 8 GPUs.

    python -m benchmarks.tp_traffic --model ~/.cache/distperp/smollm2-135m-instruct --size 3
    python -m benchmarks.tp_traffic --model ../shared/models/wt2-llama-5m --size 2 --prompts 4 --new 16

Three launches of the real ``DistPerpLM`` (``accelerate launch``, gloo on CPU, nccl on GPU): one process holding the
whole model, ``shard_size=N`` and ``tp_size=N`` on N processes. Each records ``config.distperp.traffic``: the
bytes every collective of a few probe forwards moved (:mod:`distperp_harness.distributed.traffic`: eager
``torch.distributed`` calls and DTensor's functional collectives, with ring receive factors), fitted per decode
step (``fixed + per_row * rows``) and per scored token; and the weight bytes each rank holds. Each then generates
``--prompts`` greedy continuations of ``--new`` tokens (batch of all prompts), timed inside the process, median of
``--repeats``, and its texts are compared with the one-process texts.

Printed: the counted table; the formula for each layout checked against the counts (TP: per row
``2(n-1)/n (2L+1) h b + (n-1)/n V b`` for the all-reduces of the embedding and two per layer, and the gathered
output head; FSDP: per forward ``(n-1)/n W``, the whole weights gathered once); the same formulas for
Llama-3.1-70B bf16 on 8 GPUs (L=80, h=8192, V=128256, W=141 GB) at 64 rows, with the time at 450 GB/s (NVLink
one direction). The model must have heads divisible by N for ``tp_size`` (SmolLM2-135M: 9 and 3 heads, so N=3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

SEVENTY_B = {"layers": 80, "hidden": 8192, "vocab": 128256, "weight_bytes": 141.1e9, "dtype_bytes": 2, "n": 8}
NVLINK = 450e9
PROMPTS = [
    "The history of the city began",
    "In the morning the market",
    "Scientists studied the river",
    "The old library held",
    "During the winter the village",
    "A small boat crossed",
    "The station was",
    "Her first book described",
]


def worker(args: argparse.Namespace) -> None:
    import torch
    from lm_eval.api.instance import Instance

    from distperp_harness.lm import DistPerpLM

    lm = DistPerpLM(
        pretrained=args.model,
        dtype=args.dtype,
        batch_size=len(PROMPTS[: args.prompts]),
        max_length=256,
        **json.loads(args.config),
    )
    requests = [
        Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": args.new, "do_sample": False}), i)
        for i, p in enumerate(PROMPTS[: args.prompts])
    ]
    seconds, texts = [], []
    for _ in range(args.repeats):
        lm.collective.barrier("start together")
        start = time.perf_counter()
        texts = lm.generate_until(requests, disable_tqdm=True)
        seconds.append(time.perf_counter() - start)
    info = lm.get_model_info()["distperp"] if hasattr(lm, "get_model_info") else {}
    if lm.rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "traffic": lm.traffic,
                    "sharding": info.get("sharding"),
                    "weight_bytes": lm.weight_bytes,
                    "seconds": statistics.median(seconds),
                    "texts": texts,
                    "torch_threads": torch.get_num_threads(),
                    "config": {
                        k: getattr(lm.model.config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")
                    },
                }
            )
        )


def launch(args: argparse.Namespace, config: dict, processes: int, out: Path) -> dict:
    """One layout: this module's worker on ``processes`` processes (``accelerate launch``), its JSON record.

    Raises:
        SystemExit: the launch failed, with the layout and the tail of its stderr.
    """
    worker_args = ["--worker", "--model", args.model, "--config", json.dumps(config), "--out", out]
    worker_args += ["--prompts", args.prompts, "--new", args.new, "--repeats", args.repeats, "--dtype", args.dtype]
    done = common.launch("tp_traffic", worker_args, processes, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"launch {config} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def tp_per_row(layers: int, hidden: int, vocab: int, b: int, n: int) -> float:
    """Bytes one rank receives per row of a decode step under tensor parallelism (module doc)."""
    return 2 * (n - 1) / n * (2 * layers + 1) * hidden * b + (n - 1) / n * vocab * b


def fsdp_per_forward(weight_bytes: float, n: int) -> float:
    """Bytes one rank receives per forward under FSDP: every weight gathered once."""
    return (n - 1) / n * weight_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(common.SMOLLM2))
    parser.add_argument("--size", type=int, default=3, help="N: processes per shard group / TP group")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="model dtype (bfloat16 on GPUs)")
    parser.add_argument(
        "--layouts",
        default="one,shard,tp",
        help="which launches: one (1 process), shard (shard_size=N), tp (tp_size=N); comma-separated",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    n = args.size
    with tempfile.TemporaryDirectory() as tmp:
        layouts = {
            "one": ("1 process", {}, 1),
            "shard": (f"shard_size={n}", {"shard_size": n}, n),
            "tp": (f"tp_size={n}", {"tp_size": n}, n),
        }
        runs = {
            name: launch(args, config, procs, Path(tmp) / f"{key}.json")
            for key, (name, config, procs) in layouts.items()
            if key in args.layouts.split(",")
        }
    base = runs.get("1 process") or runs.get(f"shard_size={n}") or runs[f"tp_size={n}"]  # for ratios and texts
    cfg = base["config"]
    print(
        f"- model: {args.model}: {cfg}, {base['weight_bytes'] / 1e6:.1f} MB of weights ({args.dtype}); {args.prompts} "
        f"prompts x {args.new} new tokens, median of {args.repeats}"
    )
    print(
        "\n| layout | weights per rank | decode step, 1 row | 64 rows | per scored token (2k-token batch) | "
        "generate | vs 1 process | texts = 1 process |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, run in runs.items():
        per_rank = max((run["sharding"] or {}).get("model_bytes_per_rank") or [run["weight_bytes"]])
        t = run["traffic"] or {
            "decode_step_received_bytes": {"fixed": 0, "per_row": 0},
            "scoring_received_bytes": {"fixed": 0, "per_token": 0},
        }
        d, s = t["decode_step_received_bytes"], t["scoring_received_bytes"]
        same = sum(a == b for a, b in zip(run["texts"], base["texts"]))
        print(
            f"| {name} | {per_rank / 1e6:.1f} MB | {(d['fixed'] + d['per_row']) / 1e6:.3f} MB | "
            f"{(d['fixed'] + 64 * d['per_row']) / 1e6:.2f} MB | {(s['fixed'] / 2048 + s['per_token']) / 1e3:.1f} kB | "
            f"{run['seconds']:.2f} s | {run['seconds'] / base['seconds']:.2f}x | {same}/{len(base['texts'])} |"
        )
    b = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    if f"tp_size={n}" in runs:
        counted = runs[f"tp_size={n}"]["traffic"]["decode_step_received_bytes"]["per_row"]
        formula = tp_per_row(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], b, n)
        print(
            f"\n- formula: TP received bytes per rank per row {formula:.0f} vs counted {counted} "
            f"({counted / formula:.3f}x)"
        )
    if f"shard_size={n}" in runs:
        counted = runs[f"shard_size={n}"]["traffic"]["decode_step_received_bytes"]["fixed"]
        formula = fsdp_per_forward(base["weight_bytes"], n)
        print(
            f"- formula: FSDP received bytes per rank per forward {formula:.0f} vs counted {counted} "
            f"({counted / formula:.3f}x)"
        )
    m = SEVENTY_B
    rows = 64
    tp70 = rows * tp_per_row(m["layers"], m["hidden"], m["vocab"], m["dtype_bytes"], m["n"])
    fsdp70 = fsdp_per_forward(m["weight_bytes"], m["n"])
    print(
        f"\n- projection: Llama-3.1-70B bf16 on {m['n']} GPUs, one decode step of {rows} rows, received per rank: "
        f"shard_size=8 {fsdp70 / 1e9:.1f} GB ({fsdp70 / NVLINK * 1e3:.0f} ms at 450 GB/s), tp_size=8 "
        f"{tp70 / 1e9:.3f} GB ({tp70 / NVLINK * 1e3:.2f} ms; {2 * m['layers'] + 2} collectives, latency-bound); "
        f"weights per rank {m['weight_bytes'] / m['n'] / 1e9:.1f} GB either way. Scoring a 16,384-token batch: "
        f"shard_size=8 {fsdp70 / 16384 / 1e6:.2f} MB per token, tp_size=8 "
        f"{tp_per_row(m['layers'], m['hidden'], m['vocab'], 2, 8) / 1e6:.2f} MB per scored token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
