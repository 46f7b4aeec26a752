"""``model/miniature.py`` (with ``miniature_keys`` and ``miniature_layers``): the float64 miniature a probe runs in
place of the loaded model.

For every family of :data:`helpers.PUBLISHED` (published positional and attention settings): the miniature is the
same configuration and model class, every key outside the width list is the original's (per-layer lists cut to its
depth), every kind of layer is kept, the build is float64, deterministic, leaves the global random state alone and is
fast whatever the original's size, and one moved position id (or, for ALiBi, one masked key) moves a log-probability
by orders of magnitude more than float64 rounding.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import pytest
import torch
from helpers import PUBLISHED, assert_same_weights, attention_of, published_config, published_model
from transformers import AutoConfig, PretrainedConfig

from distperp_harness.model import miniature_keys as keys
from distperp_harness.model.miniature import build_miniature, miniature_config

FAMILIES = sorted(PUBLISHED)
ALIBI = ("bloom", "mpt")
"""Families whose attention reads no position ids (ALiBi: distances from the mask)."""


@pytest.fixture
def one_thread():
    """Timings at one torch thread: on the shared 2-core machine two threads under load run a small float64 forward
    10x slower (OpenMP spinning), which measures the load, not the miniature."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _special(key: str) -> bool:
    return key.endswith(keys.SPECIAL_ID_SUFFIXES) or key in keys.SPECIAL_ID_KEYS


def _expand(value: list[Any]) -> list[Any]:
    return [kind for kinds, repeat in value for _ in range(repeat) for kind in kinds]


def _changed(original: dict[str, Any], mini: dict[str, Any], depth: int, path: str = "") -> list[str]:
    """Keys of ``original`` the miniature does not keep: every key outside :data:`keys.SHRUNK_KEYS` and the special
    ids must be equal, per-layer lists equal to the original's first ``depth`` entries."""
    changed = []
    for key, value in original.items():
        if key in keys.SHRUNK_KEYS or _special(key) or key in ("id2label", "label2id", "transformers_version"):
            continue
        new = mini.get(key)
        if key == "attention_types":
            if _expand(new) != _expand(value)[:depth]:
                changed.append(path + key)
        elif isinstance(value, dict) and isinstance(new, dict) and "rope" not in key:
            changed += _changed(value, new, depth, f"{path}{key}.")
        elif isinstance(value, list) and len(value) > depth and key in ("layer_types", "no_rope_layers"):
            if new != value[:depth]:
                changed.append(path + key)
        elif key in keys.LAYER_INDEX_KEYS:
            if new != [i for i in value if i < depth]:
                changed.append(path + key)
        elif new != value:
            changed.append(f"{path}{key}: {value!r} -> {new!r}")
    return changed


@pytest.mark.parametrize("name", FAMILIES)
def test_every_positional_and_attention_setting_is_kept(name: str) -> None:
    config = published_config(name)
    mini = miniature_config(config)
    assert not isinstance(mini, str), mini
    assert type(mini) is type(config)
    depth = mini.get_text_config().num_hidden_layers
    assert _changed(config.to_dict(), mini.to_dict(), depth) == []
    assert mini.rope_parameters == config.rope_parameters if hasattr(config, "rope_parameters") else True
    assert mini.vocab_size <= keys.VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(mini, key, None)
        assert value is None or all(0 <= v < mini.vocab_size for v in (value if isinstance(value, list) else [value]))


@pytest.mark.parametrize("name", FAMILIES)
def test_widths_shrink_and_every_kind_of_layer_stays(name: str) -> None:
    config = published_config(name)
    mini = miniature_config(config)
    text, small = config.get_text_config(), mini.get_text_config()
    assert small.hidden_size <= text.hidden_size and small.hidden_size <= 256
    assert small.num_attention_heads <= 4
    for key in ("layer_types", "no_rope_layers", "attention_layers"):
        if getattr(text, key, None):
            assert set(getattr(small, key)) == set(getattr(text, key)), key


