"""Families at their published positional and attention settings, at small widths (beside the tiny Llama models of
:mod:`~distperp_harness.commands.tiny`): the configurations the family matrix (``benchmarks.family_matrix``) and the
tests (``tests/helpers.py`` re-exports them) build models from."""

from __future__ import annotations

from typing import Any

VOCAB = 1024
"""The families' vocabulary."""


_PHI3_LONG_FACTOR = [
    1.07, 1.12, 1.15, 1.42, 1.57, 1.8, 2.13, 2.13, 3.01, 5.91, 6.95, 9.07, 9.93, 10.71, 11.13, 14.61, 15.41, 19.81,
    37.28, 38.28, 38.6, 40.12, 46.2, 50.94, 53.66, 54.94, 56.9, 57.29, 59.99, 60.87, 60.89, 61.72, 62.92, 62.96,
    63.42, 63.82, 63.84, 63.9, 63.94, 64.07, 64.11, 64.12, 64.15, 64.19, 64.24, 64.57, 64.69, 64.71,
]  # fmt: skip
"""Phi-3-mini-128k's ``long_factor`` (one per rotary frequency of its 96-wide heads), to two decimals."""
_PHI3_SHORT_FACTOR = [
    1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.25, 1.25, 1.4, 1.45, 1.45, 1.45, 1.55, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9,
    1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9,
    1.9, 1.9, 1.9, 1.9, 1.9,
]  # fmt: skip
"""Phi-3-mini-128k's ``short_factor`` (48 entries)."""
PUBLISHED: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_positions": 1024, "n_embd": 64, "n_layer": 2, "n_head": 4},
    "opt": {
        "model_type": "opt", "max_position_embeddings": 2048, "hidden_size": 64, "ffn_dim": 128,
        "word_embed_proj_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "do_layer_norm_before": True,
        "enable_bias": True, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
    },
    "gptj": {"model_type": "gptj", "n_positions": 2048, "rotary_dim": 64, "n_embd": 128, "n_layer": 2, "n_head": 2},
    "gpt_neo": {
        "model_type": "gpt_neo", "max_position_embeddings": 2048, "window_size": 256,
        "attention_types": [[["global", "local"], 1]], "num_layers": 2, "hidden_size": 64, "num_heads": 4,
    },
    "phi3": {
        "model_type": "phi3", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": _PHI3_LONG_FACTOR, "short_factor": _PHI3_SHORT_FACTOR},
        "rope_theta": 10000.0, "sliding_window": 262144, "hidden_size": 192, "intermediate_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
    },
    "mpt": {
        "model_type": "mpt", "max_seq_len": 2048, "d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4,
        "no_bias": True, "norm_type": "low_precision_layernorm", "learned_pos_emb": True,
        "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "prefix_lm": False},
    },
    "bloom": {
        "model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4,
        "apply_residual_connection_post_layernorm": False, "slow_but_exact": False,
    },
    "falcon": {
        "model_type": "falcon", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
        "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False, "alibi": False, "bias": False,
        "rope_theta": 10000.0, "max_position_embeddings": 2048,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64, "first_k_dense_replace": 3,
        "max_position_embeddings": 163840, "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
    },
    "cohere2": {
        "model_type": "cohere2", "sliding_window": 4096, "sliding_window_pattern": 4, "logit_scale": 0.25,
        "rope_theta": 50000.0, "max_position_embeddings": 8192, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "llama4_text": {
        "model_type": "llama4_text", "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0],
        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "max_position_embeddings": 10485760,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "interleave_moe_layer_step": 1, "use_qk_norm": True, "hidden_size": 64, "intermediate_size": 64,
        "intermediate_size_mlp": 128, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
    },
    "gemma3_text": {
        "model_type": "gemma3_text", "sliding_window": 512, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "head_dim": 256, "num_attention_heads": 4,
        "num_key_value_heads": 1, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
    "llama-dynamic": {
        "model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    },
    # the published mechanisms at thresholds short rows cross
    "llama-dynamic-64": {
        "model_type": "llama", "max_position_embeddings": 64, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    },
    "llama4-floor-40": {
        "model_type": "llama4_text", "attention_chunk_size": 48, "no_rope_layers": [1, 1, 1, 0],
        "attn_temperature_tuning": True, "floor_scale": 40, "attn_scale": 0.1, "max_position_embeddings": 10485760,
        "rope_theta": 500000.0, "interleave_moe_layer_step": 1, "use_qk_norm": True, "hidden_size": 64,
        "intermediate_size": 64, "intermediate_size_mlp": 128, "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
    },
}  # fmt: skip
"""Families at their published positional and attention settings (GPT-2 and OPT's learned tables, GPT-J's 64 rotary
dims, GPT-Neo 125M's 256-token local layers, Phi-3-mini-128k's longrope, MPT-7b and BLOOM's ALiBi, Falcon-7b's
rotary multi-query parallel attention, DeepSeek-V3's MLA and yarn, Command R7B's window pattern and logit scale,
Llama 4 Scout's chunks, NoPE layers and temperature tuning, Gemma 3 270M's 512-token windows, Llama with dynamic
rope; and two of those mechanisms at thresholds short rows cross: dynamic rope past 64 tokens, Llama 4's temperature
tuning past 40 and chunks of 48), at small widths (GPT-J's heads keep their 64 rotary dims, Phi-3's its 96 wide
heads, DeepSeek-V3 its MLA sizes): name -> config keywords (``model_type`` among them). Written from the hub's
configurations; array values to two decimals."""


def published_config(name: str) -> Any:
    """:data:`PUBLISHED`'s ``name`` as a transformers configuration (vocabulary :data:`VOCAB`, special ids
    0-2 unless the family sets them)."""
    from transformers import AutoConfig

    keywords = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **PUBLISHED[name]}
    return AutoConfig.for_model(keywords.pop("model_type"), **keywords)


def attention_of(config: Any) -> str:
    """``sdpa`` where the causal LM class of ``config`` supports it, else ``eager``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", False) else "eager"
