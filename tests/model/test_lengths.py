"""What a model reads of a forward's length (:mod:`distperp_harness.model.lengths`): the rule declared by its rotary
settings, its keys, and dynamic RoPE made to start every forward afresh."""

import copy

import numpy as np
import pytest
import torch

from distperp_harness.model.lengths import LengthRule, declared_lengths, fresh_rope_each_forward


def _config(model_type, **extra):
    from transformers import AutoConfig

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)
    return AutoConfig.for_model(model_type, **{**base, **extra})


def _longrope_config(long_factor: float):
    """Phi-3 with longrope above an original context of 32 (every long factor ``long_factor``, short ones 1)."""
    rope = dict(rope_type="longrope", rope_theta=1e4, long_factor=[long_factor] * 8, short_factor=[1.0] * 8)
    return _config("phi3", max_position_embeddings=256, original_max_position_embeddings=32, rope_parameters=rope)


def test_longrope_keys_by_the_side_of_the_original_context():
    config = _longrope_config(2.0)
    rule = declared_lengths(config)
    assert rule.sides == (32,) and rule.exact_above is None and "longrope" in rule.describe()
    assert rule.keys(np.array([1, 31, 32, 33, 200])).tolist() == [0, 0, 0, 1, 1]
    assert [rule.key(n) for n in (32, 33)] == [0, 1]


def test_dynamic_rope_keys_each_length_above_the_context_alone():
    config = _config("llama", max_position_embeddings=32, rope_parameters=dict(rope_type="dynamic", factor=2.0))
    rule = declared_lengths(config)
    assert rule.sides == () and rule.exact_above == 32
    assert rule.keys(np.array([5, 32, 33, 40])).tolist() == [0, 0, -33, -40]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "mpt"])
def test_other_models_share_every_length(model_type):
    assert declared_lengths(_config(model_type)).uniform


def test_rules_merge_and_limit_to_the_most_careful():
    a, b = LengthRule((32,), None, ("a",)), LengthRule((), 100, ("b",))
    merged = a.merged(b)
    assert merged.sides == (32,) and merged.exact_above == 100 and merged.why == ("a", "b")
    limited = merged.at_most(20, "c")
    assert limited.sides == () and limited.exact_above == 20 and limited.why[-1] == "c"
    assert limited.at_most(50, "d") is limited


def _dynamic_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config("llama", max_position_embeddings=16, rope_parameters=dict(rope_type="dynamic", factor=2.0))
    return AutoModelForCausalLM.from_config(config).double().eval()


def test_a_dynamic_rope_forward_depends_on_its_own_length_alone():
    """transformers keeps the frequencies of the longest forward so far: a 24-token row after a 40-token one scores
    otherwise than on a fresh model. Hooked, every forward starts from the configured frequencies."""
    model = _dynamic_model()
    fresh = copy.deepcopy(model)
    short, long = torch.arange(3, 27)[None], torch.arange(3, 43)[None]
    with torch.no_grad():
        alone = fresh(short).logits
        model(long)
        assert not torch.equal(model(short).logits, alone)  # the state the hook removes
        assert fresh_rope_each_forward(model) == 1 and fresh_rope_each_forward(model) == 1
        model(long)
        assert torch.equal(model(short).logits, alone)


def test_models_without_dynamic_rope_are_not_hooked():
    from transformers import AutoModelForCausalLM

    assert fresh_rope_each_forward(AutoModelForCausalLM.from_config(_config("llama"))) == 0


def _phi3_rotary():
    """A longrope rotary embedding (original context 32, long factors 4): transformers' own class."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    return Phi3RotaryEmbedding(_longrope_config(4.0))


@pytest.mark.parametrize("no_grad_outside", [False, True])
def test_a_steered_rope_chooses_from_the_longest_position_it_is_given(no_grad_outside):
    """:func:`rope_choice_from` on transformers' longrope embedding (and on one whose forward is wrapped once more in
    ``torch.no_grad``, as transformers 4.48-4.57 wrote them): positions 0-19 with a longest position of 47 give the
    cosines and sines of a 48-position forward's first 20 (the long factors); without a longest position, the
    module's own choice (the short ones)."""
    from distperp_harness.model.lengths import rope_choice_from, unsteerable_ropes

    rotary = _phi3_rotary()
    if no_grad_outside:
        rotary.__class__ = type("Wrapped", (type(rotary),), {"forward": torch.no_grad()(type(rotary).forward)})
    x = torch.zeros(1, 1, 8)
    whole = [t[:, :20] for t in copy.deepcopy(rotary)(x, torch.arange(48)[None])]
    own = copy.deepcopy(rotary)(x, torch.arange(20)[None])
    longest = {"value": torch.tensor(47)}
    assert rope_choice_from(rotary, lambda _positions: longest["value"]) == 1 and unsteerable_ropes(rotary) == []
    steered = rotary(x, torch.arange(20)[None])
    assert all(torch.equal(a, b) for a, b in zip(steered, whole))
    assert not torch.equal(own[0], whole[0])  # the factors differ: the check can fail
    longest["value"] = None
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, torch.arange(20)[None]), own))


def test_a_rope_that_chooses_inline_is_refused_for_context_parallel_groups():
    """A length-chosen rotary embedding whose class chooses in its own code (not through ``dynamic_rope_update``,
    as transformers before 4.48 and remote code do) cannot be steered: ``cp_size`` > 1 refuses the model in one
    line that names the class and the fix."""
    from distperp_harness.errors import InputError
    from distperp_harness.model.cp_attention import check_attention
    from distperp_harness.model.lengths import unsteerable_ropes

    class InlineRotary(torch.nn.Module):
        rope_type = "longrope"

        def forward(self, x, position_ids):
            return x, position_ids

    model = torch.nn.Sequential(InlineRotary())
    model.config = type("Config", (), {"_attn_implementation": "sdpa"})()
    assert unsteerable_ropes(model) == ["InlineRotary"]
    with pytest.raises(InputError, match=r"cp_size=2: 'm' chooses its RoPE.*InlineRotary.*Fix: cp_size=1"):
        check_attention(model, 2, "m")
    check_attention(model, 1, "m")  # nothing to split
