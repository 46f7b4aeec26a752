"""The configuration keys a miniature changes, by what each one measures (``miniature.py`` applies them).

A miniature copies a transformers configuration whole and changes only the keys named here: widths, head counts,
per-head sizes, experts, vocabularies, special token ids and the depth with its per-layer lists. Every other key —
rope settings, position tables, windows, chunks, layer patterns, soft-caps, multipliers, biases, norms — is the
loaded model's own. :data:`SHRUNK_KEYS` is the whole list: a key outside it is kept exactly.
"""

from __future__ import annotations

HEAD_COUNT_ORDER = (
    "num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads",
    "num_decoder_attention_heads", "encoder_attention_heads", "num_encoder_attention_heads",
    "conf_num_attention_heads", "swa_num_attention_heads",
)  # fmt: skip
"""Query head counts: the first one present sets the miniature's head count (at most :data:`MAX_HEADS`, 4 over 2
key-value heads where the model groups them)."""
HEAD_COUNT_KEYS = frozenset(HEAD_COUNT_ORDER)
MAX_HEADS = 2

KV_HEAD_KEYS: dict[str, tuple[str, ...]] = {
    # key-value head count -> the query head counts it groups (the first present one is its partner)
    "num_key_value_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_attention_heads", "n_head"),
    "kv_n_heads": ("n_heads",),
    "swa_num_key_value_heads": ("swa_num_attention_heads",),
    "num_query_groups": ("num_attention_heads",),
}
"""Key-value heads keep their kind: as many as the queries (multi-head), one (multi-query) or fewer (grouped)."""

OTHER_COUNT_KEYS = frozenset(
    {
        "linear_num_key_heads", "linear_num_value_heads", "linear_num_heads", "mamba_n_heads", "mamba_num_heads",
        "n_mamba_heads", "index_n_heads", "index_num_heads", "indexer_n_heads", "indexer_kv_heads",
        "heads_per_ngram", "n_groups", "mamba_n_groups", "mamba_ngroups", "o_groups",
    }
)  # fmt: skip
"""Other counts of heads or groups: divided by the query heads' factor, at least 1."""
TIED_HEAD_KEYS = {
    "n_mamba_heads": "mamba_headdim",
    "mamba_n_heads": "mamba_d_head",
    "mamba_num_heads": "mamba_head_dim",
}
"""State-space head counts whose product with a per-head size is a width (``expand × hidden``): where the per-head
size is set, the query heads' factor stays small enough to leave at least one such head."""

HEAD_DIM_KEYS = frozenset(
    {
        "head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "attention_head_dim",
        "attention_head_size", "d_head", "dim_head", "kv_channels", "swa_head_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim",
        "index_head_dim", "indexer_head_dim",
    }
)  # fmt: skip
"""Sizes per head: all divided by one power of two (equalities between them kept), or kept where a rope array,
section or absolute rotary size depends on them."""

WIDTH_KEYS = frozenset(
    {
        "hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embedding_dim", "embedding_size",
        "input_embedding_size", "output_embedding_size", "word_embed_proj_dim", "intermediate_size",
        "intermediate_size_mlp", "moe_intermediate_size", "shared_expert_intermediate_size",
        "shared_experts_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size",
        "dense_intermediate_size", "first_dense_intermediate_size", "prefix_dense_intermediate_size",
        "mlp_only_intermediate_size", "expert_ffn_hidden_size", "ffn_hidden_size", "ffn_dim", "decoder_ffn_dim",
        "encoder_ffn_dim", "n_inner", "d_inner", "d_ff", "dff", "dim_ff", "feed_forward_size",
        "attention_hidden_size", "lru_width", "hidden_size_per_layer_input", "router_hidden_size", "mamba_d_ssm",
        "backbone_hidden_size", "ple_embed_dim", "kv_lora_rank", "q_lora_rank", "o_lora_rank", "laurel_rank",
        "adapter_rank", "gated_norm_rank", "hc_lowrank", "loop_gate_rank", "time_step_rank", "mamba_dt_rank",
        "cross_attention_hidden_size", "hidden_size_global", "pronunciation_embed_dim", "shape_embed_dim",
        "prompt_mid_dim", "dim_model_base", "moe_latent_size", "axial_pos_embds_dim", "hidden_sizes",
        "conv_output_size", "projection_dim", "text_hidden_size", "vision_hidden_size", "audio_hidden_size",
        "mm_hidden_size", "projector_hidden_size", "out_hidden_size",
    }
)  # fmt: skip
"""Widths (model, feed-forward, low-rank, state-space inner sizes): divided by the model width's factor, so that
width ratios (``dim_model_base``'s logit scale, ``expand × hidden = heads × head size``) hold, and at most
:data:`MAX_WIDTH_RATIO` times the new model width."""
MAX_WIDTH_RATIO = 8

STATE_KEYS = frozenset({"state_size", "mamba_d_state", "ssm_state_size", "d_state"})
"""State-space state sizes: at most 16."""

