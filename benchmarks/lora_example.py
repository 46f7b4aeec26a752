"""A small LoRA fine-tune to evaluate against its base (docs/checkpoints.md): ``wt2-llama-5m`` (``--model``) with a
rank-8 LoRA on every attention and MLP projection, trained on WikiText-2 *valid* (``--text``) for ``--steps`` steps
(seed 0, one thread, AdamW), saved as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    python -m benchmarks.lora_example --out ~/.cache/distperp/wt2-lora      # ~1-2 min on 2 CPU cores
    lm_eval --model distperp \\
      --model_args pretrained=../shared/models/wt2-llama-5m,peft=$HOME/.cache/distperp/wt2-lora,reference=pretrained \\
      --tasks distperp_wikitext2 --include_path tasks \\
      --metadata '{"wikitext_path": "../shared/data/wikitext-2/test.txt"}'

Data and model are read from ``../shared`` (never copied into the repository).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import SHARED_MODEL, WIKITEXT_VALID


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=SHARED_MODEL, help="the base model (default wt2-llama-5m)")
    parser.add_argument("--text", type=Path, default=WIKITEXT_VALID, help="training text (default WikiText-2 valid)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tokenizer.encode(args.text.read_text(encoding="utf-8")), dtype=torch.long)
    if len(ids) <= args.seq_len + 1:
        raise SystemExit(f"--text {args.text}: {len(ids)} tokens, need more than --seq-len {args.seq_len} + 1")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch,), generator=generator)
        batch = torch.stack([ids[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.save_pretrained(args.out)
    print(f"adapter saved to {args.out}")


if __name__ == "__main__":
    main()
