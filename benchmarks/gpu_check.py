"""The GPU check of distperp: one command, one table, at most ~8 minutes on one GPU.

    python -m benchmarks.gpu_check                    # one GPU (two or more: also 1 vs 2 processes)
    python -m benchmarks.gpu_check --device cpu       # dry mode on the tiny test model (runs in `make test`)

For each run (``bfloat16``, ``quantize=int4`` and ``int4-kernel``: ``quantize=int4,int4_prefill=kernel``, torchao's
int4 kernel for every product, by default) through the real ``DistPerpLM`` with ``batch_size=auto``:
load time and peak CUDA memory of the load stage, weight bytes, ``auto``'s token budget (chosen twice: the answer must
not move), rolling log-likelihood tokens/s over ``--tokens`` tokens of text, for the unquantized run its MFU (2 x
parameters x tokens/s over the GPU's dense bf16 peak, from an exact table of GPU names: "unknown" for any other GPU) and
for quantized runs the speed-up over it instead (MFU against a bf16 peak means little for int4 kernels), peak CUDA
memory of scoring, the first batch of the plan computed twice (bits must be equal), how many Linear layers were
quantized (every one must be), and whether the run's memory was released (the model collected after ``gc.collect()``,
and on CUDA the allocated bytes back at the baseline after ``torch.cuda.empty_cache()``). The load peak is the loader's
own meter (``config.distperp.load_memory_per_rank``). With two or more GPUs (or ``--processes 2`` on CPU) the rolling
fingerprint of 1 and of 2 processes (``accelerate launch``) must be equal.

The tree-row case (``--tree-impls``, one row per attention implementation, default ``sdpa,flex_attention`` on CUDA
and ``sdpa`` in the dry mode, where compiling flex's CPU kernels takes minutes): MMLU-Pro-shaped 5-shot questions
(lm-eval's leaderboard template with ``first_n`` examples: a ~700-token block of five solved questions shared by
every question, ~140 tokens of its own, ten one-token letters ``" A"`` .. ``" J"``; synthetic, cut from the
packaged sample) through ``DistPerpLM.loglikelihood`` with ``attn_implementation=`` each one: one untimed call
(compiles flex's kernels for every batch shape), then a timed one: request tokens/s (context + continuation of
every answer, the unshared work), computed tokens per question, peak CUDA memory of the timed call, and whether
the chosen answers (argmax over the ten letters) equal sdpa's. A model or torch that cannot run flex attention
(or takes no tree mask with it) gets a "skipped" row with the reason.

Compiled rows (``--compile on``; off by default: ``compile=`` is not offered on CUDA, where it measured slower than
eager, and compiling on the CPU dry run would take most of its time): each run again with ``compile=true``, its
tokens/s against the same run eager (and the MFU for bf16), its compile seconds, recompilations after the warm-up
(must be 0) and the same first batch twice (equal bits).

Default model: a random Llama-3.2-1B-shaped model (1.24B parameters, 128,256-entry head) built by
``distperp_harness.commands.tiny`` into ``--work``; ``--model PATH`` uses a local checkpoint instead. Exits 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks import common
from benchmarks._gpu_common import base_parser, build_model, documents, gib, model_args, parse
from benchmarks._gpu_tree import tree_case, tree_table
from distperp_harness.commands.release import cuda_baseline, released

# Dense (no sparsity) bf16 tensor-core peak in FLOP/s, by the exact name torch.cuda.get_device_name() reports
# (NVIDIA datasheets). Any other name: MFU "unknown", never a guess from a similar name (H100 PCIe and NVL are
# 24 % and 16 % below the SXM part).
PEAK_BF16 = {
    "NVIDIA H100 80GB HBM3": 989.4e12,  # H100 SXM
    "NVIDIA H100 PCIe": 756.0e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.4e12,  # H200 SXM
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L4": 121.0e12,
    "NVIDIA A10G": 70.0e12,
    "NVIDIA GeForce RTX 4090": 165.2e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of this exact GPU name, else None (reported as "unknown")."""
    if device.type != "cuda":
        return None
    return PEAK_BF16.get(torch.cuda.get_device_name(device))