def test_published_layouts_survive_the_shrink() -> None:
    """The relations the probe must see: Phi-3's longrope arrays keep their 96-wide heads, GPT-J's 64 rotary dims
    their heads, DeepSeek-V3's MLA ``head_dim = qk_rope_head_dim`` and a value head unlike the query-key head (sizes
    shrunk), its 3 dense layers before the first MoE one, grouped and multi-query heads their kind."""
    phi3 = miniature_config(published_config("phi3"))
    assert phi3.hidden_size // phi3.num_attention_heads == 96
    assert len(phi3.rope_parameters["long_factor"]) == 48 and phi3.rope_parameters["rope_type"] == "longrope"
    gptj = miniature_config(published_config("gptj"))
    assert gptj.rotary_dim == 64 and gptj.n_embd // gptj.n_head >= 64
    v3 = miniature_config(published_config("deepseek_v3"))
    assert v3.head_dim == v3.qk_rope_head_dim < 64
    assert v3.v_head_dim != v3.qk_rope_head_dim + v3.qk_nope_head_dim
    assert (v3.num_hidden_layers, v3.first_k_dense_replace) == (4, 3)
    assert v3.n_routed_experts <= 4 and v3.num_experts_per_tok <= 2
    cohere = miniature_config(published_config("cohere2"))
    assert cohere.num_key_value_heads < cohere.num_attention_heads and cohere.num_key_value_heads > 1
    falcon = miniature_config(published_config("falcon"))
    assert falcon.multi_query and falcon.parallel_attn
    gemma = miniature_config(published_config("gemma3_text"))
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and gemma.sliding_window == 512


def test_cost_does_not_grow_with_the_model(one_thread: None) -> None:
    """DeepSeek-V3's default configuration is the full 671B model (61 layers, 256 experts, 7168 wide): its miniature
    is as small as the published family's here and builds in a fraction of a second."""
    full = AutoConfig.for_model("deepseek_v3")
    build_miniature(full, attn_implementation="sdpa", device="cpu")  # imports, once
    start = time.perf_counter()
    model = build_miniature(full, attn_implementation="sdpa", device="cpu")
    elapsed = time.perf_counter() - start
    assert not isinstance(model, str), model
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert model.config.num_hidden_layers == 4 and model.config.first_k_dense_replace == 3
    assert elapsed < 1.0, f"{elapsed:.2f} s (shared machine: the benchmark's median is ~0.1 s)"


@pytest.mark.parametrize("name", FAMILIES)
def test_float64_deterministic_and_fast(name: str, one_thread: None) -> None:
    config = published_config(name)
    impl = attention_of(config)
    build_miniature(config, attn_implementation=impl, device="cpu")  # the modeling module's import, once
    state = torch.random.get_rng_state()
    start = time.perf_counter()
    first = build_miniature(config, attn_implementation=impl, device="cpu")
    with torch.no_grad():
        first(torch.arange(512).remainder(100).unsqueeze(0))
    elapsed = time.perf_counter() - start
    assert torch.equal(torch.random.get_rng_state(), state), "the global random state moved"
    second = build_miniature(config, attn_implementation=impl, device="cpu", seed=0)
    assert_same_weights(first, second)
    other = build_miniature(config, attn_implementation=impl, device="cpu", seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), other.state_dict().values()))
    kept = [  # computed in float32 by the class's own code (a router's weight and bias)
        *(getattr(first, "_keep_in_fp32_modules", None) or []),
        *(getattr(first, "_keep_in_fp32_modules_strict", None) or []),
    ]
    assert {p.dtype for n, p in first.named_parameters() if not any(k in n for k in kept)} == {torch.float64}
    assert not first.training
    assert elapsed < 1.0, f"build + 512-token forward {elapsed:.2f} s (shared machine; benchmark median ~0.1 s)"


