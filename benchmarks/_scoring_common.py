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


def _every(period: int, layers: int) -> list[str]:
    """``layer_types`` of ``layers`` layers with a full-attention layer every ``period`` (the rest sliding)."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


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
    # ---- families (issue 55): the smallest published configurations, gpt-oss scaled down (FAMILY_SOURCES)
    "gemma3-270m": dict(
        model_type="gemma3_text",
        attn_implementation="sdpa",
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=_every(6, 18),
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        attn_implementation="sdpa",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "granite-3-2b": dict(
        model_type="granite",
        attn_implementation="sdpa",
        vocab_size=49155,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "gpt-oss-scaled": dict(
        model_type="gpt_oss",
        attn_implementation="eager",
        vocab_size=201088,
        hidden_size=720,
        intermediate_size=720,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=_every(2, 6),
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        attention_bias=True,
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # ---- their tiny variants (tests, dry runs): the same features at test sizes
    "tiny-gemma3": dict(
        model_type="gemma3_text",
        attn_implementation="sdpa",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        layer_types=_every(6, 6),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3",
        attn_implementation="sdpa",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny-granite": dict(
        model_type="granite",
        attn_implementation="sdpa",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
    "tiny-gpt-oss": dict(
        model_type="gpt_oss",
        attn_implementation="eager",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=_every(2, 2),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
"""``--random-shape`` name → config of a random-init model (``random-<name>`` in ``--models``). A config without
``model_type`` is a Llama (``LlamaConfig``); one with ``model_type`` (and ``attn_implementation``, the keys
:func:`build_random_model` takes out) is built from transformers' own config class of that type
(``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``). ``llama-1b`` is Llama-3.2-1B's shape (1.24B
parameters, tied embeddings; saved in bfloat16, which a float32 run upcasts exactly); ``tiny`` is the test model's
(distperp_harness.commands.tiny.TEST_SPEC), for dry runs on the CPU. The families' shapes and their sources are in
:data:`FAMILY_SOURCES`; ``tiny-<family>`` keeps a family's features (windows shorter than the rows, sinks, experts,
logit scaling, tied heads) at test sizes.

