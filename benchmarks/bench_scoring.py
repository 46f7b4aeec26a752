"""Scoring speed and memory: lm-eval's ``hf`` model vs ``distperp`` on the same checkpoint, dtype, batch and work.

    python benchmarks/bench_scoring.py                 # both models, all scorers: ~13 min on 2 CPU cores
    python benchmarks/bench_scoring.py --quick         # small subsets: ~5 min
    python benchmarks/bench_scoring.py --models wt2-llama-5m --scorers hf,distperp --cli 62   # + the real CLI
    python benchmarks/bench_scoring.py --profile       # torch.profiler op breakdown instead of timing
    python benchmarks/bench_scoring.py --random-shape llama-1b --device cuda --dtype bfloat16 --no-memory

Work: ``loglikelihood_rolling`` over WikiText-2 test articles (``../shared/data/wikitext-2/test.txt``, read at run
time, split on top-level `` = Title = `` lines), disjoint windows of ``--max-length`` tokens, ``--batch-size`` rows,
float32, one process, CPU (``--device cuda --dtype bfloat16``: both scorers on ``cuda:0`` in that dtype). Both models
are built in-process with lm-eval's registry (``get_model(name).create_from_arg_string``) and called with the same
``Instance`` objects.

Models: ``../shared/models/wt2-llama-5m`` (5.5M parameters, vocab 8,192) and a random-init Llama with 52M
parameters and vocab 32,000 built in a temporary folder (it reuses the wt2-llama-5m tokenizer: a model vocab
larger than the tokenizer's is valid, the extra rows are never targets but are part of every softmax).
``--random-shape NAME`` scores a random-init model of a shape in :data:`RANDOM_SHAPES` instead (``llama-1b``:
Llama-3.2-1B's, for GPUs; ``tiny``: the test model's, for dry runs), built once into ``--workdir``.

Timing (in-process): each repeat runs every scorer once, in an order rotated per repeat (hf, distperp, bare, ...),
so slow phases of a shared machine hit all of them; tokens/s is scored tokens over the call's wall time. The table
shows the best repeat of each scorer (interference only ever slows a run down, so the fastest run is the least
disturbed one); the notes give medians, per-repeat ratios and the ratio of process CPU times. ``bare forward`` is ``model(ids).logits``
(no log-softmax) on exactly distperp's padded windows and batches, tensors built before the clock starts.
``distperp / bare`` uses distperp's scoring stage (exchange, plan, forward, log-probs; its ``scoring_seconds``),
not tokenization; the end-to-end figure is printed too.

Memory (one fresh subprocess per scorer): load, build the requests, then score ``--memory-tokens`` tokens while
a thread samples the resident set size (``/proc/self/statm``) every millisecond. Peak memory of scoring is the
highest RSS during the call minus the RSS just before it (on CUDA: the allocator's peak during the call minus
what was allocated before it); when the call raised the process's high-water mark
(``getrusage`` ``ru_maxrss``), that exact kernel figure is used instead of the sampled one. torch on CPU allocates
through malloc, so RSS is what scoring really holds (``tracemalloc`` does not see torch tensors).

Prints a markdown table (date, machine, versions) for ``benchmarks/README.md``; ``--json PATH`` saves raw numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

for _key, _value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_key, _value)  # before torch/transformers/tqdm are imported
if not any(a in ("cuda", "--device=cuda") for a in sys.argv):  # torchao's CUDA kernels are not needed on the CPU
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from _wikitext import REPO_ROOT, SHARED_MODEL, WIKITEXT_TEST, load_articles  # noqa: E402

RANDOM_MODEL = "random-llama-52m"
RANDOM_CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-5)
"""The larger CPU model: 52.0M parameters (32.8M of them input embeddings and output head), vocab 32,000."""
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-52m": RANDOM_CONFIG,
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     tie_word_embeddings=True, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5),
}
"""``--random-shape`` name → Llama config of a random-init model (``random-<name>`` in ``--models``). ``llama-1b``
is Llama-3.2-1B's shape (1.24B parameters, tied embeddings; saved in bfloat16, which a float32 run upcasts
exactly); ``tiny`` is the test model's (distperp_harness.commands.tiny.TEST_SPEC), for dry runs on the CPU."""

