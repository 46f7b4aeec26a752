"""Miniatures of every causal LM type the installed transformers registers (issue 62's matrix, the building block).

``python -m benchmarks.miniatures [--types llama,gpt2] [--tokens 300] [--markdown]``

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: its default configuration (``AutoConfig.for_model``; full size,
never instantiated), the miniature (``distperp_harness.model.miniature.build_miniature``) with ``sdpa`` where the
model class supports it, else ``eager``, and one float64 forward of a ``--tokens`` row of plain token ids. One row per
type: *built* (layers kept, parameters, seconds: configuration, build, forward; the first build of a type in a process
also imports its modeling module, so build and forward are timed on a second, warm call; logits' spread and how far
one masked key or one shifted position id moves a log-probability), *skipped* (needs inputs other than token ids, or
remote code: the reason) or *failed* (the reason). One torch thread (two threads on a shared 2-core machine make
timings meaningless); build and forward are each the faster of two warm calls. ~2-4 min for all 200 types on 2
cores.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import Any

import benchmarks  # noqa: F401 - the offline environment before torch and transformers load

AUDIO_TOKENS = {
    "musicgen": "audio codebooks: its input_ids are (batch x codebooks, length) audio codes",
    "musicgen_melody": "audio codebooks: its input_ids are (batch x codebooks, length) audio codes",
}
"""Types whose token ids are not text."""
REPAIRS: dict[str, dict[str, Any]] = {
    "ministral": {"head_dim": 128},
    "hunyuan_v1_dense": {"head_dim": 128},
    "hunyuan_v1_moe": {"head_dim": 128},
    "nemotron": {"num_key_value_heads": 8},
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2},
    "deepseek_v2": {"num_experts_per_tok": 6},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"kv_n_heads": 8, "rope_theta": 500000.0, "clip_qkv": 8.0}},
}
"""Settings transformers' default configuration leaves unset (``None``) and its model then cannot build, given the
values of the family's published checkpoints (LFM2-MoE: a convolution stack with full attention every 4th layer)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions")
OTHER_INPUTS = ("pixel_values", "input_features", "input_values", "audio_codes", "shared_kv_states")
"""Forward arguments that say a class reads more than token ids (a forward without them that fails is skipped)."""