def run_one(args: argparse.Namespace, model: Path, scheme: str, docs: list[str], compiled: bool = False) -> dict:
    from distperp_harness.lm import DistPerpLM
    from distperp_harness.planning.requests import window_units
    from distperp_harness.run.budget import batching_for
    from distperp_harness.run.scoring.engine.forward import score_batch

    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    lm = DistPerpLM(**model_args(args, model, scheme, compiled))
    load_s = time.perf_counter() - t0
    # The loader's own meter (reset at the start of the load stage, read at its end); the constructor's budget
    # probe, which runs after it, resets the allocator's peak again, so reading that here would miss the load.
    load_peak = lm.loaded.load_memory["device_peak_bytes"] if cuda else None
    again = batching_for(lm.options, lm.model, lm.device, lm.max_length, resident_bytes=lm.weight_bytes)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    lm.loglikelihood_rolling([SimpleNamespace(args=(d,)) for d in docs], disable_tqdm=True)
    call = lm.stats.calls[-1].to_dict()
    score_peak = torch.cuda.max_memory_allocated() if cuda else None
    tokens_per_s = call["scored_tokens"] / call["scoring_seconds"]
    params = sum(p.numel() for p in lm.model.parameters())
    peak = peak_flops(lm.device)
    # The plan's first batch, twice: same bits (kernels must not depend on anything but the batch).
    units = window_units(lm.tok_encode(docs[0]), lm.prefix_token_id, lm.max_length)
    rows = max(1, min(len(units), lm.batching.rows_for(max(u.input_length for u in units))))
    first = [
        score_batch(lm.model, units[:rows], device=lm.device, pad_token_id=lm.tokenizer.pad_token_id).stats
        for _ in range(2)
    ]
    report = lm.quant_report
    eligible = (
        None
        if report is None
        else [why for why in report.skipped.values() if not why.startswith("output embedding kept")]
    )
    layers = (
        None
        if report is None or report.config_name is None
        else (len(report.quantized), len(report.quantized) + len(eligible))
    )  # the output head is not eligible
    name = "bfloat16" if scheme == "none" and cuda else ("float32" if scheme == "none" else scheme)
    state = lm.compiled.to_dict()
    row = dict(
        run=name + (" compiled" if compiled else ""),
        scheme_run=name,
        compiled=compiled,
        compile_active=state["active"],
        compile_reason=state["reason"],
        compile_s=state["compile_seconds"],
        load_s=load_s,
        load_peak=load_peak,
        weight_bytes=lm.weight_bytes,
        budget=lm.batching.token_budget,
        budget_again=again.token_budget,
        tokens=call["scored_tokens"],
        tokens_per_s=tokens_per_s,
        mfu=(2 * params * tokens_per_s / peak) if peak and scheme == "none" else None,
        peak_known=peak is not None or not cuda,
        score_peak=score_peak,
        quantized_layers=layers,
        same_bits=first[0].tobytes() == first[1].tobytes(),
        fingerprint=lm.stats.fingerprint,
        recompilations=lm.compiled.recompilations(),
    )
    model_ref = weakref.ref(lm.model)
    del lm, first, again
    return row, model_ref


def release(row: dict, model_ref: "weakref.ref", baseline: int | None) -> None:
    """Record whether the run's model is gone and, on CUDA, its bytes left above ``baseline``: the package's own
    release check (:func:`distperp_harness.commands.check.released`, what ``distperp check`` runs)."""
    left = released(model_ref, baseline)
    row["left_after_bytes"] = left.left_bytes
    row["released"] = left.ok


def launch(args: argparse.Namespace, model: Path, processes: int, out: Path) -> str:
    """Rolling fingerprint of a ``processes``-process ``accelerate launch`` of this module's worker mode."""
    out.mkdir(parents=True, exist_ok=True)
    worker_args = ["--worker", "--model", model, "--device", args.device, "--tokens", args.tokens]
    worker_args += ["--max-length", args.max_length, "--work", out]
    common.launch("gpu_check", worker_args, processes, device=args.device, check=True, timeout=args.launch_timeout)
    return json.loads((out / "fingerprint.json").read_text())["fingerprint"]


def worker(args: argparse.Namespace) -> None:
    from distperp_harness.lm import DistPerpLM

    lm = DistPerpLM(**model_args(args, Path(args.model), "none"))
    lm.loglikelihood_rolling([SimpleNamespace(args=(d,)) for d in documents(args.tokens)], disable_tqdm=True)
    if lm.rank == 0:
        Path(args.work, "fingerprint.json").write_text(json.dumps({"fingerprint": lm.stats.fingerprint}))


def efficiency(row: dict, rows: list[dict]) -> str:
    """MFU for the unquantized run (or "unknown" GPU), the speed-up over it for a quantized one; for a compiled
    run also its speed-up over the same run eager, its compile seconds and recompilations."""
    if row.get("compiled"):
        eager = next((r for r in rows if not r.get("compiled") and r["scheme_run"] == row["scheme_run"]), None)
        if not row["compile_active"]:
            return f"NOT COMPILED ({row['compile_reason']})"
        mfu = f"MFU {100 * row['mfu']:.1f} %, " if row["mfu"] is not None else ""
        speed = "n/a" if eager is None else f"{row['tokens_per_s'] / eager['tokens_per_s']:.2f}x of eager"
        return f"{mfu}{speed}; compile {row['compile_s']:.0f} s, {row['recompilations']} recompilations"
    if row["quantized_layers"] is None:
        if row["mfu"] is not None:
            return f"MFU {100 * row['mfu']:.1f} %"
        return "MFU unknown (GPU not in PEAK_BF16)" if not row["peak_known"] else "n/a"
    base = next((r for r in rows if r["quantized_layers"] is None and not r.get("compiled")), None)
    return "n/a" if base is None else f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x of {base['run']}"


