"""Context parallelism on one long window: ``cp_size=N`` against one process, time, memory, bits and traffic.

    python -m benchmarks.bench_cp                       # 8,192 tokens, SmolLM2-135M's shape, cp_size 1, 2, 4
    python -m benchmarks.bench_cp --tokens 16384 --sizes 1,2 --repeats 3

One window of ``--tokens`` random tokens (one scored row) through a random Llama of ``--shape`` (``smollm2``: 30
layers, hidden 576, 9 heads and 3 key-value heads of 64, vocabulary 49,152, the real SmolLM2-135M's shapes; ``tiny``
for dry runs), float32, one torch thread per rank (``OMP_NUM_THREADS=1``). ``cp_size=1`` is
:func:`~distperp_harness.run.scoring.engine.forward.score_batch` in one process; ``cp_size=N``
is :func:`~distperp_harness.run.scoring.engine.cp_forward.score_batch_cp` on an N-process gloo group (every member
times its forward; the slowest is the window's time). Each size runs twice, in fresh processes: ``--repeats`` timed
forwards (median), then one forward after a warm-up for memory, with ``MALLOC_MMAP_THRESHOLD_=131072`` so that a
freed tensor leaves the resident set (peak resident growth during the forward, largest rank; that setting slows
allocation, so it never runs with the timing). Bytes received per layer are the formula
(:func:`~distperp_harness.model.cp_attention.received_bytes_per_token`), which the launch tests check against the
counted collectives.

Printed: a table with seconds, memory, the window's log-likelihood (its bits are compared with ``cp_size=1``'s) and
traffic, with ratios to ``cp_size=1``. Sizes above the machine's cores are printed but their time means nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

from benchmarks._scoring_common import RANDOM_SHAPES

SHAPES = {
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "tiny": RANDOM_SHAPES["tiny"],  # bench_scoring's dry-run shape
}


def _model(shape: str, tokens: int, path: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path:  # a real checkpoint (its own weights and shapes), float32, sdpa
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()

    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPES[shape], "max_position_embeddings": max(tokens, 128), "tie_word_embeddings": True})
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def _window(vocab: int, tokens: int, path: str | None = None, text: str | None = None):
    import torch

    from distperp_harness.planning.requests import Unit

    if path and text:  # the checkpoint's tokens of a real text
        from transformers import AutoTokenizer

        with open(text, encoding="utf-8") as f:
            ids = AutoTokenizer.from_pretrained(path)(f.read())["input_ids"][: tokens + 1]
        if len(ids) < tokens + 1:
            raise SystemExit(f"{text} has {len(ids)} tokens, fewer than --tokens {tokens} + 1")
        return [Unit(tuple(ids), tokens)]

    ids = torch.randint(1, vocab, (tokens + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    return [Unit(tuple(ids), tokens)]


class _Peak:
    """The resident set's growth over its value at :meth:`start`, sampled every 5 ms in a thread."""

    def __init__(self) -> None:
        import psutil

        self.process, self.base, self.peak, self.stop = psutil.Process(), 0, 0, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def start(self) -> None:
        self.base = self.peak = self.process.memory_info().rss

    def growth(self) -> int:
        return self.peak - self.base


def _member(rank: int, size: int, port: int, args: argparse.Namespace, memory: bool, out) -> None:
    """One rank's forwards (``size`` 1: one process, no group); puts ``(rank, seconds, peak growth, ll)``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from distperp_harness.model import cp_attention
    from distperp_harness.run.scoring.engine.cp_forward import score_batch_cp
    from distperp_harness.run.scoring.engine.forward import score_batch
    from distperp_harness.run.scoring.engine.support import declared_paths, record_paths

    model = _model(args.shape, args.tokens, args.model)
    record_paths(model, declared_paths(model, args.tokens))
    window, cpu = _window(model.config.vocab_size, args.tokens, args.model, args.text), torch.device("cpu")
    if size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        cp_attention.use(model)
        group = cp_attention.Group(size, rank, dist.group.WORLD)

        def forward():
            return score_batch_cp(model, window, device=cpu, pad_token_id=0, group=group)

        def barrier():
            dist.barrier()
    else:

        def forward():
            return score_batch(model, window, device=cpu, pad_token_id=0)

        def barrier():
            return None

    peak, seconds, scores = _Peak(), [], None
    for _ in range(1 if memory else args.repeats):
        if memory:
            forward()  # warm-up: the allocator's and the kernels' one-time costs
        barrier()
        peak.start()
        start = time.perf_counter()
        scores = forward()
        seconds.append(time.perf_counter() - start)
    peak.stop = True
    out.put((rank, statistics.median(seconds), peak.growth(), float(scores.stats[0, 0])))
    if size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(size: int, args: argparse.Namespace, memory: bool, member=None) -> list[tuple]:
    """``member`` (default :func:`_member`) on ``size`` fresh processes, their results in rank order."""
    import multiprocessing

    member = member or _member
    if memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by each new process's allocator at start
    try:
        context = multiprocessing.get_context("spawn")
        queue, port = context.Queue(), _free_port()
        procs = [context.Process(target=member, args=(r, size, port, args, memory, queue)) for r in range(size)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
        return results
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="the window's scored tokens (default: %(default)s)")
    parser.add_argument("--sizes", default="1,2,4", help="cp sizes, the first one the baseline (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per size (default: %(default)s)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="model shape (default: smollm2)")
    parser.add_argument("--no-memory", action="store_true", help="time only (no memory run)")
    parser.add_argument("--model", default=None, help="a real checkpoint instead of --shape's random weights")
    parser.add_argument("--text", default=None, help="with --model: score the first --tokens tokens of this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    from transformers import AutoConfig, LlamaConfig

    from distperp_harness.model.cp_attention import received_bytes_per_token

    config = AutoConfig.from_pretrained(args.model) if args.model else LlamaConfig(**SHAPES[args.shape])
    rows = []
    for size in sizes:
        timed = _run(size, args, memory=False)
        measured = timed if args.no_memory else _run(size, args, memory=True)
        seconds = max(t[1] for t in timed)
        memory = max(m[2] for m in measured)
        layer = received_bytes_per_token(config, size, 4) * args.tokens / config.num_hidden_layers if size > 1 else 0
        rows.append((size, seconds, memory, timed[0][3], layer))
    base = rows[0]
    cores = os.cpu_count() or 1
    what = args.model or f"{args.shape} shape"
    print(f"One {args.tokens:,}-token window, {what}, float32, one thread per rank ({cores} cores)\n")
    print("| cp_size | seconds | vs first | peak activation MiB | vs first | log-likelihood | bits | MiB per layer |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for size, seconds, memory, ll, layer in rows:
        time_note = " (more ranks than cores)" if size > cores else ""
        print(
            f"| {size} | {seconds:.2f}{time_note} | {seconds / base[1]:.2f}x | {memory / 2**20:.0f} | "
            f"{memory / max(base[2], 1):.2f}x | {ll!r} | {'same' if ll == base[3] else 'differ'} | "
            f"{layer / 2**20:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