def _log_probs(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits.log_softmax(-1)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_moved_position_or_mask_moves_a_score_far_past_rounding(name: str) -> None:
    """The same row in a batch of one and in a batch of two differs by float64 rounding (0 for most classes; ~1e-7
    where experts group tokens by batch and the class computes norms and routers in float32); one position id moved
    (for ALiBi: one key masked out) moves a log-probability by more than 1e-3 nats and 1e4 times that rounding, and
    the logits spread over several nats."""
    config = published_config(name)
    model = build_miniature(config, attn_implementation=attention_of(config), device="cpu")
    ids = torch.randint(0, 100, (1, 300), generator=torch.Generator().manual_seed(0))
    base = _log_probs(model, ids)
    pair = _log_probs(model, torch.cat([ids, ids.flip(1)]))[:1]
    rounding = (pair - base).abs().max().item()
    assert rounding < 1e-6
    spread = (base[0].max(-1).values - base[0].min(-1).values).median().item()
    assert 2.0 < spread < 100.0
    if name in ALIBI:
        mask = torch.ones_like(ids)
        mask[0, 5] = 0
        moved = (_log_probs(model, ids, attention_mask=mask) - base)[0, 6:].abs().max().item()
    else:
        assert "position_ids" in inspect.signature(model.forward).parameters
        positions = torch.arange(300).unsqueeze(0)
        positions[0, 150:] += 1
        moved = (_log_probs(model, ids, position_ids=positions) - base)[0, 150:].abs().max().item()
    assert moved > 1e-3 and moved > 1e4 * rounding, (moved, rounding)


@pytest.mark.parametrize("name", ["gpt2", "deepseek_v3", "gemma3_text"])
def test_published_model_is_the_real_side(name: str) -> None:
    """:func:`helpers.published_model`: a small float32 model of the published settings, whose miniature is the
    same class."""
    model = published_model(name)
    assert model.dtype == torch.float32 and not model.training
    mini = build_miniature(model.config, attn_implementation="eager", device="cpu")
    assert type(mini) is type(model)


def test_a_block_of_shared_layers_keeps_a_prefix_of_its_own() -> None:
    """Gemma 3n's last layers read earlier layers' keys and values (``num_kv_shared_layers``): the miniature keeps
    a prefix of the layers before them with every kind, and a prefix of the shared block with every kind."""
    config = AutoConfig.for_model("gemma3n_text")
    mini = miniature_config(config)
    assert not isinstance(mini, str), mini
    shared = mini.num_kv_shared_layers
    assert 0 < shared < mini.num_hidden_layers
    head, tail = mini.layer_types[:-shared], mini.layer_types[-shared:]
    assert set(head) == set(tail) == set(config.layer_types)
    assert not isinstance(build_miniature(config, attn_implementation="sdpa", device="cpu"), str)


def test_no_miniature_of_remote_code_or_a_kind_past_the_cap() -> None:
    class RemoteConfig(PretrainedConfig):
        model_type = "remote"

    reason = miniature_config(RemoteConfig())
    assert isinstance(reason, str) and reason.startswith("remote code")
    late = ["full_attention"] * 39 + ["sliding_attention"]
    config = AutoConfig.for_model("qwen2", num_hidden_layers=40, layer_types=late, sliding_window=64)
    reason = miniature_config(config)
    assert isinstance(reason, str) and "layer 40 of 40" in reason


@pytest.mark.parametrize("model_type", ["cohere2", "minicpm3"])
def test_the_head_is_drawn_against_the_logit_map(model_type: str) -> None:
    """Cohere's ``logit_scale`` (1/16 by default) and MiniCPM's width scaling shrink logits by a fixed map the
    miniature keeps: its head is drawn that much larger, so log-probabilities still spread over several nats."""
    config = AutoConfig.for_model(model_type)
    model = build_miniature(config, attn_implementation="sdpa", device="cpu")
    assert getattr(model.config, "logit_scale", None) == getattr(config, "logit_scale", None)
    base = _log_probs(model, torch.randint(0, 100, (1, 64), generator=torch.Generator().manual_seed(0)))
    assert (base[0].max(-1).values - base[0].min(-1).values).median().item() > 5.0


@pytest.mark.parametrize(("name", "far"), [("phi3", 5000), ("llama-dynamic", 9000)])
def test_a_length_chosen_rope_moves_the_miniature_as_it_moves_the_model(name: str, far: int) -> None:
    """Phi-3's longrope and Llama's dynamic rope choose their factor from the row's largest position: one token at a
    position past the original context moves every earlier token's score, in the float32 model of the published
    settings and, by far more than rounding, in its miniature (the same code at the same settings)."""
    config = published_config(name)
    ids = torch.randint(0, 100, (1, 41), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(41).unsqueeze(0)
    positions[0, 40] = far
    for model, least in (
        (published_model(name), 1e-4),
        (build_miniature(config, attn_implementation="sdpa", device="cpu"), 1e-1),
    ):
        alone = _log_probs(model, ids[:, :40], position_ids=positions[:, :40])
        beside = _log_probs(model, ids, position_ids=positions)[:, :40]
        assert (alone - beside).abs().max().item() > least, type(model).__name__


def test_a_quantized_checkpoints_storage_is_not_copied() -> None:
    """A loaded model's ``quantization_config`` says how its weights are stored: the float64 miniature has none."""
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    mini = miniature_config(config)
    assert not isinstance(mini, str) and getattr(mini, "quantization_config", None) is None