def _model_class(config: Any) -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _attention(cls: Any) -> str:
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _forward(model: Any, ids: Any, **kwargs: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits.log_softmax(-1)


def _sensitivity(model: Any, ids: Any, base: Any) -> tuple[float | None, float | None]:
    """Max |Δ log-probability| after column 5's key is masked out, and after the position ids from column 100 on
    move by one (``None`` where the forward does not take them or fails with them)."""
    import torch

    params = inspect.signature(model.forward).parameters
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    positions[0, 100:] += 1

    def moved(name: str, value: Any, first: int) -> float | None:
        if name not in params:
            return None
        try:
            return (_forward(model, ids, **{name: value}) - base)[0, first:].abs().max().item()
        except Exception:  # not measured
            return None

    return moved("attention_mask", mask, 6), moved("position_ids", positions, 100)


def _rounding(model: Any, ids: Any, base: Any) -> float | None:
    """Max |Δ log-probability| of the row between a batch of its own and a batch of two beside a shorter,
    right-padded row (another batch shape and a mask): the float64 rounding the probe must tell a wrong mask from."""
    import torch

    other = ids.flip(1)
    mask = torch.ones(2, ids.shape[1], dtype=torch.long)
    mask[1, ids.shape[1] // 2 :] = 0
    try:
        pair = _forward(model, torch.cat([ids, other]), attention_mask=mask)
    except Exception:  # not measured
        return None
    return (pair[:1] - base).abs().max().item()


def one_type(model_type: str, tokens: int) -> dict[str, Any]:
    """The matrix row of ``model_type``: ``status`` (built, skipped, failed), ``reason`` and the measurements."""
    import torch
    from transformers import AutoConfig

    from distperp_harness.model.miniature import build_miniature, miniature_config

    row: dict[str, Any] = {"type": model_type}
    if model_type in AUDIO_TOKENS:
        return {**row, "status": "skipped", "reason": AUDIO_TOKENS[model_type]}
    try:
        config = AutoConfig.for_model(model_type, **REPAIRS.get(model_type, {}))
        if getattr(config, "is_decoder", None) is False and not config.is_encoder_decoder:
            # as the family's causal checkpoints set it
            config = AutoConfig.for_model(model_type, **REPAIRS.get(model_type, {}), is_decoder=True)
        cls = _model_class(config)
    except Exception as error:  # a row, not a crash
        return {**row, "status": "failed", "reason": f"config: {_error(error)}"}
    row["class"], row["attention"] = cls.__name__, _attention(cls)
    start = time.perf_counter()
    mini = miniature_config(config)
    row["config_s"] = time.perf_counter() - start
    if isinstance(mini, str):
        status = "skipped" if mini.startswith(("remote code", "ImportError")) or _assistant(cls) else "failed"
        if _assistant(cls):
            mini = f"a draft model: reads its main model's keys and values (shared_kv_states); {mini}"
        return {**row, "status": status, "reason": _same_as_default(config, cls, mini)}
    start = time.perf_counter()
    model = build_miniature(config, attn_implementation=row["attention"], device="cpu")
    row["first_build_s"] = time.perf_counter() - start
    if isinstance(model, str):
        status = "skipped" if model.startswith("ImportError") or _assistant(cls) else "failed"
        return {**row, "status": status, "reason": _same_as_default(config, cls, f"build: {model}")}
    text = mini.get_text_config()
    limit = min([v for k in POSITION_KEYS if isinstance(v := getattr(text, k, None), int) and v > 0] or [tokens])
    row["tokens"] = min(tokens, limit - 2)  # learned tables with an offset of 2 (OPT, RoBERTa-like) end 2 early
    ids = torch.randint(0, 100, (1, row["tokens"]), generator=torch.Generator().manual_seed(0))
    _choose_language(model, text)
    try:
        base = _forward(model, ids)
    except Exception as error:  # a row, not a crash
        needs = _needs(cls)
        reason = _error(error)
        status = "skipped" if needs else "failed"
        reason = (f"needs {', '.join(needs)}: " if needs else "forward: ") + reason
        return {**row, "status": status, "reason": reason if needs else _same_as_default(config, cls, reason)}
    row["build_s"], row["forward_s"] = float("inf"), float("inf")
    for _ in range(2):  # the faster of two warm calls: the shared machine's load comes and goes
        start = time.perf_counter()
        model = build_miniature(config, attn_implementation=row["attention"], device="cpu")
        row["build_s"] = min(row["build_s"], time.perf_counter() - start)
        _choose_language(model, text)
        start = time.perf_counter()
        _forward(model, ids)
        row["forward_s"] = min(row["forward_s"], time.perf_counter() - start)
    row["layers"] = mini.get_text_config().num_hidden_layers
    row["params"] = sum(p.numel() for p in model.parameters())
    row["finite"] = bool(torch.isfinite(base).all())
    row["spread"] = base[0].max(-1).values.sub(base[0].min(-1).values).median().item()
    row["mask_moves"], row["position_moves"] = _sensitivity(model, ids, base)
    row["rounding"] = _rounding(model, ids, base)
    return {**row, "status": "built" if row["finite"] else "failed", "reason": "" if row["finite"] else "not finite"}


def _choose_language(model: Any, text: Any) -> None:
    """X-MOD runs one language adapter, which its users choose: the first of its configuration's languages."""
    languages = getattr(text, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(languages[0])


def _assistant(cls: Any) -> bool:
    """A draft model that reads its main model's keys and values (it cannot run on token ids alone)."""
    return "shared_kv_states" in inspect.signature(cls.forward).parameters


def _needs(cls: Any) -> list[str]:
    return [p for p in OTHER_INPUTS if p in inspect.signature(cls.forward).parameters]


def _error(error: BaseException) -> str:
    text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    return f"{type(error).__name__}: {first[:300]}"


def _same_as_default(config: Any, cls: Any, reason: str) -> str:
    """``reason``, marked when the default configuration itself (full size, on the meta device: no memory) fails
    with the same error: transformers' default, not the miniature."""
    import torch

    try:
        with torch.device("meta"):
            model = cls(config)
            model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
        return reason
    except Exception as error:  # a row, not a crash
        same = _error(error) in reason
    return f"{reason} (the full default configuration fails the same way)" if same else reason


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """The matrix as markdown: counts, then one line per type."""
    counts = {s: sum(r["status"] == s for r in rows) for s in ("built", "skipped", "failed")}
    lines = [
        f"{len(rows)} types: {counts['built']} built, {counts['skipped']} skipped, {counts['failed']} failed",
        "",
        "| type | class | attention | status | layers | params | build s | forward s | spread | rounding | mask Δ "
        "| position Δ | reason |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['type']} | {r.get('class', '')} | {r.get('attention', '')} | {r['status']} | "
            f"{r.get('layers', '')} | {r.get('params', '')} | {_fmt(r.get('build_s'), '.3f')} | "
            f"{_fmt(r.get('forward_s'), '.3f')} | {_fmt(r.get('spread'), '.1f')} | {_fmt(r.get('rounding'), '.0e')} | "
            f"{_fmt(r.get('mask_moves'), '.1e')} | {_fmt(r.get('position_moves'), '.1e')} | "
            f"{r.get('reason', '').replace('|', '/')} |"
        )
    built = [r["build_s"] + r["forward_s"] for r in rows if r["status"] == "built"]
    if built:
        q = statistics.quantiles(built, n=10) if len(built) > 1 else [built[0]] * 9
        lines += [
            "",
            f"build + forward seconds over {len(built)} built types (warm): median {statistics.median(built):.3f}, "
            f"p90 {q[8]:.3f}, max {max(built):.3f}, under 0.3 s: {sum(t < 0.3 for t in built)}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="", help="comma-separated model types (default: every registered one)")
    parser.add_argument("--tokens", type=int, default=300, help="length of the forward's row")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    types = [t for t in args.types.split(",") if t] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    for model_type in types:
        row = one_type(model_type, args.tokens)
        rows.append(row)
        print(f"{model_type}: {row['status']} {row.get('reason', '')}", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