EXPERT_KEYS = frozenset(
    {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num", "num_centroids"}
)
"""Routed expert counts: at most 4."""
TOP_K_KEYS = frozenset(
    {
        "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts", "moe_top_k",
        "centroid_intermediate_top_k",
    }
)  # fmt: skip
"""Experts per token: at most 2."""
SHARED_EXPERT_KEYS = frozenset({"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"})
"""Shared expert counts: at most 1 (none stays none)."""
EXPERT_GROUP_KEYS = {"n_group": "topk_group", "num_expert_group": "topk_group"}
"""Expert groups -> the count of groups routed to: 1 group routed of at most 2."""

VOCAB_KEYS = frozenset(
    {
        "vocab_size", "vocab_size_per_layer_input", "audio_vocab_size", "output_vocab_size", "unpadded_vocab_size",
        "decoder_vocab_size", "pronunciation_vocab_size", "shape_vocab_size", "ngram_vocab_size_base",
    }
)  # fmt: skip
"""Vocabulary sizes: :data:`VOCAB` (a smaller one is kept)."""
VOCAB = 128
SPECIAL_BLOCK = 16
"""Special token ids at or past the new vocabulary move into its last :data:`SPECIAL_BLOCK` ids."""
SPECIAL_ID_SUFFIXES = ("_token_id", "_token_ids", "_token_index", "_token_indices")
SPECIAL_ID_KEYS = frozenset({"unk_index", "mask_index", "pad_index", "bos_index", "eos_index", "lang_id"})

LAYER_COUNT_KEYS = (
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers", "num_blocks",
)  # fmt: skip
"""The depth: the first one present holds the number of layers."""
LAYER_INDEX_KEYS = frozenset(
    {
        "mlp_only_layers", "moe_layers", "attn_layer_indices", "full_attn_idxs", "hybrid_layer_ids", "index_layers",
        "ple_layer_ids", "local_layer_ids", "cross_attention_layers", "swa_layers", "global_attn_layers",
        "sliding_window_layers", "full_attention_layers", "dense_layers", "attention_layer_indices",
    }
)  # fmt: skip
"""Lists of layer indices: a layer's kind includes whether it is listed; the miniature keeps the indices below
its depth."""
SOURCE_LAYER_KEYS = frozenset({"kv_source_layers"})
"""Per-layer lists of layer indices (whose keys and values a layer reads): the kind is whether a layer reads its own."""
TAIL_COUNT_KEYS = ("num_kv_shared_layers",)
"""Sizes of a block of last layers unlike the others: the miniature keeps a prefix of that block as well."""
BLOCK_KEYS = (("n_input_layers", "n_recurrent_layers", "n_output_layers"),)
"""Sizes of consecutive blocks that make up the stack: the miniature keeps a prefix of each."""
NOT_PER_LAYER = frozenset({"architectures", "languages", "begin_suppress_tokens", "suppress_tokens"})
"""Lists that never describe layers, whatever their length."""

PATTERN_KEYS = {
    # an integer setting -> how it sorts layer i into kinds (the value v is the setting)
    "first_k_dense_replace": lambda i, v: i < v,
    "num_dense_layers": lambda i, v: i < v,
    "moe_layer_freq": lambda i, v: i % v == 0,
    "decoder_sparse_step": lambda i, v: (i + 1) % v == 0,
    "interleave_moe_layer_step": lambda i, v: (i + 1) % v == 0,
    "sliding_window_pattern": lambda i, v: (i + 1) % v == 0,
    "_sliding_window_pattern": lambda i, v: (i + 1) % v == 0,
    "prefix_dense_sliding_window_pattern": lambda i, v: (i + 1) % v == 0,
    "no_rope_layer_interval": lambda i, v: (i + 1) % v == 0,
    "layer_group_size": lambda i, v: (i + 1) % v == 0,
    "n_layers_per_attn_res_block": lambda i, v: i % v,
    "moe_layer_start_index": lambda i, v: i >= v,
    "moe_layer_interval": lambda i, v: i % v,
    "attn_layer_period": lambda i, v: i % v,
    "expert_layer_period": lambda i, v: i % v,
}
"""Integer settings that make layers differ by index (a period, a first dense block, a threshold)."""

DROPPED_KEYS = frozenset({"quantization_config"})
"""Keys a miniature leaves out: how the loaded weights are stored, not what the architecture computes (the miniature
is float64)."""

SHRUNK_KEYS = (
    HEAD_COUNT_KEYS | set(KV_HEAD_KEYS) | OTHER_COUNT_KEYS | HEAD_DIM_KEYS | WIDTH_KEYS | STATE_KEYS | EXPERT_KEYS
    | TOP_K_KEYS | SHARED_EXPERT_KEYS | set(EXPERT_GROUP_KEYS) | set(EXPERT_GROUP_KEYS.values()) | VOCAB_KEYS
    | SPECIAL_ID_KEYS | set(LAYER_COUNT_KEYS) | set(TAIL_COUNT_KEYS)
    | {k for names in BLOCK_KEYS for k in names} | DROPPED_KEYS
)  # fmt: skip
"""Every key a miniature may change besides special token ids (``*_token_id`` …) and per-layer lists, which it
truncates to its depth."""
