"""The sharded-weights check: peak memory of loading and scoring, sharded vs not, and equal bits.

    python -m benchmarks.shard_check                       # every visible GPU, one process each (>= 2 GPUs)
    python -m benchmarks.shard_check --device cpu          # dry mode: 2 CPU processes, the tiny test model
    python -m benchmarks.shard_check --processes 1         # one GPU: the mesh of one (also the default there)
    python -m benchmarks.shard_check --device cpu --processes 1   # its dry mode (gloo, one CPU process)

For each run (``--runs``: ``none`` = the model in bfloat16 on GPU / float32 on CPU, ``int4`` =
``quantize=int4,reference=base``) two launches of the real ``DistPerpLM`` score the same rolling documents:
``shard_size=1`` and ``shard_size=<processes>`` (``accelerate launch``), or with one process (``torchrun``, which sets
up the process group a device mesh needs) ``shard_size=1`` unsharded and ``shard_size=1`` on a **mesh of one**
(``DistPerpLM.in_process(mesh_of_one=True)``: FSDP2 applied on a one-process ``DeviceMesh``, so the sharded load path
- host staging, layer-by-layer move to the device, torchao weights left out of FSDP - and the sharded forward's
unshard/reshard run on one GPU; FSDP2 skips the all-gather itself for a group of one and copies each unit instead, so
NCCL is not exercised). Per run the table shows the largest per-rank peak of the load stage (CUDA allocator; host
``VmHWM`` on CPU), weight bytes resident per rank (model, reference), the largest per-rank peak of scoring, whether
the fingerprint equals the unsharded one (it must), and both peaks against the memory estimate made at start
(``distperp_harness/run/fit.py``; for the mesh of one plus the units FSDP copies while they are in use: the roots of
model and reference and the largest decoder layer, once each).

Default model: the random Llama-3.2-1B-shaped model of ``gpu_check`` (built into ``--work``); ``--model PATH``
uses a local checkpoint. Exits 1 when bits differ, when the sharded run holds more than 0.6x the weights per rank
(2+ processes), or on CUDA when a scoring peak exceeds its estimate by more than 25 % (:data:`OVER_ESTIMATE`; on
the CPU the host figures include the Python runtime, so the ratios are shown, not checked).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks import common
from benchmarks._gpu_common import base_parser, build_model, documents, gib, parse

OVER_ESTIMATE = 1.25
"""A CUDA scoring peak above this multiple of the estimate fails the check (the estimate must not under-count)."""


def model_args(args: argparse.Namespace, run: str, shard_size: int) -> dict:
    kwargs = dict(
        pretrained=str(args.model),
        device=args.device,
        batch_size=args.batch_size,
        max_length=args.max_length,
        shard_size=shard_size,
    )
    if args.device == "cuda":
        kwargs["dtype"] = "bfloat16"
    if run == "int4":
        kwargs.update(quantize="int4", reference="base")
    return kwargs


def worker(args: argparse.Namespace) -> None:
    """One launched process: load, score, and (rank 0) write what the table needs."""
    from distperp_harness.lm import DistPerpLM
    from distperp_harness.model.sharding import is_sharded

    lm = DistPerpLM.in_process(**model_args(args, args.run, args.shard_size), mesh_of_one=args.mesh_of_one)
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)  # scoring's peak, not the load's
    lm.loglikelihood_rolling([SimpleNamespace(args=(d,)) for d in documents(args.tokens)], disable_tqdm=True)
    info = lm.get_model_info()["distperp"]
    if lm.rank == 0:
        Path(args.work, "result.json").write_text(
            json.dumps(
                {
                    "fingerprint": info["fingerprint"],
                    "sharding": info["sharding"],
                    "fsdp": is_sharded(lm.model),
                    "estimate": info["memory_estimate"],
                    "copied": copied_units(lm) if args.mesh_of_one else 0,
                    "load": info["load_memory_per_rank"],
                    "score": info["calls"][-1]["peak_memory_bytes_per_rank"],
                }
            )
        )


def copied_units(lm) -> int:
    """Bytes FSDP2 holds unsharded on a mesh of one while a forward runs, which the estimate (made for
    ``shard_size=1``, where nothing is gathered) does not count: at a group of one FSDP2 skips the all-gather and
    copies each unit's parameters (once, no flat buffer) - the roots of model and reference for the whole batch,
    and the largest decoder layer of either (the model's layers are freed before the reference's forward).
    torchao-quantized weights are outside FSDP and never copied."""
    from distperp_harness.model.layers import decoder_layers

    def parts(model) -> tuple[int, int]:
        replicated = {p for p in model.parameters() if type(p).__name__ != "DTensor"}

        def size(params) -> int:
            return sum(p.numel() * p.element_size() for p in params if p not in replicated)

        in_layers = {p for layer in decoder_layers(model) for p in layer.parameters()}
        layer = max((size(layer.parameters()) for layer in decoder_layers(model)), default=0)
        return size(p for p in model.parameters() if p not in in_layers), layer

    roots, layers = zip(*(parts(m) for m in (lm.model, lm.reference) if m is not None))
    return int(sum(roots) + max(layers))


def launch(args: argparse.Namespace, run: str, shard_size: int, out: Path, mesh_of_one: bool = False) -> dict:
    """One run of the worker: ``accelerate launch`` of ``args.processes`` processes, or with one process
    ``torchrun`` (accelerate runs a single process without a process group, which a device mesh needs)."""
    out.mkdir(parents=True, exist_ok=True)
    worker_args = ["--worker", "--worker-run", run, "--shard-size", shard_size, "--model", args.model]
    worker_args += ["--device", args.device, "--tokens", args.tokens, "--max-length", args.max_length]
    worker_args += ["--batch-size", args.batch_size, "--work", out, *(["--mesh-of-one"] if mesh_of_one else [])]
    common.launch(
        "shard_check",
        worker_args,
        args.processes,
        device=args.device,
        torchrun=args.processes == 1,
        check=True,
        timeout=args.launch_timeout,
    )
    result = json.loads((out / "result.json").read_text())
    load = [
        m["device_peak_bytes"] if m["device_peak_bytes"] is not None else m["host_peak_rss_bytes"]
        for m in result["load"]
    ]
    sharding = result["sharding"]
    row = dict(
        run=run,
        shard_size=shard_size,
        mesh_of_one=mesh_of_one,
        fsdp=result["fsdp"],
        fingerprint=result["fingerprint"],
        load_peak=max((x for x in load if x is not None), default=None),
        model_bytes=max(sharding["model_bytes_per_rank"]),
        reference_bytes=max(r or 0 for r in sharding["reference_bytes_per_rank"]),
        score_peak=max(result["score"]),
        replicated=sum(map(len, sharding["replicated"].values())),
    )
    need = result["estimate"]
    if need is not None:  # rank 0's estimate (fit.Need); the mesh of one adds the units FSDP copies
        weights = need["model"] + need["reference"] + need["gathered"] + result["copied"]
        row.update(
            estimate_load=weights,
            estimate_total=sum(need.values()) + result["copied"],
            load_vs_estimate=row["load_peak"] / weights if row["load_peak"] and weights else None,
        )
        row["score_vs_estimate"] = row["score_peak"] / row["estimate_total"] if row["estimate_total"] else None
    return row


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| run | shard_size | load peak GiB (max rank) | model GiB/rank | reference GiB/rank | "
        "scoring peak GiB (max rank) | fingerprint | bits vs shard_size=1 | estimate GiB (weights, total) | "
        "load / weights estimate | scoring / total estimate |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        size = f"{r['shard_size']} (mesh of one)" if r.get("mesh_of_one") else str(r["shard_size"])
        estimate = (
            f"{gib(r['estimate_load'])}, {gib(r['estimate_total'])}" if r.get("estimate_total") is not None else "n/a"
        )
        score = _ratio(r.get("score_vs_estimate")) + (" OVER" if r.get("over") else "")
        lines.append(
            f"| {r['run']} | {size} | {gib(r['load_peak'])} | {gib(r['model_bytes'])} | "
            f"{gib(r['reference_bytes'])} | {gib(r['score_peak'])} | {r['fingerprint']} | "
            f"{r.get('same', 'reference')} | {estimate} | {_ratio(r.get('load_vs_estimate'))} | {score} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, 300)
    parser.add_argument("--runs", default="none,int4", help="comma-separated: none, int4 (with reference=base)")
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="cuda: visible GPUs; cpu: 2; 1: the mesh of one (shard_size=1 unsharded vs on a one-process device mesh)",
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens scored per run (cuda 32768, cpu 1500)")
    parser.add_argument("--batch-size", default="4", help="rows per batch (an integer: the same plan in every run)")
    parser.add_argument("--worker-run", dest="run", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--shard-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mesh-of-one", action="store_true", help=argparse.SUPPRESS)
    args = parse(parser, argv, tokens=(32768, 1500))
    common.use_offline_env(args.device)  # on CUDA torchao's kernels load (the int4 runs)
    cuda = args.device == "cuda"
    if args.worker:
        worker(args)
        return 0
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu for the dry mode")
    args.processes = args.processes or (torch.cuda.device_count() if cuda else 2)
    if args.processes < 1 or (cuda and args.processes > torch.cuda.device_count()):
        parser.error(
            f"--processes {args.processes}: give 1 (the mesh of one) up to the visible GPUs "
            f"({torch.cuda.device_count() if cuda else 'any on cpu'})"
        )
    one = args.processes == 1
    args.work = args.work or tempfile.mkdtemp(prefix="distperp-shard-check-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.model = build_model(args)
    rows = []
    for run in args.runs.split(","):
        whole = launch(args, run, 1, Path(args.work) / f"{run}-1")
        sharded = (
            launch(args, run, 1, Path(args.work) / f"{run}-mesh1", mesh_of_one=True)
            if one
            else launch(args, run, args.processes, Path(args.work) / f"{run}-{args.processes}")
        )
        sharded["same"] = (
            "equal"
            if sharded["fingerprint"] == whole["fingerprint"] and sharded["fsdp"]
            else "DIFFERENT"
            if sharded["fsdp"]
            else "NOT SHARDED"
        )
        sharded["ratio"] = (sharded["model_bytes"] + sharded["reference_bytes"]) / (
            whole["model_bytes"] + whole["reference_bytes"]
        )
        rows += [whole, sharded]
    for r in rows:
        r["over"] = cuda and (r.get("score_vs_estimate") or 0) > OVER_ESTIMATE
    print(table(rows), flush=True)
    if one:
        print(
            f"mesh of one: FSDP2 on a one-process device mesh, fingerprints "
            f"{'equal' if all(r.get('same', 'equal') == 'equal' for r in rows) else 'NOT equal'} to the "
            f"unsharded run{'' if cuda else '; CPU dry mode: host peaks include the runtime, ratios not checked'}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    ok = all(r.get("same", "equal") == "equal" and (one or r.get("ratio", 0) <= 0.6) and not r["over"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