SCORERS: dict[str, str] = {
    "hf": "lm-eval hf",
    "distperp": "distperp",
    "bare": "bare forward",
    "int4": "distperp int4 (float32 compute)",
    "int4-bf16": "distperp int4 (bfloat16, packed)",
}
"""Scorer keys and their table labels. ``int4`` rows use ``quantize=int4`` (``distperp_harness.model.quantize``)."""


# ------------------------------------------------------------------------------------------------ models, data
def random_tokenizer(vocab_size: int) -> Any:
    """The wt2-llama-5m tokenizer when the shared model is present and fits ``vocab_size``, else the tiny test
    tokenizer (trained on the packaged sample, as the test models' is)."""
    from transformers import AutoTokenizer

    if (SHARED_MODEL / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(SHARED_MODEL)
        if len(tokenizer) <= vocab_size:
            return tokenizer
    from distperp_harness.commands.tiny import TEST_SPEC, sample_text, train_tokenizer

    return train_tokenizer([sample_text()], min(TEST_SPEC.vocab_size, vocab_size), model_max_length=2048)


def build_random_model(out_dir: Path, shape: str = "llama-52m", seed: int = 0) -> Path:
    """A random-init Llama of :data:`RANDOM_SHAPES` ``[shape]`` with :func:`random_tokenizer`, saved in ``out_dir``
    (float32; ``llama-1b`` in bfloat16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(RANDOM_SHAPES[shape])
    tokenizer = random_tokenizer(config["vocab_size"])
    if shape != "llama-52m":  # (the 52M model keeps the ids it was first built with)
        config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config, dtype="float32")).to(torch.float32)
    if shape == "llama-1b":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_model(name: str, workdir: Path) -> Path:
    """Path of model ``name``: ``wt2-llama-5m``, ``random-<shape>`` of :data:`RANDOM_SHAPES` (built in
    ``workdir``) or a folder."""
    if name == "wt2-llama-5m":
        return SHARED_MODEL
    if name.startswith("random-") and name.removeprefix("random-") in RANDOM_SHAPES:
        out = workdir / name
        return out if (out / "config.json").is_file() else build_random_model(out, name.removeprefix("random-"))
    if Path(name).is_dir():
        return Path(name)
    raise ValueError(f"--models entry {name!r}: use wt2-llama-5m, "
                     f"{', '.join('random-' + k for k in RANDOM_SHAPES)} or a model folder")


def select_documents(articles: list[str], tokenizer: Any, max_tokens: int | None) -> tuple[list[str], int]:
    """The first whole articles holding at least ``max_tokens`` tokens (all when None), and their token count."""
    docs: list[str] = []
    total = 0
    for article in articles:
        if max_tokens is not None and total >= max_tokens:
            break
        docs.append(article)
        total += len(tokenizer.encode(article, add_special_tokens=False))
    return docs, total


def model_facts(path: Path) -> dict[str, Any]:
    """Parameter count (stored tensors; tied weights count once) and shape facts of the checkpoint at ``path``."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    params = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= d
            params += n
    return {"params": params, "vocab": int(config.vocab_size), "hidden": int(config.hidden_size),
            "layers": int(config.num_hidden_layers)}


# ---------------------------------------------------------------------------------------------------- scorers
def _model_args(path: Path, max_length: int, extra: str = "", device: str = "cpu", dtype: str = "float32") -> str:
    device = "cuda:0" if device == "cuda" else device  # what lm-eval's hf takes (distperp takes it too)
    return f"pretrained={path},dtype={dtype},max_length={max_length},device={device}" + extra


def make_lm(scorer: str, path: Path, max_length: int, batch_size: int, extra_args: str = "", device: str = "cpu",
            dtype: str = "float32") -> Any:
    """The lm-eval LM object behind ``scorer`` (``bare`` uses a plain ``distperp`` LM for its model and plan);
    ``extra_args`` (``",key=value..."``) go to its ``--model_args``; ``device`` (``cpu``, ``cuda``) and
    ``dtype`` to both ``hf`` and distperp."""
    from lm_eval.api.registry import get_model

    import distperp_harness._hook  # noqa: F401  (registers --model distperp)

    name = "hf" if scorer == "hf" else "distperp"
    extra = {"int4": ",quantize=int4", "int4-bf16": ",quantize=int4"}.get(scorer, "")
    args = _model_args(path, max_length, extra + extra_args, device, dtype)
    if scorer == "int4-bf16":
        args = args.replace("dtype=float32", "dtype=bfloat16")
    return get_model(name).create_from_arg_string(args, {"batch_size": batch_size})


def requests_for(docs: list[str]) -> list[Any]:
    """``loglikelihood_rolling`` instances for ``docs`` (the same objects go to every scorer)."""
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(docs)]