def table(rows: list[dict], multi: str) -> str:
    lines = [
        "| run | load s | load peak GiB | weights GiB | auto budget (twice) | tokens | tokens/s | MFU or speed-up | "
        "scoring peak GiB | same batch twice | layers quantized | memory released |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---|---|---|",
    ]
    for r in rows:
        layers = "-" if r["quantized_layers"] is None else "{}/{}".format(*r["quantized_layers"])
        left = r.get("left_after_bytes")
        released = ("yes" if r.get("released") else "NO") + ("" if left is None else f" ({left / 2**20:+.1f} MiB)")
        lines.append(
            f"| {r['run']} | {r['load_s']:.1f} | {gib(r['load_peak'])} | {gib(r['weight_bytes'])} | "
            f"{r['budget']}, {r['budget_again']} | {r['tokens']} | {r['tokens_per_s']:.0f} | "
            f"{efficiency(r, rows)} | {gib(r['score_peak'])} | "
            f"{'equal bits' if r['same_bits'] else 'DIFFERENT'} | {layers} | {released} |"
        )
    return "\n".join(lines + ["", f"1 vs 2 processes: {multi}"])


def passed(row: dict) -> bool:
    """A row's checks: same bits, same budget twice, memory released, every Linear layer quantized."""
    layers = row["quantized_layers"]
    return (
        row["same_bits"]
        and row["budget"] == row["budget_again"]
        and row.get("released", True)
        and (layers is None or layers[0] == layers[1])
        and row.get("recompilations", 0) == 0
    )


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, 240)
    parser.add_argument(
        "--runs",
        default="none,int4,int4-kernel",
        help="comma-separated quantize= schemes (int4-kernel: quantize=int4,int4_prefill=kernel)",
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens scored per run (cuda 65536, cpu 3000)")
    parser.add_argument(
        "--compile",
        default="off",
        choices=("on", "off"),
        help="also run each scheme with compile=true (on CUDA it runs eager: not offered there)",
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="also compare 1 vs N processes (cuda: 2 when two GPUs are visible)"
    )
    parser.add_argument(
        "--tree-impls",
        default=None,
        help="attention implementations of the tree-row case "
        "(cuda: sdpa,flex_attention; cpu: sdpa; 'none': skip the case)",
    )
    parser.add_argument("--tree-questions", type=int, default=None, help="questions of the tree case (cuda 400, cpu 4)")
    args = parse(parser, argv, tokens=(65536, 3000))
    common.use_offline_env(args.device)  # on CUDA torchao's kernels load (the int4 runs)
    cuda = args.device == "cuda"
    if args.worker:
        worker(args)
        return 0
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu for the dry mode")
    args.work = args.work or tempfile.mkdtemp(prefix="distperp-gpu-check-")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if cuda:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    model = build_model(args)
    docs = documents(args.tokens)
    baseline = cuda_baseline() if cuda else None
    rows = []
    compiled = args.compile == "on"
    for scheme in args.runs.split(","):
        for compile_it in (False, True) if compiled else (False,):
            row, model_ref = run_one(args, model, scheme, docs, compile_it)
            release(row, model_ref, baseline)
            rows.append(row)
    processes = args.processes or (2 if cuda and torch.cuda.device_count() >= 2 else 0)
    multi = "skipped (one GPU)"
    if processes >= 2:
        one, two = (launch(args, model, n, work / f"p{n}") for n in (1, processes))
        multi = f"{'identical' if one == two else 'DIFFERENT'} fingerprints ({one} / {two})"
    impls = args.tree_impls or ("sdpa,flex_attention" if cuda else "sdpa")
    args.tree_questions = args.tree_questions or (400 if cuda else 4)
    tree = [tree_case(args, model, impl) for impl in impls.split(",") if impl != "none"]
    print(table(rows, multi), flush=True)
    if tree:
        print("\n" + tree_table(tree), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "processes": multi, "tree": tree}, indent=1, default=str))
    ok = all(passed(r) for r in rows) and "DIFFERENT" not in multi and "DIFFERENT" not in tree_table(tree)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
