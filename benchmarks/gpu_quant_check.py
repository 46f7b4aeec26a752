"""Quantized vs reference model: weight bytes, speed, peak memory and log-likelihood agreement.

Default (one CUDA GPU, < 5 min on an H200): a random Llama-3.2-1B-shaped model (1.24B parameters, tied
embeddings) in bfloat16, against itself quantized with ``int4`` (and ``int8``, ``8da4w``) by
``distperp_harness.model.quantize``. Every run rebuilds the model from the same seed (checked by a weight checksum).

    python -m benchmarks.gpu_quant_check                       # writes a markdown table and JSON to stdout
    python -m benchmarks.gpu_quant_check --device cpu --model ../shared/models/wt2-llama-5m \\
        --runs none:float32,none:bfloat16,int4:auto,int4:float32,int8:auto,int8:bfloat16,8da4w:auto \\
        --text ../shared/data/wikitext-2/test.txt --agree 8     # the CPU table of docs/quantization.md

Each ``--runs`` entry is ``scheme:dtype``; the first is the reference. Per run: forward time of one ``--batch`` x
``--seq`` batch (best of ``--repeats``, robust to other load), tokens/s, weight bytes, peak CUDA memory of the
timed forwards, and on the first ``--agree`` sequences versus the reference: max |logit diff|, mean KL(ref || run)
per token, top-1 agreement, and the next-token log-likelihood (float64) difference per token.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import use_offline_env
from distperp_harness.model.quantize import quantize_model, resolve_model_dtype

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def build(args: argparse.Namespace, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype or "auto").to(device).eval()
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(dtype or torch.bfloat16).eval()


def make_tokens(args: argparse.Namespace, vocab: int) -> torch.Tensor:
    n = args.batch * args.seq
    if args.text:
        if not args.model:
            raise SystemExit(f"--text {args.text} needs --model (its tokenizer cuts the text into tokens)")
        from transformers import AutoTokenizer

        with open(args.text, encoding="utf-8") as f:
            ids = AutoTokenizer.from_pretrained(args.model)(f.read())["input_ids"][:n]
        if len(ids) != n:
            raise SystemExit(f"--text {args.text} has {len(ids)} tokens, need --batch x --seq = {n}; lower them")
        return torch.tensor(ids).view(args.batch, args.seq)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_one(args, scheme: str, requested: str, device: torch.device, tokens: torch.Tensor | None):
    dtype, dtype_note = resolve_model_dtype(scheme, requested, device)
    model = build(args, dtype, device)
    checksum = float(model.get_input_embeddings().weight.bfloat16().double().sum())  # same weights in every run?
    report = quantize_model(model, scheme, group_size=args.group_size)
    print(f"# {scheme}:{requested}: {dtype_note}. {report.summary()}", flush=True)
    if tokens is None:
        tokens = make_tokens(args, model.config.vocab_size)
    batch = tokens.to(device)
    model(batch)  # warm-up
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        model(batch)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    logits = model(batch[: args.agree]).logits.float().cpu()  # compared on the CPU: no GPU memory held
    del model
    seconds = min(times)
    row = dict(
        run=f"{scheme}:{requested}",
        config=report.config_name,
        storage=report.storage,
        dtype=report.model_dtype,
        weight_bytes=report.weight_bytes_after,
        forward_s=seconds,
        tokens_per_s=batch.numel() / seconds,
        peak_cuda_bytes=peak,
        checksum=checksum,
    )
    return row, logits, tokens


def agreement(ref: torch.Tensor, got: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """``ref``/``got``: float32 logits [B, L, V] of the same tokens; next-token metrics over B x (L - 1)."""
    ref_lp, got_lp = ref.double().log_softmax(-1)[:, :-1], got.double().log_softmax(-1)[:, :-1]
    target = tokens[:, 1:, None]
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1)
    return dict(
        max_abs_logit_diff=float((got - ref).abs().max()),
        mean_kl=float(kl.mean()),
        top1_agree=float((ref_lp.argmax(-1) == got_lp.argmax(-1)).double().mean()),
        loglik=float(got_lp.gather(-1, target).sum()),
        ref_loglik=float(ref_lp.gather(-1, target).sum()),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: random Llama-3.2-1B shape)")
    parser.add_argument("--runs", default="none:bfloat16,int4:auto,int8:bfloat16,8da4w:bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--agree", type=int, default=2, help="sequences compared with the reference")
    parser.add_argument("--text", default=None, help="text file to take the tokens from (default: random ids)")
    args = parser.parse_args(argv)
    use_offline_env(args.device)  # on CUDA torchao's kernels load
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)

    rows, ref_logits, tokens = [], None, None
    for entry in args.runs.split(","):
        scheme, requested = entry.split(":")
        row, logits, tokens = run_one(args, scheme, requested, device, tokens)
        ref_logits = logits if ref_logits is None else ref_logits
        if rows and row["checksum"] != rows[0]["checksum"]:
            raise RuntimeError(f"{entry} did not build the reference's weights")
        row.update(agreement(ref_logits, logits, tokens[: args.agree]))
        rows.append(row)
        del logits
        if device.type == "cuda":
            torch.cuda.empty_cache()

    ref = rows[0]
    print(
        f"\n| run | torchao config | storage | weights MB | forward s | tokens/s | peak CUDA GB | "
        f"max abs logit diff vs {ref['run']} | mean KL | top-1 agree | delta loglik / token |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    n_pred = args.agree * (args.seq - 1)
    for r in rows:
        peak = "n/a" if r["peak_cuda_bytes"] is None else f"{r['peak_cuda_bytes'] / 1e9:.2f}"
        print(
            f"| {r['run']} | {r['config'] or '-'} | {r['storage']} | {r['weight_bytes'] / 1e6:.1f} | "
            f"{r['forward_s']:.3f} | {r['tokens_per_s']:.0f} | {peak} | {r['max_abs_logit_diff']:.4f} | "
            f"{r['mean_kl']:.5f} | {r['top1_agree']:.4f} | {(r['loglik'] - r['ref_loglik']) / n_pred:+.5f} |"
        )
    print(json.dumps(dict(args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