def bare_batches(lm: Any, docs: list[str]) -> list[Any]:
    """distperp's padded input batches for ``docs`` (same windows, canonical order and batches as its plan)."""
    import torch

    from distperp_harness.planning.requests import UnitTable, window_units

    units = [u for doc in docs for u in window_units(lm.tok_encode(doc), lm.prefix_token_id, lm.max_length,
                                                       lm.options.stride)]
    table = UnitTable(units)
    out = []
    for batch in lm.batching.batches(table.lengths):
        ids = torch.full((batch.rows, batch.padded_length), lm.tokenizer.pad_token_id, dtype=torch.long)
        for i, unit in enumerate(table.units[batch.start: batch.stop]):
            ids[i, : unit.input_length] = torch.tensor(unit.tokens[:-1])
        out.append(ids.to(lm.device))
    return out


def bare_forward(model: Any, batches: list[Any]) -> None:
    """``model(ids).logits`` for every batch: the forward pass alone, full logits, no log-softmax (under
    ``no_grad``, as both scorers run it)."""
    import torch

    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False).logits


def padded_tokens(lm: Any, docs: list[str], batch_size: int) -> dict[str, int]:
    """Input positions each scorer computes, padding included.

    ``hf`` batches the windows in document order, each batch padded to its longest window; ``distperp``
    sorts all windows longest first before batching (its plan).
    """
    from distperp_harness.planning.requests import UnitTable, window_units

    per_doc = [window_units(lm.tok_encode(doc), lm.prefix_token_id, lm.max_length) for doc in docs]
    in_order = [u.input_length for units in per_doc for u in units]
    hf = sum(len(in_order[i:i + batch_size]) * max(in_order[i:i + batch_size])
             for i in range(0, len(in_order), batch_size))
    table = UnitTable(u for units in per_doc for u in units)
    ours = sum(b.padded_tokens for b in lm.batching.batches(table.lengths))
    return {"hf": hf, "distperp": ours, "scored": sum(u.n_score for units in per_doc for u in units)}


@dataclass
class Runner:
    """One scorer ready to run: ``run()`` scores the work once and returns the scoring-stage seconds or None."""

    key: str
    run: Callable[[], float | None]
    results: list[float] = field(default_factory=list)


def make_runner(key: str, lm: Any, requests: list[Any], batches: list[Any] | None) -> Runner:
    """A :class:`Runner` for scorer ``key`` on ``lm``."""
    runner = Runner(key, lambda: None)

    def run_rolling() -> float | None:
        runner.results = [float(x) for x in lm.loglikelihood_rolling(requests, disable_tqdm=True)]
        stats = getattr(lm, "stats", None)
        return stats.calls[-1]["scoring_seconds"] if stats is not None and stats.calls else None

    def run_bare() -> float | None:
        bare_forward(lm.model, batches)
        return None

    runner.run = run_bare if key == "bare" else run_rolling
    return runner