The attention implementation is the one transformers' ``from_pretrained`` picks for the type by default on this
version (5.x: ``sdpa`` for Gemma 3, Qwen 3 and Granite; ``eager`` for gpt-oss, which has no sdpa path for its sinks),
so ``pretrained=FOLDER`` loads the same one in ``hf`` and ``distperp``."""

FAMILY_SOURCES: dict[str, str] = {
    "gemma3-270m": "google/gemma-3-270m (gemma3_text): hidden 640, MLP 2048, 18 layers, 4 heads / 1 KV head of 256, "
    "query_pre_attn_scalar 256, 512-token sliding windows, 5 local : 1 global, rope 1e6 global / 1e4 local, "
    "vocab 262,144, tied head, 268.1M parameters",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B (qwen3): hidden 1024, MLP 3072, 28 layers, 16 heads / 8 KV heads of 128, "
    "no sliding window, rope 1e6, vocab 151,936, tied head, 596.0M parameters",
    "granite-3-2b": "ibm-granite/granite-3.0-2b (granite): hidden 2048, MLP 8192, 40 layers, 32 heads / 8 KV heads, "
    "embedding x12, attention x0.015625, residual x0.22, logits /8, rope 1e4, vocab 49,155, tied head, 2.53B "
    "parameters (saved in bfloat16)",
    "gpt-oss-scaled": "openai/gpt-oss-20b (gpt_oss) scaled down: hidden 2880 -> 720, expert MLP 2880 -> 720, "
    "24 -> 6 layers, 64 -> 16 heads, 8 -> 2 KV heads, 32 -> 8 experts (all four divided by 4); kept: top-4 "
    "routing, head_dim 64, attention sinks and biases, 128-token sliding windows alternating with full layers, "
    "YaRN rope (theta 150,000, factor 32 over 4,096), swiglu_limit 7, vocab 201,088, untied head",
}
"""What each family shape is and where its values come from (public config.json files, read through the search
tool: Gemma 3 270M from fine-tunes that copy its config, e.g. unsloth's; Qwen3-0.6B from copies of its config;
Granite 3.0 2B from ibm-granite/granite-3.0-2b-instruct's own config.json; gpt-oss-20b from copies of its config,
keras-hub's preset and a Megatron recipe). Granite: the smallest dense published model with ``model_type`` ``granite``
is the 3.x 2B (3.0, 3.1, 3.2, 3.3 share the shape; 3.1+ set rope 5e6 and 131,072 positions). Granite 4.0's 350M
and 1B dense models were not used: their config type could not be confirmed (they are believed to ship as
``granitemoehybrid`` with every layer attention). Not confirmed for Gemma 3 270M: ``tie_word_embeddings`` (absent
from the config, so the class default, True)."""

SAVED_IN_BFLOAT16 = frozenset({"llama-1b", "granite-3-2b"})
"""Shapes saved in bfloat16 (half the disk; a float32 run upcasts the weights exactly)."""

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
    False: {
        "wt2-llama-5m": 100_000,
        RANDOM_MODEL: 16_000,
        "random-llama-1b": 65_536,
        "random-tiny": 2_000,
        "random-gemma3-270m": 8_000,
        "random-qwen3-0.6b": 4_000,
        "random-granite-3-2b": 2_000,
        "random-gpt-oss-scaled": 8_000,
    },
    True: {"wt2-llama-5m": 8_000, RANDOM_MODEL: 4_000, "random-llama-1b": 16_384, "random-tiny": 1_000},
}
"""Tokens scored per model (whole articles, first ones first): full run, ``--quick``; ``--tokens 0``: all
324,890. Sized so one scorer call takes 15-40 s on 2 cores: many short alternating repeats give steadier
medians on a shared machine than a few long ones (the family shapes: about one call of 15-60 s; any other shape,
e.g. ``random-tiny-gemma3``, defaults to 1,000 tokens)."""


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
    """A random-init model of :data:`RANDOM_SHAPES` ``[shape]`` with :func:`random_tokenizer`, saved in ``out_dir``
    (float32; :data:`SAVED_IN_BFLOAT16` in bfloat16): a Llama (``LlamaForCausalLM``) when the shape names no
    ``model_type``, else ``AutoConfig.for_model(model_type, **config)`` built by
    ``AutoModelForCausalLM.from_config(config, attn_implementation=...)``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = dict(RANDOM_SHAPES[shape])
    model_type = config.pop("model_type", None)
    attn_implementation = config.pop("attn_implementation", None)
    tokenizer = random_tokenizer(config["vocab_size"])
    if shape != "llama-52m":  # (the 52M model keeps the ids it was first built with)
        config.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    torch.manual_seed(seed)
    if model_type is None:
        model = LlamaForCausalLM(LlamaConfig(**config, dtype="float32")).to(torch.float32)
    else:
        built = AutoConfig.for_model(model_type, **config)
        model = AutoModelForCausalLM.from_config(built, attn_implementation=attn_implementation, dtype=torch.float32)
    if shape in SAVED_IN_BFLOAT16:
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
    for file in sorted(path.glob("*.safetensors")):  # one file, or the shards of a larger checkpoint
        with safe_open(str(file), framework="pt") as f:
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


def make_lm(  # noqa: PLR0913 - what every scorer takes, the last four defaulted
    scorer: str,
    path: Path,
    max_length: int,
    batch_size: int,
    extra_args: str = "",
    device: str = "cpu",
    dtype: str = "float32",
    model: Any = None,
) -> Any:
    """The lm-eval LM object behind ``scorer`` (``bare`` uses a plain ``distperp`` LM for its model and plan);
    ``extra_args`` (``",key=value..."``) go to its ``--model_args``; ``device`` (``cpu``, ``cuda``) and
    ``dtype`` to both ``hf`` and distperp. ``model``: an already loaded model (:func:`load_model`) that every scorer
    given it shares (``pretrained=<model>``, as both lm-eval ``hf`` and distperp accept; its tokenizer from
    ``path``): one copy of the weights in memory instead of one per scorer."""
    name = "hf" if scorer == "hf" else "distperp"
    extra = {
        "int4": ",quantize=int4",
        "int4-bf16": ",quantize=int4",
        "int4-kernel": ",quantize=int4,int4_prefill=kernel",
    }.get(scorer, "")
    args = _model_args(path, max_length, extra + extra_args, device, dtype)
    if scorer in ("int4-bf16", "int4-kernel"):
        args = args.replace("dtype=float32", "dtype=bfloat16")
    if model is not None:
        from lm_eval.utils import simple_parse_args_string

        given = {**simple_parse_args_string(args), "pretrained": model, "tokenizer": str(path)}
        return lm_eval_model(name).create_from_arg_obj(given, {"batch_size": batch_size})
    return lm_eval_model(name).create_from_arg_string(args, {"batch_size": batch_size})


def load_model(path: Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """The checkpoint at ``path`` as ``from_pretrained`` loads it (transformers' default attention implementation
    for its type), in eval mode, for :func:`make_lm`'s ``model``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to("cuda:0" if device == "cuda" else device).eval()


def probe_decision(lm: Any) -> str:
    """The scoring paths distperp's probe decided for ``lm``'s model, as its run record keeps them
    (``config.distperp.paths.model``, which ``lm.prepared.paths`` holds): packed rows (with each layer type's rule),
    a cached prefix, the head only where scored (with the logit map), or each one's fallback reason; the words of
    the log line ``scoring paths, probed on the loaded weights: ...``."""
    paths = lm.prepared.paths["model"]
    kinds = (paths.get("layout") or {}).get("layer_types") or {}
    rules = ", ".join(f"{kind}: {rule}" for kind, rule in kinds.items()) if len(set(kinds.values())) > 1 else ""
    parts = [
        ("packed rows" + (f" ({rules})" if rules else ""))
        if paths["packed_rows"]
        else f"no packed rows ({paths['packed_rows_fallback']})",
        "cached prefix" if paths["cached_prefix"] else f"no cached prefix ({paths['cached_prefix_fallback']})",
        ("head only where scored" + (f" with {paths['output_map']}" if paths.get("output_map") else ""))
        if paths["head_only_where_scored"]
        else f"full logits ({paths['head_fallback']})",
    ]
    return ("probed: " if paths.get("probed") else "declared: ") + "; ".join(parts)


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


class Counter:
    """Positions through the decoder, by kind, and the decode forwards (a forward pre-hook on ``base_model``):
    ``decode`` counts rows of one-token forwards, ``prefill`` every other position (pads included). Reset the counts
    before a call and read them after it (a model shared by several scorers counts every scorer's forwards);
    ``remove()`` takes the hook off."""

    def __init__(self, model) -> None:
        self.decode = self.prefill = self.decode_forwards = 0
        self._handle = model.base_model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        if shape[1] == 1:
            self.decode += int(shape[0])
            self.decode_forwards += 1
        else:
            self.prefill += int(shape[0] * shape[1])

    def reset(self) -> None:
        self.decode = self.prefill = self.decode_forwards = 0

    @property
    def positions(self) -> int:
        """Every position counted since the last reset."""
        return self.decode + self.prefill

    def remove(self) -> None:
        self._handle.remove()


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
