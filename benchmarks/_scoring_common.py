"""What every part of ``bench_scoring`` shares: models, work, scorers and the machine (``bench_mc`` and
``bench_compile`` use it too)."""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import SHARED_MODEL, lm_eval_model

RANDOM_MODEL = "random-llama-52m"
RANDOM_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    rms_norm_eps=1e-5,
)
"""The larger CPU model: 52.0M parameters (32.8M of them input embeddings and output head), vocab 32,000."""
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-52m": RANDOM_CONFIG,
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
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
    "int4-kernel": "distperp int4 (bfloat16, packed, torchao's kernel only)",
}
"""Scorer keys and their table labels. ``int4`` rows use ``quantize=int4`` (``distperp_harness.model.quantize``)."""


DEFAULT_TOKENS: dict[bool, dict[str, int | None]] = {
    False: {"wt2-llama-5m": 100_000, RANDOM_MODEL: 16_000, "random-llama-1b": 65_536, "random-tiny": 2_000},
    True: {"wt2-llama-5m": 8_000, RANDOM_MODEL: 4_000, "random-llama-1b": 16_384, "random-tiny": 1_000},
}
"""Tokens scored per model (whole articles, first ones first): full run, ``--quick``; ``--tokens 0``: all
324,890. Sized so one scorer call takes 15-40 s on 2 cores: many short alternating repeats give steadier
medians on a shared machine than a few long ones."""


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
        config.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
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
    raise ValueError(
        f"--models entry {name!r}: use wt2-llama-5m, "
        f"{', '.join('random-' + k for k in RANDOM_SHAPES)} or a model folder"
    )


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
        for key in f.keys():  # noqa: SIM118 -- safe_open is not iterable; keys() is its API
            shape = f.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= d
            params += n
    return {
        "params": params,
        "vocab": int(config.vocab_size),
        "hidden": int(config.hidden_size),
        "layers": int(config.num_hidden_layers),
    }


# ---------------------------------------------------------------------------------------------------- scorers
def _model_args(path: Path, max_length: int, extra: str = "", device: str = "cpu", dtype: str = "float32") -> str:
    device = "cuda:0" if device == "cuda" else device  # what lm-eval's hf takes (distperp takes it too)
    return f"pretrained={path},dtype={dtype},max_length={max_length},device={device}" + extra


def make_lm(
    scorer: str,
    path: Path,
    max_length: int,
    batch_size: int,
    extra_args: str = "",
    device: str = "cpu",
    dtype: str = "float32",
) -> Any:
    """The lm-eval LM object behind ``scorer`` (``bare`` uses a plain ``distperp`` LM for its model and plan);
    ``extra_args`` (``",key=value..."``) go to its ``--model_args``; ``device`` (``cpu``, ``cuda``) and
    ``dtype`` to both ``hf`` and distperp."""
    name = "hf" if scorer == "hf" else "distperp"
    extra = {
        "int4": ",quantize=int4",
        "int4-bf16": ",quantize=int4",
        "int4-kernel": ",quantize=int4,int4_prefill=kernel",
    }.get(scorer, "")
    args = _model_args(path, max_length, extra + extra_args, device, dtype)
    if scorer in ("int4-bf16", "int4-kernel"):
        args = args.replace("dtype=float32", "dtype=bfloat16")
    return lm_eval_model(name).create_from_arg_string(args, {"batch_size": batch_size})


def requests_for(docs: list[str]) -> list[Any]:
    """``loglikelihood_rolling`` instances for ``docs`` (the same objects go to every scorer)."""
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(docs)]


def bare_batches(lm: Any, docs: list[str]) -> list[Any]:
    """distperp's padded input batches for ``docs`` (same windows, canonical order and batches as its plan)."""
    import torch

    from distperp_harness.planning.requests import UnitTable, window_units

    units = [
        u
        for doc in docs
        for u in window_units(lm.tok_encode(doc), lm.prefix_token_id, lm.max_length, lm.options.stride)
    ]
    table = UnitTable(units)
    out = []
    for batch in lm.batching.batches(table.lengths):
        ids = torch.full((batch.rows, batch.padded_length), lm.tokenizer.pad_token_id, dtype=torch.long)
        for i, unit in enumerate(table.units[batch.start : batch.stop]):
            ids[i, : unit.input_length] = torch.tensor(unit.tokens[:-1])
        out.append(ids.to(lm.device))
    return out


def bare_forward(model: Any, batches: list[Any]) -> None:
    """``model(ids).logits`` for every batch: the forward pass alone, full logits, no log-softmax (under
    ``no_grad``, as both scorers run it)."""
    import torch

    with torch.no_grad():
        for ids in batches:
            _ = model(input_ids=ids, use_cache=False).logits


def padded_tokens(lm: Any, docs: list[str], batch_size: int) -> dict[str, int]:
    """Input positions each scorer computes, padding included.

    ``hf`` batches the windows in document order, each batch padded to its longest window; ``distperp``
    sorts all windows longest first before batching (its plan).
    """
    from distperp_harness.planning.requests import UnitTable, window_units

    per_doc = [window_units(lm.tok_encode(doc), lm.prefix_token_id, lm.max_length) for doc in docs]
    in_order = [u.input_length for units in per_doc for u in units]
    hf = sum(
        len(in_order[i : i + batch_size]) * max(in_order[i : i + batch_size])
        for i in range(0, len(in_order), batch_size)
    )
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
        return stats.calls[-1].scoring_seconds if stats is not None and stats.calls else None

    def run_bare() -> float | None:
        bare_forward(lm.model, batches)
        return None

    runner.run = run_bare if key == "bare" else run_rolling
    return runner


# ----------------------------------------------------------------------------------------------------- machine
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


def _quiet() -> None:
    for name in ("lm_eval", "distperp_harness", "accelerate", "transformers", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