# ------------------------------------------------------------------------------------------------------ memory
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
        return {"scorer": args.memory_worker, "tokens": tokens, "rss_before": before, "peak_rss": peak,
                "peak_delta": peak - before, "exact": exact}
    before, high_before = current_rss(), max_rss()
    with RssSampler() as sampler:
        runner.run()
    high_after = max_rss()
    exact = high_after > high_before
    peak = high_after if exact else sampler.peak
    return {"scorer": args.memory_worker, "tokens": tokens, "rss_before": before, "peak_rss": peak,
            "peak_delta": peak - before, "exact": exact}


def measure_memory(scorer: str, path: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """Run :func:`memory_worker` for ``scorer`` in a fresh subprocess; None (with a note) if it fails."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", scorer, "--model-path", str(path),
           "--max-length", str(args.max_length), "--batch-size", str(args.batch_size), "--text", str(args.text),
           "--memory-tokens", str(args.memory_tokens), "--threads", str(args.threads or 0), "--device", args.device,
           "--dtype", args.dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  note: memory of {scorer} not measured (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
        return None
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------------------- timing
@dataclass
class ModelResult:
    """Everything measured for one model."""

    model: str
    facts: dict[str, Any]
    docs: int
    tokens: int
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    scoring_tokens_per_s: list[float] = field(default_factory=list)
    ratio_hf: list[float] = field(default_factory=list)
    ratio_hf_cpu: list[float] = field(default_factory=list)
    padded_tokens: dict[str, int] = field(default_factory=dict)
    ratio_bare: list[float] = field(default_factory=list)
    ratio_bare_end_to_end: list[float] = field(default_factory=list)
    max_abs_diff_vs_hf: float | None = None
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def bench_model(name: str, path: Path, args: argparse.Namespace) -> ModelResult:
    """Time every scorer on ``name`` (alternating, ``args.repeats`` times) and measure scoring memory."""
    facts = model_facts(path)
    scorers = [s for s in args.scorers if s in SCORERS]
    lms: dict[str, Any] = {}
    notes: list[str] = []
    skipped: set[str] = set()
    for scorer in scorers:
        if scorer == "bare":
            continue
        try:
            lms[scorer] = make_lm(scorer, path, args.max_length, args.batch_size, device=args.device,
                                  dtype=args.dtype)
        except Exception as exc:  # noqa: BLE001 - an optional path (int4) may not be available
            if scorer in ("hf", "distperp"):
                raise
            notes.append(f"{SCORERS[scorer]} skipped: {type(exc).__name__}: {str(exc)[:200]}")
            skipped.add(scorer)
    _quiet()  # distperp's LM sets its own log level when it is built
    if "bare" in scorers:
        lms["bare"] = lms["distperp"]
    tokens_limit = args.tokens if args.tokens is not None else DEFAULT_TOKENS[args.quick].get(name)
    tokens_limit = tokens_limit or None
    docs, tokens = select_documents(load_articles(Path(args.text)), lms["distperp"].tokenizer, tokens_limit)
    requests = requests_for(docs)
    batches = bare_batches(lms["distperp"], docs) if "bare" in lms else None
    runners = [make_runner(key, lm, requests, batches) for key, lm in lms.items()]
    result = ModelResult(name, facts, len(docs), tokens, {r.key: [] for r in runners}, notes=notes,
                         padded_tokens=padded_tokens(lms["distperp"], docs, args.batch_size))
    print(f"{name}: {facts['params'] / 1e6:.1f}M parameters, vocab {facts['vocab']}; {len(docs)} articles, "
          f"{tokens} tokens; scorers {', '.join(r.key for r in runners)}", flush=True)
    for rep in range(args.repeats):
        order = runners[rep % len(runners):] + runners[: rep % len(runners)]
        seconds: dict[str, float] = {}
        stage: float | None = None
        cpu: dict[str, float] = {}
        for runner in order:
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's hf always draws its inner progress bars
                inner = runner.run()
            seconds[runner.key] = time.perf_counter() - t0
            cpu[runner.key] = time.process_time() - c0
            if runner.key == "distperp":
                stage = inner
        for key, s in seconds.items():
            result.tokens_per_s[key].append(tokens / s)
        if "hf" in seconds:
            result.ratio_hf.append(seconds["hf"] / seconds["distperp"])
            result.ratio_hf_cpu.append(cpu["hf"] / cpu["distperp"])
        if stage is not None:
            result.scoring_tokens_per_s.append(tokens / stage)
        if "bare" in seconds and stage is not None:
            result.ratio_bare.append(seconds["bare"] / stage)
            result.ratio_bare_end_to_end.append(seconds["bare"] / seconds["distperp"])
        print(f"  repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{k} {tokens / s:,.0f} tok/s" for k, s in seconds.items()), flush=True)
    by_key = {r.key: r for r in runners}
    if "hf" in by_key:
        result.max_abs_diff_vs_hf = max(abs(a - b) for a, b in zip(by_key["hf"].results, by_key["distperp"].results))
    del runners, lms
    gc.collect()
    if args.memory:
        for scorer in (s for s in scorers if s not in skipped and s in args.memory_scorers):
            measured = measure_memory(scorer, path, args)
            if measured is not None:
                result.memory[scorer] = measured
    return result


DEFAULT_TOKENS: dict[bool, dict[str, int | None]] = {
    False: {"wt2-llama-5m": 100_000, RANDOM_MODEL: 16_000, "random-llama-1b": 65_536, "random-tiny": 2_000},
    True: {"wt2-llama-5m": 8_000, RANDOM_MODEL: 4_000, "random-llama-1b": 16_384, "random-tiny": 1_000},
}
"""Tokens scored per model (whole articles, first ones first): full run, ``--quick``; ``--tokens 0``: all
324,890. Sized so one scorer call takes 15-40 s on 2 cores: many short alternating repeats give steadier
medians on a shared machine than a few long ones."""


# ------------------------------------------------------------------------------------------------------ report
def machine() -> str:
    """CPU model and core count from ``/proc/cpuinfo`` (falls back to ``platform``)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def device_name(device: str) -> str:
    """``cpu``, or the GPU's name (``cuda:0``)."""
    if device != "cuda":
        return device
    import torch

    return f"{torch.cuda.get_device_name(0)} (cuda:0)"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else format(value, spec) + unit


def cli_sanity(path: Path, args: argparse.Namespace) -> str:
    """The real CLI once each way: ``python -m lm_eval --model hf|distperp ... --tasks distperp_wikitext2 --limit N``
    on the local WikiText file; wall time of each command (start-up included) and the ratio."""
    tasks = REPO_ROOT / "tasks" / "distperp"
    if not (tasks / "distperp_wikitext2.yaml").is_file():
        return f"CLI sanity skipped: {tasks}/distperp_wikitext2.yaml not found"
    env = dict(os.environ, DISTPERP_WIKITEXT_PATH=str(Path(args.text).parent))
    seconds = {}
    for name in ("hf", "distperp"):
        cmd = [sys.executable, "-m", "lm_eval", "--model", name, "--model_args",
               _model_args(path, args.max_length).replace(",device=cpu", ""), "--device", "cpu", "--tasks",
               "distperp_wikitext2", "--include_path", str(tasks), "--batch_size", str(args.batch_size),
               "--limit", str(args.cli)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
        seconds[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            return f"CLI sanity: {name} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
    return (f"CLI sanity ({path.name}, distperp_wikitext2 --limit {args.cli}, wall time with start-up): hf "
            f"{seconds['hf']:.1f} s, distperp {seconds['distperp']:.1f} s, ratio {seconds['hf'] / seconds['distperp']:.2f}")


def _best(values: list[float]) -> float | None:
    return max(values) if values else None


def report(results: list[ModelResult], args: argparse.Namespace) -> str:
    """The markdown table (and header lines) for ``benchmarks/README.md``.

    Throughput is the best of the alternating repeats (the run least disturbed by other load: interference on a
    shared machine only ever slows a run down); the notes under the table give the medians as well.
    """
    import lm_eval
    import torch
    import transformers

    lines = [
        f"{datetime.date.today().isoformat()} · {machine()} · torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) · transformers {transformers.__version__} · lm-eval "
        f"{lm_eval.__version__} · 1 process · {args.dtype} on {device_name(args.device)} · "
        f"batch size {args.batch_size} · "
        f"max_length {args.max_length} · "
        f"best of {args.repeats} alternating repeats",
        "",
        "| model | scorer | tokens/s | vs hf | vs bare forward | peak scoring memory | vs hf |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        label = f"{r.model} ({r.facts['params'] / 1e6:.1f}M, vocab {r.facts['vocab']:,}; {r.tokens:,} tok)"
        hf_tps = _best(r.tokens_per_s.get("hf", []))
        bare_tps = _best(r.tokens_per_s.get("bare", []))
        hf_mem = r.memory.get("hf", {}).get("peak_delta")
        for key, tps_list in r.tokens_per_s.items():
            tps = _best(tps_list)
            vs_hf = tps / hf_tps if hf_tps and tps and key != "hf" else None
            stage = _best(r.scoring_tokens_per_s) if key == "distperp" else None
            vs_bare = stage / bare_tps if stage and bare_tps else None
            mem = r.memory.get(key, {}).get("peak_delta")
            mem_ratio = mem / hf_mem if mem is not None and hf_mem and key != "hf" else None
            mib = _fmt(mem / 2**20 if mem is not None else None, ',.0f', ' MiB')
            lines.append(f"| {label} | {SCORERS[key]} | {_fmt(tps, ',.0f')} | {_fmt(vs_hf, '.2f', '×')} | "
                         f"{_fmt(vs_bare, '.2f')} | {mib} | {_fmt(mem_ratio, '.2f', '×')} |")
            label = ""
    lines.append("")
    for r in results:
        medians = ", ".join(f"{k} {_fmt(_median(v), ',.0f')}" for k, v in r.tokens_per_s.items())
        extra = [f"median tokens/s: {medians}",
                 f"distperp scoring stage (no tokenization) best {_fmt(_best(r.scoring_tokens_per_s), ',.0f')} tok/s"]
        if r.ratio_bare:
            extra.append(f"distperp / bare per repeat (median): scoring stage {_median(r.ratio_bare):.2f}, end to end "
                         f"{_fmt(_median(r.ratio_bare_end_to_end), '.2f')}")
        if r.ratio_hf:
            extra.append(f"distperp / hf per repeat: {', '.join(f'{x:.2f}' for x in r.ratio_hf)} (median "
                         f"{_median(r.ratio_hf):.2f}; on process CPU time {_fmt(_median(r.ratio_hf_cpu), '.2f')})")
        pad = r.padded_tokens
        extra.append(f"positions computed (padding included): hf {pad['hf']:,}, distperp {pad['distperp']:,} "
                     f"for {pad['scored']:,} scored")
        if r.max_abs_diff_vs_hf is not None:
            extra.append(f"max |hf - distperp| per document {r.max_abs_diff_vs_hf:.2g} nats")
        lines.append(f"- {r.model}: " + "; ".join(extra) + ".")
        for note in r.notes:
            lines.append(f"- {r.model}: {note}")
    return "\n".join(lines)


POSTPROCESSING_OPS = ("aten::_log_softmax", "aten::log_softmax", "aten::logsumexp", "aten::argmax", "aten::max",
                      "aten::amax", "aten::exp_", "aten::exp", "aten::sub_", "aten::gather", "aten::sum",
                      "aten::isfinite", "aten::eq", "aten::index", "aten::_to_copy", "aten::copy_")
"""Ops that turn logits into log-probs, greedy flags and sums (plus copies); everything else is the forward."""


def profile_scorers(path: Path, args: argparse.Namespace) -> str:
    """torch.profiler over one call of hf, distperp and the bare forward on the first ``--tokens``: the top ops by
    self CPU time, and the share of the post-processing ops (:data:`POSTPROCESSING_OPS`)."""
    from torch.profiler import ProfilerActivity, profile

    lms = {key: make_lm(key, path, args.max_length, args.batch_size, device=args.device, dtype=args.dtype)
           for key in ("hf", "distperp")}
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
        out.append(f"  {SCORERS[key]}: total {total / 1e3:,.0f}; post-processing {post / 1e3:,.0f} "
                   f"({post / total:.1%}); top: " + ", ".join(
                       f"{e.key.removeprefix('aten::')} {e.self_cpu_time_total / 1e3:,.0f}" for e in top))
    return "\n".join(out)


def _quiet() -> None:
    for name in ("lm_eval", "distperp_harness", "accelerate", "transformers", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small subsets and 3 repeats (a few minutes)")
    p.add_argument("--models", default=f"wt2-llama-5m,{RANDOM_MODEL}",
                   help=f"comma-separated: wt2-llama-5m, random-<shape> ({', '.join(RANDOM_SHAPES)}), or model folders")
    p.add_argument("--random-shape", default=None, choices=tuple(RANDOM_SHAPES),
                   help="score only a random-init model of this shape (the same as --models random-<shape>)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both scorers run (cuda: cuda:0)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype of both scorers")
    p.add_argument("--scorers", default=",".join(SCORERS), help=f"comma-separated subset of {', '.join(SCORERS)}")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=None, help="alternating repeats (default 5, --quick 3)")
    p.add_argument("--tokens", type=int, default=None,
                   help="score the first articles up to this many tokens (0: all; default per model)")
    p.add_argument("--memory-tokens", type=int, default=None,
                   help="tokens scored by each memory subprocess (default: batch x max_length, x2 without --quick)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory subprocesses")
    p.add_argument("--memory-scorers", default=None, help="scorers to measure memory of (default: all timed ones)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--text", default=str(WIKITEXT_TEST), help="WikiText test.txt")
    p.add_argument("--workdir", default=None, help="where to build the random model (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the raw numbers to this file")
    p.add_argument("--cli", type=int, default=0, metavar="N",
                   help="also run the real lm-eval CLI once each way on N documents of distperp_wikitext2")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: torch.profiler op breakdown of hf, distperp and the bare forward")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    if args.random_shape:
        args.models = f"random-{args.random_shape}"
    args.memory_scorers = (args.scorers if args.memory_scorers is None
                           else [s.strip() for s in args.memory_scorers.split(",") if s.strip()])
    unknown = [s for s in args.scorers if s not in SCORERS]
    if unknown or "distperp" not in args.scorers:
        p.error(f"--scorers {','.join(args.scorers)}: allowed {', '.join(SCORERS)}; distperp is required")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.memory_tokens is None:
        args.memory_tokens = (1 if args.quick else 2) * args.batch_size * args.max_length
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_worker:
        print(json.dumps(memory_worker(args)))
        return 0
    import torch

    _quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_scoring_") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if args.profile:
                print(profile_scorers(resolve_model(name, workdir), args), flush=True)
                continue
            results.append(bench_model(name, resolve_model(name, workdir), args))
            if args.cli:
                results[-1].notes.append(cli_sanity(resolve_model(name, workdir), args))
    if args.profile:
        return 0
    table = report(results, args)
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
