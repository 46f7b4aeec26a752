"""``bench_scoring``'s memory: one fresh subprocess per scorer (``python -m benchmarks.bench_scoring --memory-worker``)
scores ``--memory-tokens`` tokens while a thread samples the resident set size; on CUDA, the allocator's peak."""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._scoring_common import (
    _quiet,
    bare_batches,
    make_lm,
    make_runner,
    requests_for,
    select_documents,
)
from benchmarks.common import REPO_ROOT, environment, load_articles, module_command


class RssSampler:
    """Samples this process's resident set size every ``interval`` seconds in a daemon thread; ``peak`` in bytes."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def current_rss() -> int:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss() -> int:
    """High-water mark of this process's RSS in bytes (``ru_maxrss``; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Score ``--memory-tokens`` tokens once with ``args.memory_worker`` and return the memory figures (bytes)."""
    import torch

    _quiet()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    path = Path(args.model_path)
    lm = make_lm(args.memory_worker, path, args.max_length, args.batch_size, device=args.device, dtype=args.dtype)
    docs, tokens = select_documents(load_articles(Path(args.text)), lm.tokenizer, args.memory_tokens)
    requests = requests_for(docs)
    batches = bare_batches(lm, docs) if args.memory_worker == "bare" else None
    runner = make_runner(args.memory_worker, lm, requests, batches)
    gc.collect()
    if args.device == "cuda":  # the allocator's peak: exact
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner.run()
        torch.cuda.synchronize()
        peak, exact = torch.cuda.max_memory_allocated(), True
        return {
            "scorer": args.memory_worker,
            "tokens": tokens,
            "rss_before": before,
            "peak_rss": peak,
            "peak_delta": peak - before,
            "exact": exact,
        }
    before, high_before = current_rss(), max_rss()
    with RssSampler() as sampler:
        runner.run()
    high_after = max_rss()
    exact = high_after > high_before
    peak = high_after if exact else sampler.peak
    return {
        "scorer": args.memory_worker,
        "tokens": tokens,
        "rss_before": before,
        "peak_rss": peak,
        "peak_delta": peak - before,
        "exact": exact,
    }


def measure_memory(scorer: str, path: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """Run :func:`memory_worker` for ``scorer`` in a fresh subprocess; None (with a note) if it fails."""
    cmd = module_command(
        "bench_scoring",
        "--memory-worker",
        scorer,
        "--model-path",
        str(path),
        "--max-length",
        str(args.max_length),
        "--batch-size",
        str(args.batch_size),
        "--text",
        str(args.text),
        "--memory-tokens",
        str(args.memory_tokens),
        "--threads",
        str(args.threads or 0),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=environment(device=args.device))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  note: memory of {scorer} not measured (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
        return None
    return json.loads(lines[-1])
