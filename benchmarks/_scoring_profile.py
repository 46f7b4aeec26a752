"""``python -m benchmarks.bench_scoring --profile``: torch.profiler op breakdown of hf, distperp and the bare
forward."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from benchmarks._scoring_common import (
    DEFAULT_TOKENS,
    SCORERS,
    _quiet,
    bare_batches,
    make_lm,
    make_runner,
    requests_for,
    select_documents,
)
from benchmarks.common import load_articles

POSTPROCESSING_OPS = (
    "aten::_log_softmax",
    "aten::log_softmax",
    "aten::logsumexp",
    "aten::argmax",
    "aten::max",
    "aten::amax",
    "aten::exp_",
    "aten::exp",
    "aten::sub_",
    "aten::gather",
    "aten::sum",
    "aten::isfinite",
    "aten::eq",
    "aten::index",
    "aten::_to_copy",
    "aten::copy_",
)
"""Ops that turn logits into log-probs, greedy flags and sums (plus copies); everything else is the forward."""


def profile_scorers(path: Path, args: argparse.Namespace) -> str:
    """torch.profiler over one call of hf, distperp and the bare forward on the first ``--tokens``: the top ops by
    self CPU time, and the share of the post-processing ops (:data:`POSTPROCESSING_OPS`)."""
    from torch.profiler import ProfilerActivity, profile

    lms = {
        key: make_lm(key, path, args.max_length, args.batch_size, device=args.device, dtype=args.dtype)
        for key in ("hf", "distperp")
    }
    _quiet()
    lms["bare"] = lms["distperp"]
    limit = args.tokens if args.tokens is not None else DEFAULT_TOKENS[True].get(path.name, 8_000)
    docs, tokens = select_documents(load_articles(Path(args.text)), lms["distperp"].tokenizer, limit or None)
    requests = requests_for(docs)
    batches = bare_batches(lms["distperp"], docs)
    out = [f"profile of {path.name}, {len(docs)} articles, {tokens} tokens (self CPU time, ms):"]
    for key, lm in lms.items():
        runner = make_runner(key, lm, requests, batches)
        runner.run()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof, contextlib.redirect_stderr(io.StringIO()):
            runner.run()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        post = sum(e.self_cpu_time_total for e in events if e.key in POSTPROCESSING_OPS)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        out.append(
            f"  {SCORERS[key]}: total {total / 1e3:,.0f}; post-processing {post / 1e3:,.0f} "
            f"({post / total:.1%}); top: "
            + ", ".join(f"{e.key.removeprefix('aten::')} {e.self_cpu_time_total / 1e3:,.0f}" for e in top)
        )
    return "\n".join(out)
