"""A long prompt generated on a context-parallel group against one process: memory per rank, time per token, tokens.

    python -m benchmarks.bench_cp_generate                       # 32,768 tokens, the "long" shape, cp 1, 2, 4
    python -m benchmarks.bench_cp_generate --tokens 4096 --shape tiny --new 4    # a dry run
    python -m benchmarks.bench_cp_generate --model DIR --text FILE --tokens 8000 --sizes 1,2 --repeats 3

One prompt of ``--tokens`` random tokens through a random Llama (``long``: 4 layers, hidden 256, 8 heads and 2 key-value
heads of 32, vocabulary 2,048: a tiny long-context model whose cache is a visible share of memory; ``smollm2``/``tiny``
as :mod:`benchmarks.bench_cp`), float32, one torch thread per rank, generated greedily for ``--new`` tokens by
:func:`~distperp_harness.run.generation.engine.group_decode.greedy_on_group` on a group of N gloo processes; size 1 is
what a ``cp_size=1`` run computes (a slot lane of one row on the dynamic cache:
:func:`~distperp_harness.run.generation.engine.loop.decode_lane`). Times are read at each forward's start (a forward
pre-hook): the prefill, then the decode steps. ``--one group``: size 1 runs the group's code on a group of one instead
(the same blocked attention, no dense mask), to separate the split from the slot path's mask. ``--model DIR``: a real
checkpoint (its weights, float32, sdpa) and, with ``--text FILE``, the prompt is that file's first ``--tokens`` tokens.
Each size runs in fresh processes: ``--repeats`` times timed (the sizes alternating, each repetition in the order of the
last one reversed; the medians of the prefills and of the decode steps' medians), once for memory with
``MALLOC_MMAP_THRESHOLD_=131072`` (peak resident growth from just before the prefill to the end of decoding, largest
rank: activations and the key/value cache). Tokens computed per rank: the prefill's ``padded / N`` columns, then one
position per generated token (every member computes the new token's layers; only attention is split). Bytes received per
decode step are :func:`~distperp_harness.run.generation.engine.group_decode.decode_bytes_per_step` (the unit test counts
them). Printed: a table with ratios to the first size, and whether the tokens equal the first size's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.bench_cp import SHAPES, _model, _Peak, _window
from benchmarks.bench_cp import _run as _run_members

SHAPES = {
    **SHAPES,
    "long": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}


def _member(rank: int, size: int, port: int, args: argparse.Namespace, memory: bool, out) -> None:
    """One rank's generation; puts ``(rank, prefill s, median decode step s, peak growth, tokens)``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    from distperp_harness.model import cp_attention
    from distperp_harness.run.generation.engine import group_decode
    from distperp_harness.run.scoring.engine.support import declared_paths, record_paths

    if args.model:
        model = _model(args.shape, args.tokens, args.model)
    else:
        torch.manual_seed(0)
        config = LlamaConfig(**{**SHAPES[args.shape], "max_position_embeddings": args.tokens + args.new + 64})
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation("sdpa")
    record_paths(model, declared_paths(model, args.tokens + args.new))
    prompt = list(_window(model.config.vocab_size, args.tokens, args.model, args.text)[0].tokens[: args.tokens])
    group = cp_attention.Group(1, 0)
    grouped = size > 1 or args.one == "group"
    if grouped:
        cp_attention.use(model)
    if size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        group = cp_attention.Group(size, rank, dist.group.WORLD)
        dist.barrier()
    starts: list[float] = []  # when each forward starts: the prefill's, then every decode step's
    hook = model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    peak = _Peak()
    peak.start()
    begin = time.perf_counter()
    if grouped:
        tokens = group_decode.greedy_on_group(model, prompt, args.new, group, torch.device("cpu"))
    else:
        tokens = _one_process(model, prompt, args.new)
    end = time.perf_counter()
    peak.stop = True
    hook.remove()
    prefill = (starts[1] if len(starts) > 1 else end) - begin
    steps = [b - a for a, b in zip(starts[1:], [*starts[2:], end])]
    out.put((rank, prefill, statistics.median(steps) if steps else 0.0, peak.growth(), tokens))
    if size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _one_process(model, prompt: list[int], new: int) -> list[int]:
    """What a ``cp_size=1`` run computes for the prompt: a slot lane of one row on the dynamic cache
    (:func:`~distperp_harness.run.generation.engine.loop.decode_lane`), greedy, no stop but ``new`` tokens."""
    from types import SimpleNamespace

    import torch

    from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
    from distperp_harness.run.generation.engine.scheduler import Lane, StopRule

    tokenizer = SimpleNamespace(pad_token_id=0, batch_decode=lambda rows: [""] * len(rows))
    tokens, _ = decode_lane(
        Decoder(model, tokenizer, torch.device("cpu")), Lane([prompt], (), 1), StopRule((), frozenset(), new, 2)
    )
    return tokens[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--new", type=int, default=16, help="tokens generated (default: %(default)s)")
    parser.add_argument("--sizes", default="1,2,4", help="group sizes, the first the baseline (default: %(default)s)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="long", help="model shape (default: long)")
    parser.add_argument(
        "--one",
        choices=["slots", "group"],
        default="slots",
        help="size 1 as a cp_size=1 run computes it (slots, default) or the group's code on a group of one",
    )
    parser.add_argument("--model", default=None, help="a real checkpoint instead of --shape's random weights")
    parser.add_argument("--text", default=None, help="with --model: the prompt is this file's first --tokens tokens")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per size, sizes alternating (default: 1)")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, LlamaConfig

    from distperp_harness.model.cp_attention import padded_length
    from distperp_harness.run.generation.engine.group_decode import decode_bytes_per_step

    config = AutoConfig.from_pretrained(args.model) if args.model else LlamaConfig(**SHAPES[args.shape])
    sizes = [int(s) for s in args.sizes.split(",")]
    timings: dict[int, list[tuple[float, float]]] = {size: [] for size in sizes}
    tokens: dict[int, list[int]] = {}
    order = list(sizes)
    for repeat in range(args.repeats):
        for size in order:
            timed = _run_members(size, args, False, _member)
            if any(t[4] != timed[0][4] for t in timed):
                raise SystemExit(f"group of {size}: the members returned different tokens")
            timings[size].append((max(t[1] for t in timed), max(t[2] for t in timed)))
            tokens[size] = timed[0][4]
            print(f"repeat {repeat + 1} size {size}: prefill {timings[size][-1][0]:.2f} s, decode "
                  f"{timings[size][-1][1] * 1e3:.1f} ms/token", flush=True)  # fmt: skip
        order.reverse()
    rows = []
    for size in sizes:
        measured = _run_members(size, args, True, _member)
        prefill = statistics.median(t[0] for t in timings[size])
        step = statistics.median(t[1] for t in timings[size])
        rows.append(
            (size, prefill, step, max(m[3] for m in measured), tokens[size], decode_bytes_per_step(config, size))
        )
    base = rows[0]
    what = args.model or f"{args.shape} shape"
    print(
        f"\nOne {args.tokens:,}-token prompt, {args.new} tokens generated, {what}, float32, 1 thread/rank, "
        f"median of {args.repeats} timed run(s) per size\n"
    )
    print(
        "| cp_size | prefill s | decode s/token | vs first | peak growth MiB/rank | vs first | tokens | "
        "prefill tokens/rank | bytes/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for size, prefill, step, memory, generated, sent in rows:
        print(
            f"| {size} | {prefill:.2f} | {step:.4f} | {step / max(base[2], 1e-9):.2f}x | {memory / 2**20:.0f} | "
            f"{memory / max(base[3], 1):.2f}x | {'same' if generated == base[4] else 'DIFFER'} | "
            f"{padded_length(args.tokens, size) // size if size > 1 else args.tokens:,} | {sent:,} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
